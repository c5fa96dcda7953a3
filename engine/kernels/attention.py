"""Triton kernels for the attention half of a decode step (a few query rows against the KV cache).

`rope_store`: per-head RMS norm + RoPE of queries and keys and the write of keys and values into the cache at their
positions, one launch for what took seven (two norm+rope kernels, casts, two index copies).
`decode_attention`: grouped-query attention of those rows over cache positions below a static span (so a CUDA
graph replays it for every position of its bucket), split over the span and merged by a small second kernel when
the span is long; the GQA group of query heads shares each key/value block it loads.

Caches are float, int8 (a scale per position and head, which multiplies the scores and the probabilities) or q4_0
(engine/layers/kv_cache.py: packed halves, a scale per 32 values, dequantized as a tile is loaded). `QUANT` names
which: 0, 1 or 2 (`quant_kind`, `cache_layout`)."""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.fused import rope_pairs, store_q8_rows
from engine.kernels.launch import INTERPRETED as _INTERPRETED  # no inline PTX in Triton's interpreter
from engine.kernels.launch import pdl_args, pdl_enter

NO_QUANT, INT8, Q4_0 = 0, 1, 2


def quant_kind(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    """Which kind of cache `cache` is, for the kernels' QUANT: float, int8 codes, or q4_0's packed bytes."""
    if scale is None:
        return NO_QUANT
    return Q4_0 if cache.dtype == torch.uint8 else INT8


def cache_layout(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_cache: torch.Tensor
) -> tuple[int, int, int]:
    """(QUANT, key head size, value head size) of a layer's cache [ctx, Hkv, *] (q4_0 keeps two values a byte,
    and takes key and value heads of one power-of-two size: its kernels read a head as one tile)."""
    quant = quant_kind(k_cache, k_scale)
    per = 2 if quant == Q4_0 else 1
    dk, dv = k_cache.shape[2] * per, v_cache.shape[2] * per
    if quant == Q4_0 and not dk == dv == triton.next_power_of_2(dk):
        raise ValueError(
            f"a q4_0 cache takes key and value heads of one power-of-two size, not {dk} and {dv}"
        )
    return quant, dk, dv


@triton.jit
def q4_tile(c_ptr, s_ptr, s, sm, row_codes, row_scales, S: tl.constexpr, D: tl.constexpr):
    """The values [S, D] of positions s [S] (loaded where sm) of a q4_0 cache whose position rows lie row_codes
    bytes (codes) and row_scales scales apart. The bytes and the scales load as plain rows (D/2 and D/32 a
    position); the nibbles and the scales are spread over the D lanes in registers (loading them lane by lane,
    scale and byte again for each, read a 32K-deep cache at a quarter of bf16's pace). A code becomes a float as
    the bit pattern of 2^23 + code less 2^23 + 8 (an OR and an add, where an integer conversion runs at a quarter
    of the arithmetic's rate), the same value: a 32K prompt into a q4_0 cache read at 11,195 tok/s on an H200
    against 10,152 with the conversions (bench/results/long-context-q4-prompt-bits-h200.json)."""
    HALF: tl.constexpr = D // 2
    NB: tl.constexpr = D // 32
    byte = tl.load(c_ptr + s[:, None] * row_codes + tl.arange(0, HALF)[None, :], mask=sm[:, None], other=0)
    byte = byte.to(tl.int32)
    codes = tl.reshape(tl.permute(tl.join(byte & 15, byte >> 4), (0, 2, 1)), (S, D))  # halves side by side
    sc = tl.load(s_ptr + s[:, None] * row_scales + tl.arange(0, NB)[None, :], mask=sm[:, None], other=0.0)
    f = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    vals = tl.reshape(f, (S, NB, 32)) * sc.to(tl.float32)[:, :, None]
    return tl.reshape(vals, (S, D))


@triton.jit
def head_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, row, Dk, Dv, QUANT: tl.constexpr, BLOCK_DK: tl.constexpr,
              BLOCK_DV: tl.constexpr):  # fmt: skip
    """The four cache pointers moved to cache row `row` (position * HKV + key head): q4_0's heads (BLOCK_D values)
    are half a byte a value and a scale per 32, int8's a scale per row."""
    if QUANT == 2:
        return (kc_ptr + row * (BLOCK_DK // 2), vc_ptr + row * (BLOCK_DV // 2), ks_ptr + row * (BLOCK_DK // 32),
                vs_ptr + row * (BLOCK_DV // 32))  # fmt: skip
    return kc_ptr + row * Dk, vc_ptr + row * Dv, ks_ptr + row, vs_ptr + row


@triton.jit
def _store_q4(code_ptr, scale_ptr, x, BLOCK: tl.constexpr):
    """x [BLOCK] float32 (BLOCK the head size) as q4_0, as engine/layers/kv_cache.py quant4 writes it: BLOCK/2
    bytes of packed halves and BLOCK/32 float16 scales."""
    NB: tl.constexpr = BLOCK // 32
    xb = tl.reshape(x, (NB, 32))
    mx = tl.max(xb, axis=1)
    mn = tl.min(xb, axis=1)
    d = tl.where(-mn > mx, mn, mx) / -8.0  # the block's value of largest magnitude, over -8 (exact)
    inv = tl.where(d == 0.0, 0.0, tl.div_rn(tl.full([NB], 1.0, tl.float32), d))
    q = tl.minimum(tl.floor(xb * inv[:, None] + 8.5), 15.0).to(tl.int32)
    halves = tl.reshape(q, (2, BLOCK // 2))
    nib = tl.where(tl.arange(0, 2) == 0, 1, 16)
    tl.store(code_ptr + tl.arange(0, BLOCK // 2), tl.sum(halves * nib[:, None], axis=0).to(tl.uint8))
    tl.store(scale_ptr + tl.arange(0, NB), d.to(tl.float16))


@triton.jit
def _rope_store_kernel(
    q_ptr,  # [T, H*Dh] (a row stride apart: q, k and v may be column ranges of one QKV output)
    k_ptr,  # [T, Hkv*Dh]
    v_ptr,  # [T, Hkv*Dv]
    row_stride,
    qn_ptr,  # [Dh] query norm weight (when NORM)
    kn_ptr,  # [Dh]
    pos_ptr,  # [T] int64
    base_ptr,  # [T] int64: where each row's sequence starts in the caches (BASE), for slots sharing one cache
    inv_ptr,  # [ROT/2] float32 effective inverse frequencies
    qo_ptr,  # [T, H, Dh] out
    kc_ptr,  # [ctx, Hkv, Dh] key cache (float, int8 codes, or q4_0 bytes [ctx, Hkv, Dh/2]: QUANT)
    vc_ptr,  # [ctx, Hkv, Dv]
    ks_ptr,  # [ctx, Hkv] float16 scales of the int8 keys ([ctx, Hkv, Dh/32] for q4_0)
    vs_ptr,  # [ctx, Hkv]
    H,
    HKV,
    Dh,
    Dv,
    eps,
    mscale,
    ROT: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,  # >= max(Dh, Dv), power of two
    NORM: tl.constexpr,
    NEOX: tl.constexpr,
    BASE: tl.constexpr = False,
    QUANT: tl.constexpr = 0,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    hh = tl.program_id(1)  # 0..H-1 query heads, then H..H+HKV-1 key heads (each with its value head)
    offs = tl.arange(0, BLOCK)
    m = offs < Dh
    p = tl.load(pos_ptr + t)
    is_q = hh < H
    hk = hh - H
    if is_q:
        src = q_ptr + t * row_stride + hh * Dh
        nw = qn_ptr
    else:
        src = k_ptr + t * row_stride + hk * Dh
        nw = kn_ptr
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    i, partner, sign = rope_pairs(offs, HALF, NEOX)
    rot = offs < ROT
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / Dh + eps)
        x = x * inv_rms * tl.load(nw + offs, mask=m, other=0.0).to(tl.float32)
        xp = xp * inv_rms * tl.load(nw + partner, mask=rot, other=0.0).to(tl.float32)
    theta = p.to(tl.float32) * tl.load(inv_ptr + i, mask=rot, other=0.0)
    out = tl.where(rot, (x * tl.cos(theta) + sign * xp * tl.sin(theta)) * mscale, x)
    if is_q:
        tl.store(qo_ptr + (t * H + hh) * Dh + offs, out.to(qo_ptr.dtype.element_ty), mask=m)
    else:
        cp = p  # the row's cache row
        if BASE:
            cp += tl.load(base_ptr + t)
        mv = offs < Dv
        val = tl.load(v_ptr + t * row_stride + hk * Dv + offs, mask=mv, other=0.0)
        # int8 as KVCache's own write makes it: the key in the compute dtype, a float32 scale stored as float16
        if QUANT == 2:  # the head size is BLOCK (q4_0 takes heads of 64, 128 or 256)
            out = out.to(qo_ptr.dtype.element_ty).to(tl.float32)
            row = cp * HKV + hk
            _store_q4(kc_ptr + row * (BLOCK // 2), ks_ptr + row * (BLOCK // 32), out, BLOCK)
            _store_q4(vc_ptr + row * (BLOCK // 2), vs_ptr + row * (BLOCK // 32), val.to(tl.float32), BLOCK)
        elif QUANT == 1:
            out = out.to(qo_ptr.dtype.element_ty).to(tl.float32)
            _store_q8(kc_ptr + (cp * HKV + hk) * Dh + offs, ks_ptr + cp * HKV + hk, out, m)
            _store_q8(vc_ptr + (cp * HKV + hk) * Dv + offs, vs_ptr + cp * HKV + hk, val.to(tl.float32), mv)
        else:
            tl.store(kc_ptr + (cp * HKV + hk) * Dh + offs, out.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(vc_ptr + (cp * HKV + hk) * Dv + offs, val.to(vc_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _store_q8(code_ptr, scale_ptr, x, m):
    """x (float32, masked lanes 0) as int8 codes of one scale: amax / 127 (engine/layers/kv_cache.py quant8)."""
    sc = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-8) / 127.0
    q = x / sc
    r = tl.floor(q + 0.5)
    # half to even, as torch.round
    q = tl.where((r - q == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)
    tl.store(code_ptr, tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8), mask=m)
    tl.store(scale_ptr, sc.to(tl.float16))


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    rot: int,
    neox: bool,
    mscale: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_head: int,
    out_dtype: torch.dtype,
    base: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H*Dh], k [T, Hkv*Dh], v [T, Hkv*Dv] (rows of one stride; column slices of one tensor are fine) ->
    normalised, rotated queries [T, H, Dh]; the rotated keys and the values are written into the caches
    [ctx, Hkv, D] at `pos` [T], or at base + pos where `base` [T] (int64) places each row's sequence in caches
    that several sequences share. int8 caches take `k_scale`/`v_scale` [ctx, Hkv, 1] (float16), a scale per
    position and head, as KVCache writes them; q4_0 caches [ctx, Hkv, D/2] (uint8) take theirs [ctx, Hkv, D/32]."""
    t = q.shape[0]
    hkv = k_cache.shape[1]
    quant, dh, dv = cache_layout(k_cache, k_scale, v_cache)
    stride = q.stride(0)
    assert k.stride(0) == stride and v.stride(0) == stride and q.stride(1) == 1
    qo = torch.empty(t, n_head, dh, dtype=out_dtype, device=q.device)
    norm = q_norm is not None and k_norm is not None
    _rope_store_kernel[(t, n_head + hkv)](
        q,
        k,
        v,
        stride,
        q_norm if norm else q,
        k_norm if norm else q,
        pos,
        base if base is not None else pos,
        inv_freq,
        qo,
        k_cache,
        v_cache,
        k_scale if k_scale is not None else k_cache,
        v_scale if v_scale is not None else v_cache,
        n_head,
        hkv,
        dh,
        dv,
        eps,
        mscale,
        ROT=rot,
        HALF=rot // 2,
        BLOCK=triton.next_power_of_2(max(dh, dv)),
        NORM=norm,
        NEOX=neox,
        BASE=base is not None,
        QUANT=quant,
        **pdl_args(q.device),
    )
    return qo


@triton.jit
def _i8_f16(x, ASM: tl.constexpr):
    """int8 codes -> the same values as float16, four a 32-bit word: the byte with its sign bit flipped (code +
    128) under the exponent of float16's 1024 is 1024 + 128 + code, less 1152 (two byte permutes and two paired
    subtractions per four codes, where Triton's own conversion took eight instructions)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, c;
            xor.b32 t, $2, 0x80808080;
            mov.b32 c, 0x64806480;
            prmt.b32 $0, t, 0x64646464, 0x4140;
            prmt.b32 $1, t, 0x64646464, 0x4342;
            sub.f16x2 $0, $0, c;
            sub.f16x2 $1, $1, c;
            }""",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4,
        )  # fmt: skip
    return x.to(tl.float16)


@triton.jit
def _i8_words_f16(w, ASM: tl.constexpr):
    """32-bit words of four int8 codes -> four float16 tensors of w's shape, byte 0's first (as _i8_f16)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, c, lo, hi;
            xor.b32 t, $4, 0x80808080;
            mov.b32 c, 0x64806480;
            prmt.b32 lo, t, 0x64646464, 0x4140;
            prmt.b32 hi, t, 0x64646464, 0x4342;
            sub.f16x2 lo, lo, c;
            sub.f16x2 hi, hi, c;
            mov.b32 {$0, $1}, lo;
            mov.b32 {$2, $3}, hi;
            }""",
            constraints="=h,=h,=h,=h,r", args=[w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1,
        )  # fmt: skip
    b0, b1, b2, b3 = w & 255, (w >> 8) & 255, (w >> 16) & 255, (w >> 24) & 255
    return (tl.where(b0 > 127, b0 - 256, b0).to(tl.float16), tl.where(b1 > 127, b1 - 256, b1).to(tl.float16),
            tl.where(b2 > 127, b2 - 256, b2).to(tl.float16), tl.where(b3 > 127, b3 - 256, b3).to(tl.float16))  # fmt: skip


@triton.jit
def _i8_value_tile(c_ptr, s, sm, HKV, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                   ASM: tl.constexpr):  # fmt: skip
    """An int8 value tile [BLOCK_S, BLOCK_D] as float16, read as words of four codes and made floats in registers.
    The positions are the value product's inner dimension: codes taken to shared memory as bytes were read back a
    byte a load (no 8-bit transposing load on this generation); as 16-bit floats they go through ldmatrix. On an
    H200 at 32K with the float16 products, 25.1 -> 23.4 us a layer for one row, 106 -> 97 for 8 slots
    (bench/results/decode-attention-32k-int8-f16-h200.json)."""
    w4 = tl.arange(0, BLOCK_D // 4)
    wp = c_ptr.to(tl.pointer_type(tl.int32)) + s[:, None] * (HKV * D // 4) + w4[None, :]
    if MASKED:  # D is BLOCK_D (V_WORDS)
        w = tl.load(wp, mask=sm[:, None], other=0)
    else:
        w = tl.load(wp)
    v0, v1, v2, v3 = _i8_words_f16(w, ASM)
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BLOCK_S, BLOCK_D))


@triton.jit
def _cache_tile(c_ptr, s_ptr, s, sm, HKV, D, d, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                MASKED: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """The keys or values [BLOCK_S, BLOCK_D] of positions s of one key head (q4_0's as floats, made by their bit
    patterns; int8 codes as float16; float as stored), masked to positions where sm when MASKED."""
    if QUANT == 2:
        x = q4_tile(c_ptr, s_ptr, s, sm, HKV * (BLOCK_D // 2), HKV * (BLOCK_D // 32), BLOCK_S, BLOCK_D)
    else:
        if MASKED:
            x = tl.load(
                c_ptr + s[:, None] * (HKV * D) + d[None, :], mask=sm[:, None] & (d[None, :] < D), other=0.0
            )
        else:
            x = tl.load(c_ptr + s[:, None] * (HKV * D) + d[None, :], mask=d[None, :] < D, other=0.0)
        if QUANT == 1:
            x = _i8_f16(x, ASM)
    return x


@triton.jit
def _int8_scales(ks_ptr, vs_ptr, s0, hi, HKV, BLOCK_S: tl.constexpr, QUANT: tl.constexpr):
    """An int8 cache's key and value scales (float32 [BLOCK_S]) of positions s0.. below hi; zeros for other caches.
    The loop loads them a block ahead: they feed no tl.dot, so Triton's pipeliner leaves them out, and loaded in
    the block that uses them each was a memory round trip in every block's chain."""
    if QUANT == 1:
        s = s0 + tl.arange(0, BLOCK_S)
        sm = s < hi
        return (tl.load(ks_ptr + s * HKV, mask=sm, other=0.0).to(tl.float32),
                tl.load(vs_ptr + s * HKV, mask=sm, other=0.0).to(tl.float32))  # fmt: skip
    else:
        return tl.zeros([BLOCK_S], tl.float32), tl.zeros([BLOCK_S], tl.float32)


@triton.jit
def _attend_block(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, s0, hi, m_i, l_i, acc, ksc, vsc, HKV, Dk, Dv, qk_scale,
                  softcap, dk, dv, BLOCK_S: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                  IEEE: tl.constexpr, QUANT: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                  ASM: tl.constexpr, V_WORDS: tl.constexpr, q_lo=None, q_row=None,
                  QK8: tl.constexpr = False):  # fmt: skip
    """One block of positions s0.. into the running max m_i, sum l_i and output acc of a program's query heads.
    MASKED: positions from `hi` on are left out (only the last block of a split: the others run without masks).
    Scores are in base-2 units (qk_scale carries log2(e); exp2 throughout, and the merge takes base-2 maxima), and
    an int8 key's scale is folded into the score scale: on an H200 at 32K, 8 rows over int8 caches 126 -> 110 us a
    layer against the masked, natural-base body (bench/results/decode-attention-32k-lean-h200.json). ksc/vsc: an
    int8 cache's key and value scales of these positions, loaded a block ahead by the caller (_int8_scales). Over
    int8 codes both products are float16 (q comes scaled into its range): the codes are exact there and are made
    float16 in fewer instructions than bfloat16."""
    s = s0 + tl.arange(0, BLOCK_S)
    sm = s < hi
    if QK8:  # int8 keys as they are, against q's two int8 halves (_q_halves): no conversion of the codes
        kp = kc_ptr + s[:, None] * (HKV * Dk) + dk[None, :]
        if MASKED:
            kb = tl.load(kp, mask=sm[:, None] & (dk[None, :] < Dk), other=0)
        else:
            kb = tl.load(kp, mask=dk[None, :] < Dk, other=0)
        kt = tl.trans(kb)
        sc = tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32)
        sc += tl.dot(q_lo, kt, out_dtype=tl.int32).to(tl.float32) * (1.0 / 254.0)
        sc = sc * q_row[:, None] * ksc[None, :]
    else:
        kb = _cache_tile(kc_ptr, ks_ptr, s, sm, HKV, Dk, dk, BLOCK_S, BLOCK_DK, QUANT, MASKED, ASM)  # [BS,DK]
        if IEEE:  # float32 compute stays float32 (no TF32 rounding)
            sc = tl.dot(q, tl.trans(kb.to(q.dtype)), input_precision="ieee")  # [GP, BS]
        else:
            sc = tl.dot(q, tl.trans(kb.to(q.dtype))).to(tl.float32)
        if QUANT == 1:  # int8 codes are exact in the compute dtype; their scales multiply the scores
            sc = sc * (ksc * qk_scale)[None, :]
        else:
            sc = sc * qk_scale
    if SOFTCAP:  # the cap in natural units
        sc = sc * 0.6931471805599453
        sc = softcap * (2.0 / (1.0 + tl.exp(-2.0 * sc / softcap)) - 1.0) * 1.4426950408889634
    if MASKED:
        sc = tl.where(sm[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    if QUANT == 1 and V_WORDS:
        vb = _i8_value_tile(vc_ptr, s, sm, HKV, Dv, BLOCK_S, BLOCK_DV, MASKED, ASM)  # [BS, DV] float16
    else:
        vb = _cache_tile(vc_ptr, vs_ptr, s, sm, HKV, Dv, dv, BLOCK_S, BLOCK_DV, QUANT, MASKED, ASM)
    if QUANT == 1:
        pr = pr * vsc[None, :]
    if IEEE:
        pv = tl.dot(pr, vb.to(tl.float32), input_precision="ieee")  # [GP, DV]
    elif QUANT == 1:
        pv = tl.dot(pr.to(tl.float16), vb.to(tl.float16)).to(tl.float32)
    else:
        pv = tl.dot(pr.to(q.dtype), vb.to(q.dtype)).to(tl.float32)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _q_halves(q, qk_scale):
    """q [GP, DK] as two int8 tensors and a scale per row: q = row * (hi + lo / 254), hi the codes of q over its
    row's largest value / 127 and lo those of what they leave (half a step at most), so that the scores of int8
    keys are two int8 products (no float conversion of the codes) to ~15 bits, finer than float16's 11. `row`
    takes the score scale too."""
    qf = q.to(tl.float32)
    step = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-30) / 127.0  # [GP]
    u = qf / step[:, None]
    hi = tl.minimum(tl.maximum(tl.floor(u + 0.5), -127.0), 127.0)
    lo = tl.minimum(tl.maximum(tl.floor((u - hi) * 254.0 + 0.5), -127.0), 127.0)
    return hi.to(tl.int8), lo.to(tl.int8), step * qk_scale


@triton.jit
def _decode_attn_kernel(
    q_ptr,  # [T, H, Dk]
    kc_ptr,  # [ctx, HKV, Dk] (float, int8 codes, or q4_0 bytes [ctx, HKV, Dk/2]: QUANT)
    vc_ptr,  # [ctx, HKV, Dv]
    ks_ptr,  # [ctx, HKV] scales of the int8 keys ([ctx, HKV, Dk/32] for q4_0)
    vs_ptr,  # [ctx, HKV]
    pos_ptr,  # [T] int64
    base_ptr,  # [T] int64: where each row's sequence starts in the caches (BASE)
    o_ptr,  # [T, H, Dv] (not SPLIT) or partials [T, H, splits, Dv] float32
    ml_ptr,  # [T, H, splits, 2] float32 running max and sum (SPLIT)
    q8_ptr,  # float32 [T, H * Dv]: the output rounded to 8 bits too, in quantize_q8's layout (Q8, not SPLIT)
    H,
    HKV,
    Dk,
    Dv,
    span,
    chunk,  # positions per split
    splits,  # programs along the span (1: no split, the output written whole)
    window,  # 0: none
    scale,
    softcap,  # 0: none
    SPLIT: tl.constexpr,  # splits > 1 (a runtime count: each span bucket's own would be a compile of its own)
    G: tl.constexpr,  # query heads per key head
    GP: tl.constexpr,  # G padded to a tl.dot-able power of two (>= 16)
    BLOCK_S: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IEEE: tl.constexpr,
    Q8: tl.constexpr = False,
    BASE: tl.constexpr = False,
    QUANT: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = False,
    ASM: tl.constexpr = True,
    V_WORDS: tl.constexpr = False,  # int8 value heads read as 32-bit words (a power of two >= 4, aligned rows)
    QK8: tl.constexpr = False,  # DecodeTune.qk8 (int8 caches, bfloat16 queries)
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    pid = tl.program_id(0)  # t * HKV + hk
    sp = tl.program_id(1)
    pdl_enter(PDL)
    t = pid // HKV
    hk = pid % HKV
    p = tl.load(pos_ptr + t).to(tl.int32)
    row0 = hk.to(tl.int64)  # the row's sequence's first cache row, its key head
    if BASE:
        row0 += tl.load(base_ptr + t) * HKV
    kc_ptr, vc_ptr, ks_ptr, vs_ptr = head_rows(
        kc_ptr, vc_ptr, ks_ptr, vs_ptr, row0, Dk, Dv, QUANT, BLOCK_DK, BLOCK_DV
    )
    g = tl.arange(0, GP)
    gm = g < G
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    heads = hk * G + g  # [GP]
    q = tl.load(
        q_ptr + (t * H + heads)[:, None] * Dk + dk[None, :], mask=gm[:, None] & (dk[None, :] < Dk), other=0.0
    )  # [GP, DK]
    qk_scale = scale * 1.4426950408889634  # base-2 scores
    q_lo = q
    q_row = tl.zeros([GP], tl.float32)
    if QK8:
        q, q_lo, q_row = _q_halves(q, qk_scale)
    elif QUANT == 1 and not IEEE:  # float16 products over int8 codes: q over its largest value, which the
        qf = q.to(tl.float32)  # score scale takes back (a bfloat16 query may lie beyond float16's range)
        qa = tl.maximum(tl.max(tl.max(tl.abs(qf), axis=1), axis=0), 1e-30)
        q = (qf / qa).to(tl.float16)
        qk_scale = qk_scale * qa
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, BLOCK_DV], dtype=tl.float32)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, span)
    hi = tl.minimum(hi, p + 1)  # causal: nothing beyond this row's own position
    if window > 0:
        lo = tl.maximum(lo, p - window + 1)
    full = lo + (tl.maximum(hi - lo, 0) // BLOCK_S) * BLOCK_S  # whole blocks without masks, then the last
    ksc, vsc = _int8_scales(ks_ptr, vs_ptr, lo, hi, HKV, BLOCK_S, QUANT)
    for s0 in range(lo, full, BLOCK_S):
        nks, nvs = _int8_scales(ks_ptr, vs_ptr, s0 + BLOCK_S, hi, HKV, BLOCK_S, QUANT)
        m_i, l_i, acc = _attend_block(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, s0, hi, m_i, l_i, acc, ksc, vsc, HKV, Dk,
                                      Dv, qk_scale, softcap, dk, dv, BLOCK_S, BLOCK_DK, BLOCK_DV, IEEE, QUANT,
                                      False, SOFTCAP, ASM, V_WORDS, q_lo, q_row, QK8)  # fmt: skip
        ksc, vsc = nks, nvs
    for s0 in range(full, hi, BLOCK_S):  # the partial last block (its scales loaded above)
        m_i, l_i, acc = _attend_block(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, s0, hi, m_i, l_i, acc, ksc, vsc, HKV, Dk,
                                      Dv, qk_scale, softcap, dk, dv, BLOCK_S, BLOCK_DK, BLOCK_DV, IEEE, QUANT,
                                      True, SOFTCAP, ASM, V_WORDS, q_lo, q_row, QK8)  # fmt: skip
    om = gm[:, None] & (dv[None, :] < Dv)
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(o_ptr + (t * H + heads)[:, None] * Dv + dv[None, :], out.to(o_ptr.dtype.element_ty), mask=om)
        if Q8:  # each head's slice of the row, for the output projection's 8-bit GEMV: no rounding launch
            codes, scales = _q8_slices(q8_ptr, t, heads, H, Dv)
            store_q8_rows(out, codes, scales, gm, Dv, GP, BLOCK_DV)
    else:
        row = (t * H + heads) * splits + sp  # [GP]
        tl.store(o_ptr + row[:, None] * Dv + dv[None, :], acc, mask=om)
        tl.store(ml_ptr + row * 2, m_i, mask=gm)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gm)


@triton.jit
def _q8_slices(q8_ptr, t, heads, H, Dv):
    """Where heads `heads` of output row t go in its 8-bit form (quantize_q8's layout: H * Dv codes, then a
    scale pair per 32): their codes' and their scales' pointers."""
    rowb = q8_ptr.to(tl.pointer_type(tl.int8)) + t * (H * Dv) * 4
    meta = (rowb + H * Dv).to(tl.pointer_type(tl.float32))
    return rowb + heads * Dv, meta + heads * (Dv // 32) * 2


@triton.jit
def _merge_kernel(
    part_ptr,  # [T*H, SPLITS, Dv] float32 (SPLITS: a runtime count)
    ml_ptr,  # [T*H, SPLITS, 2]
    o_ptr,  # [T*H, Dv]
    q8_ptr,  # as in _decode_attn_kernel (Q8)
    H,
    Dv,
    SPLITS,
    SPLITS_P2: tl.constexpr,  # SPLITS rounded up to a power of two (tl.arange's)
    BLOCK_DV: tl.constexpr,  # the values of a head one program merges (a head's slice: program_id(1))
    Q8: tl.constexpr = False,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    pdl_enter(PDL)
    r = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_DV
    s = tl.arange(0, SPLITS_P2)
    sm = s < SPLITS
    dv = d0 + tl.arange(0, BLOCK_DV)
    m = tl.load(ml_ptr + (r * SPLITS + s) * 2, mask=sm, other=float("-inf"))
    lsum = tl.load(ml_ptr + (r * SPLITS + s) * 2 + 1, mask=sm, other=0.0)
    mx = tl.max(m, axis=0)
    # base-2 maxima (_attend_block); splits wholly past the position weigh nothing
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx))
    pm = sm[:, None] & (dv[None, :] < Dv)
    part = tl.load(part_ptr + (r * SPLITS + s)[:, None] * Dv + dv[None, :], mask=pm, other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(o_ptr + r * Dv + dv, out.to(o_ptr.dtype.element_ty), mask=dv < Dv)
    if Q8:
        codes, scales = _q8_slices(q8_ptr, r // H, r % H, H, Dv)
        ones = tl.full([1], 1, tl.int1)
        store_q8_rows(out[None, :], codes[None] + d0, scales[None] + d0 // 16, ones, Dv - d0, 1, BLOCK_DV)


# Spans up to this many positions go in one launch; longer ones are split over enough programs to fill the GPU
# (at least SPLIT_MIN positions each), with a second, merging launch. With one program per key head a long span
# was read by a handful of programs, one block after the other.
SPLIT_FROM = 256
SPLIT_MIN = 128


@dataclass(frozen=True)
class DecodeTune:
    """Launch shape of a long span's split decode (bench/decode_attention_micro.py sweeps it): programs per
    multiprocessor, positions a block, warps, pipeline stages and values of a head a merging program takes (None:
    the kernels' defaults: 64 positions a block, 128 for int8 codes; Triton's stages; the whole head)."""

    per_sm: int = 2
    block_s: int | None = None
    warps: int = 4
    stages: int | None = None
    merge_block: int | None = 32
    qk8: bool = False  # int8 keys times q in two int8 halves (_q_halves), instead of keys made float16


# Measured on an H200 at a depth of 32,768 (48 layers' caches, bench/results/decode-attention-32k-h200.json): two
# programs per multiprocessor (a power-of-two split count rounded up had made 128 programs a row's span, which read
# too little each), 128-position blocks for int8 codes, and the merge spread over 32-value slices of a head: 28.6
# -> 24.1 us a layer for bf16, 30.6 -> 25.8 for int8, 37.6 -> 34.3 for q4_0. Splits are whole blocks (_split_chunk).
DEFAULT_TUNE = DecodeTune()


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 64
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_chunk(t: int, hkv: int, span: int, block_s: int, device: torch.device, per_sm: int = 2) -> int:
    """Positions per split of the span: enough programs for `per_sm` a multiprocessor, each at least SPLIT_MIN
    positions, and a whole number of `block_s` blocks, so that no program ends on a nearly empty masked block (the
    span's 256-position bucket over 64 splits had made 516 positions a program at 32K: 4 blocks of 128 and one of
    4, a fifth round trip for every program)."""
    if span <= SPLIT_FROM:
        return span
    want = max(1, min(per_sm * _multiprocessors(device) // (t * hkv), span // SPLIT_MIN))
    blocks = triton.cdiv(span, block_s)
    return triton.cdiv(blocks, want) * block_s


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    span: int,
    window: int,
    scale: float,
    softcap: float = 0.0,
    chunk: int | None = None,
    q8_out: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tune: DecodeTune = DEFAULT_TUNE,
) -> torch.Tensor:
    """q [T, H, Dk] at positions `pos` [T] over the cache positions below `span` (each row sees positions <= its
    own, and within `window` of it when window > 0) -> [T, H*Dv] in q's dtype. `chunk`: positions a program
    covers (tests); by default chosen from the span and the GPU's size. `q8_out` (float32 [T, H*Dv], Dv a multiple
    of 32): also filled with the output rounded to 8 bits in engine.kernels.gemv.quantize_q8's layout. `base` [T]
    (int64): where each row's sequence starts in caches several sequences share (rows of different slots). int8
    caches take `k_scale`/`v_scale` [ctx, Hkv, 1], their scale per position and head; q4_0 caches [ctx, Hkv, D/2]
    (uint8) theirs [ctx, Hkv, D/32]. `tune`: the split launch's shape."""
    t, h, dk = q.shape
    hkv = k_cache.shape[1]
    quant, _, dvv = cache_layout(k_cache, k_scale, v_cache)
    g = h // hkv
    block_s = 64 if max(dk, dvv) <= 128 else 32  # large heads: smaller blocks fit in shared memory
    split_block = block_s  # the split launch's block
    if tune.block_s is not None:
        split_block = tune.block_s
    elif quant == INT8 and max(dk, dvv) <= 128:  # a byte a value: twice the positions in a tile's bytes
        split_block = 128
    if chunk is None:
        chunk = _split_chunk(t, hkv, span, split_block, q.device, tune.per_sm)
    splits = triton.cdiv(span, chunk)
    out = torch.empty(t, h, dvv, dtype=q.dtype, device=q.device)
    common = dict(
        G=g,
        GP=max(16, triton.next_power_of_2(g)),
        BLOCK_S=block_s,
        BLOCK_DK=triton.next_power_of_2(dk),
        BLOCK_DV=triton.next_power_of_2(dvv),
        IEEE=q.dtype == torch.float32,
        BASE=base is not None,
        QUANT=quant,
        SOFTCAP=softcap > 0,  # a compile-time branch: the cap's code out of the others' loop
        ASM=not _INTERPRETED,
        V_WORDS=quant == INT8 and 4 <= dvv == triton.next_power_of_2(dvv) and v_cache.data_ptr() % 4 == 0,
        QK8=tune.qk8 and quant == INT8 and q.dtype != torch.float32,
    )
    bp = base if base is not None else pos
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    q8 = q8_out is not None
    if q8 and (dvv % 32 or tuple(q8_out.shape) != (t, h * dvv) or q8_out.dtype != torch.float32):
        raise ValueError(f"q8_out must be float32 [{t}, {h * dvv}] with the value head size a multiple of 32")
    qo = q8_out if q8_out is not None else out
    if splits == 1:
        _decode_attn_kernel[(t * hkv, 1)](
            q, k_cache, v_cache, ks, vs, pos, bp, out, out, qo, h, hkv, dk, dvv, span, chunk, 1, window, scale,
            softcap, SPLIT=False, Q8=q8, **common, **pdl_args(q.device),
        )  # fmt: skip
        return out.view(t, h * dvv)
    part = torch.empty(t * h, splits, dvv, dtype=torch.float32, device=q.device)
    ml = torch.empty(t * h, splits, 2, dtype=torch.float32, device=q.device)
    launch = dict(num_warps=tune.warps)
    common["BLOCK_S"] = split_block
    if tune.stages is not None:
        launch["num_stages"] = tune.stages
    _decode_attn_kernel[(t * hkv, splits)](
        q, k_cache, v_cache, ks, vs, pos, bp, part, ml, qo, h, hkv, dk, dvv, span, chunk, splits, window, scale,
        softcap, SPLIT=True, **common, **launch, **pdl_args(q.device),
    )  # fmt: skip
    mb = common["BLOCK_DV"] if tune.merge_block is None else min(tune.merge_block, common["BLOCK_DV"])
    mb = max(mb, 32) if q8 else mb  # the 8-bit form's scale covers 32 values
    _merge_kernel[(t * h, triton.cdiv(dvv, mb))](
        part, ml, out, qo, h, dvv, splits, SPLITS_P2=triton.next_power_of_2(splits), BLOCK_DV=mb, Q8=q8,
        **pdl_args(q.device),
    )  # fmt: skip
    return out.view(t, h * dvv)
