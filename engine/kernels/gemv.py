"""Triton matrix-vector kernels that compute directly on GGUF blocks (decode: a few rows of activations).

One kernel body serves dense weights and routed experts: for experts the weight pointer of each (token, slot) comes
from a device-side table (`int64` addresses, one per expert: a VRAM slot or pinned host memory read over PCIe), so
one launch covers every selected expert of a layer with no host synchronisation, and the launch can be captured
in a CUDA graph. The dequantization happens in registers; nothing is written back to memory but the outputs.
"""

import functools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT

from engine.kernels import int8_activations
from engine.kernels.fused import last_to_finish, store_q8
from installer.engine_options import runtime_switches

# qtype -> (constexpr id, elements per block, bytes per block)
KERNEL_TYPES: dict[QT, tuple[int, int, int]] = {
    QT.Q4_K: (0, 256, 144),
    QT.Q6_K: (1, 256, 210),
    QT.Q8_0: (2, 32, 34),
    QT.Q4_0: (3, 32, 18),
    QT.Q5_K: (4, 256, 176),
    QT.F32: (6, 1, 4),  # the MoE router's float32 rows
    QT.MXFP4: (8, 32, 17),
    QT.IQ4_XS: (9, 256, 136),
}


def lut(qtype: QT, device: torch.device) -> torch.Tensor:
    """float32 [16] code values of a lookup-table block type on `device` (a placeholder for the others; cached
    per device by code_values, so a captured step copies nothing)."""
    from engine.gguf.quants import code_values

    return code_values(QT.IQ4_NL if qtype == QT.IQ4_XS else QT.MXFP4, device)


# Other kernel bodies for a block type, chosen per launch class by the tuning file.
_VARIANTS: dict[QT, tuple[int, ...]] = {QT.Q4_K: (0, 5, 10, 12), QT.Q6_K: (1, 11, 13), QT.F32: (6,)}
# Bodies on activations rounded to 8 bits (quantize_q8), as llama.cpp's MMVQ computes: not the float product the
# others give, so they run only under `--activations int8` (the default; see int8_activations).
APPROXIMATE = {12, 13}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter: no inline PTX there


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> float32 [T, K] holding, per row, K int8 values (x / scale rounded, a scale per 32) and then
    (scale, scale * sum of the 32 values) per block: the activations of the 8-bit bodies (APPROXIMATE), laid out so
    that a row starts K elements after the last, as the kernels index activations. One launch on a GPU."""
    if x.is_cuda or _INTERPRETED:
        from engine.kernels.fused import quantize_rows_q8

        return quantize_rows_q8(x)
    return quantize_q8_torch(x)


def quantize_q8_torch(x: torch.Tensor) -> torch.Tensor:
    """quantize_q8 in torch ops (the same rounding: times the reciprocal of the scale, half up)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // 32, 32)
    d = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = torch.floor(xb * inv[..., None] + 0.5).clamp(-127, 127)
    out = torch.zeros(t, k, dtype=torch.float32, device=x.device)
    raw = out.view(torch.uint8)  # [T, 4K] bytes
    raw[:, :k] = q.to(torch.int8).reshape(t, k).view(torch.uint8)
    meta = torch.stack((d, d * q.sum(dim=-1)), dim=-1).reshape(t, k // 16)  # float32 pairs
    raw[:, k : k + k // 4] = meta.contiguous().view(torch.uint8)
    return out


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """The float values the 8-bit bodies compute with for activations x [T, K]: quantize_q8's int8 codes times
    their block scales (the reference for those bodies, and what a float path must use to give their products)."""
    t, k = x.shape
    raw = quantize_q8_torch(x).view(torch.uint8)
    q = raw[:, :k].contiguous().view(torch.int8).float().reshape(t, k // 32, 32)
    d = raw[:, k : k + k // 4].contiguous().view(torch.float32).reshape(t, k // 32, 2)[..., :1]
    return (q * d).reshape(t, k)


@triton.jit
def k_scales(base, j, mask):
    """The 6-bit scale and min of sub-block `j` (0..7) of the Q4_K/Q5_K super-blocks at `base` (uint8 pointers;
    j broadcasts against them), as float32."""
    a = tl.load(base + 4 + j, mask=mask, other=0).to(tl.int32)
    b = tl.load(base + 8 + j, mask=mask, other=0).to(tl.int32)
    c = tl.load(base + 4 + tl.where(j >= 4, j - 4, j), mask=mask, other=0).to(tl.int32)
    sc = tl.where(j < 4, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """Per 32-bit lane: the sum of the four products of a's unsigned bytes and b's signed bytes. The dp4a
    instruction on a GPU; the same sum spelled out where Triton's interpreter runs the kernel (ASM off)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip
    acc = tl.zeros_like(a)
    for i in tl.static_range(4):
        acc += ((a >> (8 * i)) & 255) * (((b >> (8 * i)) & 255).to(tl.int8).to(tl.int32))
    return acc


@triton.jit
def _halfword_pair(p16, mask):
    """The 32-bit words made of the int16 at p16 (low half) and the next (high half): word loads for blocks that
    are only 2-byte aligned."""
    lo = tl.load(p16, mask=mask, other=0).to(tl.int32) & 0xFFFF
    return lo | (tl.load(p16 + 1, mask=mask, other=0).to(tl.int32) << 16)


@triton.jit
def _f16_at(p):
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _q4k_words(w_rows, nmask, sbi, c4, w4, nsb):
    """The nibbles of super-blocks sbi [1, SB, 1, 1] of the Q4_K rows at `w_rows` [BN, 1, 1] as 32-bit words
    [BN, SB, 4, 8]: word 8c + w holds elements 4w..4w+3 of sub-blocks 2c (low nibbles) and 2c + 1 (high)."""
    # Q4_K rows and super-blocks start at multiples of 16 bytes (144 = 9 * 16): say so, for vector loads
    p = tl.multiple_of(
        (w_rows[:, :, :, None] + sbi * 144 + 16).to(tl.pointer_type(tl.int32)), [16, 16, 16, 16]
    )
    return tl.load(p + 8 * c4 + w4, mask=nmask[:, None, None, None] & (sbi < nsb), other=0)


@triton.jit
def _q4k_scales(w_rows, nmask, sb3, c3, nsb):
    """d, dmin [BN, SB, 1] and the scales and mins of sub-blocks 2c and 2c + 1 [BN, SB, 4] of super-blocks sb3."""
    bm = nmask[:, None, None] & (sb3 < nsb)
    base = w_rows + sb3 * 144
    d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
    dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
    sc_lo, mn_lo = k_scales(base, 2 * c3, bm)
    sc_hi, mn_hi = k_scales(base, 2 * c3 + 1, bm)
    return d, dmin, sc_lo, mn_lo, sc_hi, mn_hi


@triton.jit
def _row_dot(
    w_rows,
    x_rows,
    K,
    nmask,
    lut,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    ASM: tl.constexpr = True,
):
    """sum_k W[n, k] * x[k] for the BLOCK_N rows starting at the uint8 pointers `w_rows` [BLOCK_N, 1, 1]."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    j = tl.arange(0, 8)[None, :, None]  # sub-block (or 32-element block) within a 256-element step
    l32 = tl.arange(0, 32)[None, None, :]
    m3 = nmask[:, None, None]
    if (
        QTYPE == 0
    ):  # Q4_K: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles; SB super-blocks a step
        s4 = tl.arange(0, SB)[None, :, None, None]
        j4 = tl.arange(0, 8)[None, None, :, None]
        l4 = tl.arange(0, 32)[None, None, None, :]
        m4 = nmask[:, None, None, None]
        w4 = w_rows[:, :, :, None]
        nsb = K // 256
        for step in range(0, tl.cdiv(nsb, SB)):
            sbi = step * SB + s4
            bm = m4 & (sbi < nsb)
            base = w4 + sbi * 144
            d = tl.load((base).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
            dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
            sc, mn = k_scales(base, j4, bm)
            qb = tl.load(base + 16 + 32 * (j4 // 2) + l4, mask=bm, other=0).to(tl.int32)
            q = tl.where(j4 % 2 == 1, qb >> 4, qb & 15)
            w = d * sc * q.to(tl.float32) - dmin * mn
            x = tl.load(x_rows[:, :, :, None] + sbi * 256 + j4 * 32 + l4, mask=sbi < nsb, other=0.0).to(
                tl.float32
            )
            acc += tl.sum(tl.sum(tl.sum(w * x, axis=3), axis=2), axis=1)
    elif QTYPE == 5:  # Q4_K reading each byte once: low nibbles are sub-block 2c, high nibbles 2c + 1
        s4 = tl.arange(0, SB)[None, :, None, None]
        c4 = tl.arange(0, 4)[None, None, :, None]
        l4 = tl.arange(0, 32)[None, None, None, :]
        m4 = nmask[:, None, None, None]
        w4 = w_rows[:, :, :, None]
        x4 = x_rows[:, :, :, None]
        nsb = K // 256
        for step in range(0, tl.cdiv(nsb, SB)):
            sbi = step * SB + s4
            bm = m4 & (sbi < nsb)
            base = w4 + sbi * 144  # [BN, SB, 1, 1]
            d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
            dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
            sc_lo, mn_lo = k_scales(base, 2 * c4, bm)  # [BN, SB, 4, 1]
            sc_hi, mn_hi = k_scales(base, 2 * c4 + 1, bm)
            qb = tl.load(base + 16 + 32 * c4 + l4, mask=bm, other=0).to(tl.int32)  # [BN, SB, 4, 32]
            xm = sbi < nsb
            xl = tl.load(x4 + sbi * 256 + 64 * c4 + l4, mask=xm, other=0.0).to(tl.float32)
            xh = tl.load(x4 + sbi * 256 + 64 * c4 + 32 + l4, mask=xm, other=0.0).to(tl.float32)
            dot_lo = tl.sum((qb & 15).to(tl.float32) * xl, axis=3)[:, :, :, None]
            dot_hi = tl.sum((qb >> 4).to(tl.float32) * xh, axis=3)[:, :, :, None]
            sum_lo = tl.sum(xl, axis=3)[:, :, :, None]
            sum_hi = tl.sum(xh, axis=3)[:, :, :, None]
            part = d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (mn_lo * sum_lo + mn_hi * sum_hi)
            acc += tl.sum(tl.sum(tl.sum(part, axis=3), axis=2), axis=1)
    elif QTYPE == 10:  # Q4_K, the nibbles read as 32-bit words (wide loads: more bytes in flight per load)
        s4 = tl.arange(0, SB)[None, :, None, None]
        c4 = tl.arange(0, 4)[None, None, :, None]
        w4 = tl.arange(0, 8)[None, None, None, :]
        b5 = tl.arange(0, 4)[None, None, None, None, :]
        s3 = tl.arange(0, SB)[None, :, None]
        c3 = tl.arange(0, 4)[None, None, :]
        x5 = x_rows[:, :, :, None, None]
        nsb = K // 256
        for step in range(0, tl.cdiv(nsb, SB)):
            sbi = step * SB + s4
            words = _q4k_words(w_rows, nmask, sbi, c4, w4, nsb)[:, :, :, :, None]  # [BN, SB, 4, 8, 1]
            sh = 8 * b5
            q_lo = ((words >> sh) & 15).to(tl.float32)
            q_hi = ((words >> (sh + 4)) & 15).to(tl.float32)
            sb5 = sbi[:, :, :, :, None]
            xoff = sb5 * 256 + 64 * c4[:, :, :, :, None] + 4 * w4[:, :, :, :, None] + b5
            xm = sb5 < nsb
            x_lo = tl.load(x5 + xoff, mask=xm, other=0.0).to(tl.float32)  # [1, SB, 4, 8, 4]
            x_hi = tl.load(x5 + xoff + 32, mask=xm, other=0.0).to(tl.float32)
            dot_lo = tl.sum(tl.sum(q_lo * x_lo, axis=4), axis=3)  # [BN, SB, 4]
            dot_hi = tl.sum(tl.sum(q_hi * x_hi, axis=4), axis=3)
            sum_lo = tl.sum(tl.sum(x_lo, axis=4), axis=3)  # [1, SB, 4]
            sum_hi = tl.sum(tl.sum(x_hi, axis=4), axis=3)
            d, dmin, sc_lo, mn_lo, sc_hi, mn_hi = _q4k_scales(w_rows, nmask, step * SB + s3, c3, nsb)
            part = d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (mn_lo * sum_lo + mn_hi * sum_hi)
            acc += tl.sum(tl.sum(part, axis=2), axis=1)
    elif QTYPE == 12:  # Q4_K against 8-bit activations (quantize_q8), four products an instruction (dp4a)
        # x_rows points at a row packed by quantize_q8: K int8 values, then (scale, scale * sum of q) per 32.
        s4 = tl.arange(0, SB)[None, :, None, None]
        c4 = tl.arange(0, 4)[None, None, :, None]
        w4 = tl.arange(0, 8)[None, None, None, :]
        s3 = tl.arange(0, SB)[None, :, None]
        c3 = tl.arange(0, 4)[None, None, :]
        xw = x_rows.to(tl.pointer_type(tl.int32))[:, :, :, None]
        meta = (x_rows.to(tl.pointer_type(tl.int8)) + K).to(tl.pointer_type(tl.float32))  # [1, 1, 1]
        nsb = K // 256
        for step in range(0, tl.cdiv(nsb, SB)):
            sbi = step * SB + s4
            words = _q4k_words(w_rows, nmask, sbi, c4, w4, nsb)  # [BN, SB, 4, 8]
            xm = sbi < nsb
            x_lo = tl.load(xw + sbi * 64 + 16 * c4 + w4, mask=xm, other=0)  # [1, SB, 4, 8]: 4 int8 each
            x_hi = tl.load(xw + sbi * 64 + 16 * c4 + 8 + w4, mask=xm, other=0)
            dot_lo = tl.sum(_dp4a(words & 0x0F0F0F0F, x_lo, ASM), axis=3).to(tl.float32)  # [BN, SB, 4]
            dot_hi = tl.sum(_dp4a((words >> 4) & 0x0F0F0F0F, x_hi, ASM), axis=3).to(tl.float32)
            sb3 = step * SB + s3
            blk = (sb3 * 8 + 2 * c3) * 2  # [1, SB, 4]: the low sub-block's (scale, sum) pair
            mm = sb3 < nsb
            dx_lo = tl.load(meta + blk, mask=mm, other=0.0)
            sx_lo = tl.load(meta + blk + 1, mask=mm, other=0.0)
            dx_hi = tl.load(meta + blk + 2, mask=mm, other=0.0)
            sx_hi = tl.load(meta + blk + 3, mask=mm, other=0.0)
            d, dmin, sc_lo, mn_lo, sc_hi, mn_hi = _q4k_scales(w_rows, nmask, sb3, c3, nsb)
            part = d * (sc_lo * dx_lo * dot_lo + sc_hi * dx_hi * dot_hi) - dmin * (
                mn_lo * sx_lo + mn_hi * sx_hi
            )
            acc += tl.sum(tl.sum(part, axis=2), axis=1)
    elif QTYPE == 13:  # Q6_K on 8-bit activations (dp4a); its 2-byte aligned blocks read as halfword pairs
        # word 16h + 8a + 4g + u of the low bits holds elements 128h + 32a + 16g + 4u + b (low nibbles) and + 64
        # (high nibbles) in its bytes b; word 8h + 4g + u of the high bits holds their top two bits at 2a (+ 4)
        s6 = tl.arange(0, SB)[None, :, None, None, None, None]
        h6 = tl.arange(0, 2)[None, None, :, None, None, None]
        a6 = tl.arange(0, 2)[None, None, None, :, None, None]
        g6 = tl.arange(0, 2)[None, None, None, None, :, None]  # 16-element scale group within 32
        u6 = tl.arange(0, 4)[None, None, None, None, None, :]
        n6 = nmask[:, None, None, None, None, None]
        r6 = w_rows[:, :, :, None, None, None]
        xw = x_rows.to(tl.pointer_type(tl.int32))[:, :, :, None, None, None]
        meta = (x_rows.to(tl.pointer_type(tl.int8)) + K).to(tl.pointer_type(tl.float32))[:, :, :, None, None]
        s5 = tl.arange(0, SB)[None, :, None, None, None]
        h5 = tl.arange(0, 2)[None, None, :, None, None]
        a5 = tl.arange(0, 2)[None, None, None, :, None]
        g5 = tl.arange(0, 2)[None, None, None, None, :]
        nsb = K // 256
        for step in range(0, tl.cdiv(nsb, SB)):
            sbi = step * SB + s6
            bm = n6 & (sbi < nsb)
            p16 = (r6 + sbi * 210).to(tl.pointer_type(tl.int16))
            ql = _halfword_pair(p16 + 32 * h6 + 16 * a6 + 8 * g6 + 2 * u6, bm)  # the low bits' words
            qh = _halfword_pair(p16 + 64 + 16 * h6 + 8 * g6 + 2 * u6, bm)  # the high bits' words
            q_lo = (ql & 0x0F0F0F0F) | (((qh >> (2 * a6)) & 0x03030303) << 4)  # unsigned 0..63 a byte
            q_hi = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * a6 + 4)) & 0x03030303) << 4)
            xm = sbi < nsb
            xo = sbi * 64 + 32 * h6 + 8 * a6 + 4 * g6 + u6
            x_lo = tl.load(xw + xo, mask=xm, other=0)
            x_hi = tl.load(xw + xo + 16, mask=xm, other=0)
            off = tl.full(q_lo.shape, 0x20202020, tl.int32)  # each code's -32, as a dot product of its own
            dot_lo = tl.sum(_dp4a(q_lo, x_lo, ASM) - _dp4a(off, x_lo, ASM), axis=5).to(tl.float32)
            dot_hi = tl.sum(_dp4a(q_hi, x_hi, ASM) - _dp4a(off, x_hi, ASM), axis=5).to(tl.float32)
            sb5 = step * SB + s5
            b5 = nmask[:, None, None, None, None] & (sb5 < nsb)
            base5 = (w_rows[:, :, :, None, None] + sb5 * 210).to(tl.pointer_type(tl.int8))
            sc_lo = tl.load(base5 + 192 + 8 * h5 + 2 * a5 + g5, mask=b5, other=0).to(tl.float32)
            sc_hi = tl.load(base5 + 196 + 8 * h5 + 2 * a5 + g5, mask=b5, other=0).to(tl.float32)
            d = tl.load((base5 + 208).to(tl.pointer_type(tl.float16)), mask=b5, other=0.0).to(tl.float32)
            blk = (sb5 * 8 + 4 * h5 + a5) * 2  # the low nibbles' 32-element x block (high: 2 blocks on)
            mm = sb5 < nsb
            dx_lo = tl.load(meta + blk, mask=mm, other=0.0)
            dx_hi = tl.load(meta + blk + 4, mask=mm, other=0.0)
            part = d * (dx_lo * sc_lo * dot_lo + dx_hi * sc_hi * dot_hi)
            acc += tl.sum(tl.sum(tl.sum(tl.sum(part, axis=4), axis=3), axis=2), axis=1)
    elif QTYPE == 6:  # float32 rows (the MoE router)
        k3 = tl.arange(0, 256 * SB)[None, None, :]
        m3k = nmask[:, None, None]
        for k0 in range(0, K, 256 * SB):
            kk = k0 + k3
            w = tl.load(w_rows.to(tl.pointer_type(tl.float32)) + kk, mask=m3k & (kk < K), other=0.0)
            x = tl.load(x_rows + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum(w * x, axis=2), axis=1)
    elif QTYPE == 1:  # Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d; SB a step
        s5 = tl.arange(0, SB)[None, :, None, None, None]
        h5 = tl.arange(0, 2)[None, None, :, None, None]
        q5 = tl.arange(0, 4)[None, None, None, :, None]
        l5 = tl.arange(0, 32)[None, None, None, None, :]
        n5 = nmask[:, None, None, None, None]
        w5 = w_rows[:, :, :, None, None]
        nsb = K // 256
        for step in range(0, tl.cdiv(nsb, SB)):
            sb5 = step * SB + s5
            bm = n5 & (sb5 < nsb)
            base = w5 + sb5 * 210
            d = tl.load((base + 208).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
            ql = tl.load(base + 64 * h5 + 32 * (q5 % 2) + l5, mask=bm, other=0).to(tl.int32)
            qh = tl.load(base + 128 + 32 * h5 + l5, mask=bm, other=0).to(tl.int32)
            lo = tl.where(q5 >= 2, ql >> 4, ql & 15)
            q = (lo | (((qh >> (2 * q5)) & 3) << 4)) - 32
            sc = tl.load(
                (base + 192 + 8 * h5 + l5 // 16 + 2 * q5).to(tl.pointer_type(tl.int8)), mask=bm, other=0
            )
            w = d * sc.to(tl.float32) * q.to(tl.float32)
            x = tl.load(
                x_rows[:, :, :, None, None] + sb5 * 256 + 128 * h5 + 32 * q5 + l5, mask=sb5 < nsb, other=0.0
            ).to(tl.float32)
            acc += tl.sum(tl.sum(tl.sum(tl.sum(w * x, axis=4), axis=3), axis=2), axis=1)
    elif QTYPE == 11:  # Q6_K with the bits read as 16-bit words (its 210-byte blocks are only 2-byte aligned)
        # halfword 32h + 16a + w of the low bits holds elements 128h + 32a + 2w + b (low nibbles) and + 64 (high
        # nibbles) in its bytes b; halfword 16h + w of the high bits holds their top two bits at 2q (q = a or a + 2)
        s6 = tl.arange(0, SB)[None, :, None, None, None, None]
        h6 = tl.arange(0, 2)[None, None, :, None, None, None]
        a6 = tl.arange(0, 2)[None, None, None, :, None, None]
        w6 = tl.arange(0, 16)[None, None, None, None, :, None]
        b6 = tl.arange(0, 2)[None, None, None, None, None, :]
        n6 = nmask[:, None, None, None, None, None]
        r6 = w_rows[:, :, :, None, None, None]
        x6 = x_rows[:, :, :, None, None, None]
        nsb = K // 256
        for step in range(0, tl.cdiv(nsb, SB)):
            sbi = step * SB + s6
            bm = n6 & (sbi < nsb)
            base = r6 + sbi * 210
            p16 = base.to(tl.pointer_type(tl.int16))
            ql = tl.load(p16 + 32 * h6 + 16 * a6 + w6, mask=bm, other=0).to(tl.int32)  # [BN, SB, 2, 2, 16, 1]
            qh = tl.load(p16 + 64 + 16 * h6 + w6, mask=bm, other=0).to(tl.int32)  # [BN, SB, 2, 1, 16, 1]
            sh = 8 * b6
            hb = qh >> (sh + 2 * a6)
            q_a = (((ql >> sh) & 15) | ((hb & 3) << 4)) - 32
            q_b = (((ql >> (sh + 4)) & 15) | (((hb >> 4) & 3) << 4)) - 32
            d = tl.load((base + 208).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
            scp = (base + 192 + 8 * h6 + 2 * a6 + w6 // 8).to(tl.pointer_type(tl.int8))
            sc_a = tl.load(scp, mask=bm, other=0).to(tl.float32)
            sc_b = tl.load(scp + 4, mask=bm, other=0).to(tl.float32)
            xm = sbi < nsb
            xoff = sbi * 256 + 128 * h6 + 32 * a6 + 2 * w6 + b6
            x_a = tl.load(x6 + xoff, mask=xm, other=0.0).to(tl.float32)
            x_b = tl.load(x6 + xoff + 64, mask=xm, other=0.0).to(tl.float32)
            part = d * (sc_a * q_a.to(tl.float32) * x_a + sc_b * q_b.to(tl.float32) * x_b)
            acc += tl.sum(tl.sum(tl.sum(tl.sum(tl.sum(part, axis=5), axis=4), axis=3), axis=2), axis=1)
    elif QTYPE == 4:  # Q5_K: as Q4_K plus 32 bytes of high bits before the nibbles
        for sb in range(0, K // 256):
            base = w_rows + sb * 176
            d = tl.load((base).to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
            dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
            sc, mn = k_scales(base, j, m3)
            qb = tl.load(base + 48 + 32 * (j // 2) + l32, mask=m3, other=0).to(tl.int32)
            qh = tl.load(base + 16 + l32, mask=m3, other=0).to(tl.int32)
            q = tl.where(j % 2 == 1, qb >> 4, qb & 15) + (((qh >> j) & 1) << 4)
            w = d * sc * q.to(tl.float32) - dmin * mn
            x = tl.load(x_rows + sb * 256 + j * 32 + l32).to(tl.float32)
            acc += tl.sum(tl.sum(w * x, axis=2), axis=1)
    elif QTYPE == 8:  # MXFP4: an e8m0 scale byte + 16 bytes of 4-bit codes (lo_hi order), eight blocks a step
        nblk = K // 32
        for step in range(0, tl.cdiv(nblk, 8)):
            blk = step * 8 + j
            bm = m3 & (blk < nblk)
            base = w_rows + blk * 17
            e = tl.load(base, mask=bm, other=0).to(tl.int32)
            # 2^(e - 128), the code values being doubled; e < 2 gives the subnormals gguf's dequantizer gives
            d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
            qb = tl.load(base + 1 + (l32 % 16), mask=bm, other=0).to(tl.int32)
            q = tl.load(lut + tl.where(l32 >= 16, qb >> 4, qb & 15))
            x = tl.load(x_rows + blk * 32 + l32, mask=blk < nblk, other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum(d * q * x, axis=2), axis=1)
    elif QTYPE == 9:  # IQ4_XS: d, 2 + 4 bytes of 6-bit sub-block scales, 128 bytes of IQ4_NL codes
        for sb in range(0, K // 256):
            base = w_rows + sb * 136
            d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
            sh = tl.load(base + 2, mask=m3, other=0).to(tl.int32) | (
                tl.load(base + 3, mask=m3, other=0).to(tl.int32) << 8
            )
            sl = (tl.load(base + 4 + j // 2, mask=m3, other=0).to(tl.int32) >> (4 * (j % 2))) & 15
            ls = sl | (((sh >> (2 * j)) & 3) << 4)  # [BN, 8, 1]
            qb = tl.load(base + 8 + 16 * j + (l32 % 16), mask=m3, other=0).to(tl.int32)
            q = tl.load(lut + tl.where(l32 >= 16, qb >> 4, qb & 15))
            x = tl.load(x_rows + sb * 256 + 32 * j + l32).to(tl.float32)
            acc += tl.sum(tl.sum(d * (ls - 32).to(tl.float32) * q * x, axis=2), axis=1)
    elif QTYPE == 2:  # Q8_0: d (f16) + 32 int8, eight blocks a step
        nblk = K // 32
        for step in range(0, tl.cdiv(nblk, 8)):
            blk = step * 8 + j
            bm = m3 & (blk < nblk)
            base = w_rows + blk * 34
            d = tl.load((base).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
            q = tl.load((base + 2 + l32).to(tl.pointer_type(tl.int8)), mask=bm, other=0).to(tl.float32)
            x = tl.load(x_rows + blk * 32 + l32, mask=blk < nblk, other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum(d * q * x, axis=2), axis=1)
    else:  # Q4_0: d (f16) + 16 bytes; element l < 16 low nibble of byte l, else high nibble of byte l - 16
        nblk = K // 32
        for step in range(0, tl.cdiv(nblk, 8)):
            blk = step * 8 + j
            bm = m3 & (blk < nblk)
            base = w_rows + blk * 18
            d = tl.load((base).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
            qb = tl.load(base + 2 + (l32 % 16), mask=bm, other=0).to(tl.int32)
            q = tl.where(l32 >= 16, qb >> 4, qb & 15) - 8
            x = tl.load(x_rows + blk * 32 + l32, mask=blk < nblk, other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum(d * q.to(tl.float32) * x, axis=2), axis=1)
    return acc


@triton.jit
def _gemv_kernel(
    w_ptr,
    row_bytes,
    x_ptr,
    y_ptr,
    r_ptr,  # [T, N] residual added to the output (HAS_RES)
    lut_ptr,  # float32 [16]: the code values of the lookup-table types (MXFP4, IQ4_XS)
    N,
    K,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    HAS_RES: tl.constexpr,
    ASM: tl.constexpr = True,
):
    """y[t, n] = W[n, :] . x[t, :] (+ r[t, n]) for a dense weight."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs < N
    w_rows = (w_ptr + offs.to(tl.int64) * row_bytes)[:, None, None]
    x_rows = (x_ptr + t * K + tl.zeros([1], dtype=tl.int32))[:, None, None]  # one activation row for all
    acc = _row_dot(w_rows, x_rows, K, nmask, lut_ptr, QTYPE, BLOCK_N, SB, ASM)
    if HAS_RES:
        acc += tl.load(r_ptr + t * N + offs, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * N + offs, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _moe_gemv_kernel(
    table_ptr,  # int64 [E]: address of each expert's first row (VRAM slot or pinned host memory)
    table2_ptr,  # int64 [E]: the up projection's table when FUSE_GLU
    row_bytes,
    ids_ptr,  # int [S]: expert id of each (token, slot), S = T * k
    x_ptr,  # [T, K] (X_PER_SLOT == 0) or [S, K]
    y_ptr,  # [S, N] float32
    lut_ptr,
    N,
    K,
    TOPK,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,  # Q4_K super-blocks read per step (more loads in flight)
    X_PER_SLOT: tl.constexpr,
    FUSE_GLU: tl.constexpr,  # 0: plain, 1: silu(gate) * up, 2: gelu_tanh(gate) * up
    ASM: tl.constexpr = True,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s).to(tl.int64)
    if X_PER_SLOT:
        x_row = x_ptr + s * K
    else:
        x_row = x_ptr + (s // TOPK) * K
    x_rows = (x_row + tl.zeros([1], dtype=tl.int32))[:, None, None]
    w_base = tl.load(table_ptr + e).to(tl.pointer_type(tl.uint8))
    if FUSE_GLU == 0:
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs < N
        acc = _row_dot((w_base + offs.to(tl.int64) * row_bytes)[:, None, None], x_rows, K, nmask, lut_ptr, QTYPE,
                       BLOCK_N, SB, ASM)  # fmt: skip
        tl.store(y_ptr + s * N + offs, acc.to(y_ptr.dtype.element_ty), mask=nmask)
    else:
        # The gate rows and the up rows of this block as one set of 2 * BLOCK_N rows: their loads go out together.
        u_base = tl.load(table2_ptr + e).to(tl.pointer_type(tl.uint8))
        r = tl.arange(0, 2 * BLOCK_N)
        offs2 = pid_n * BLOCK_N + r % BLOCK_N
        base = tl.where(r < BLOCK_N, w_base, u_base)
        both = _row_dot((base + offs2.to(tl.int64) * row_bytes)[:, None, None], x_rows, K, offs2 < N, lut_ptr, QTYPE,
                        2 * BLOCK_N, SB, ASM)  # fmt: skip
        gate, up = tl.split(tl.permute(tl.reshape(both, [2, BLOCK_N]), [1, 0]))  # [BLOCK_N] each
        if FUSE_GLU == 1:
            acc = gate / (1.0 + tl.exp(-gate)) * up
        else:
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            acc = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0)) * up
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + s * N + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def _moe_gemv_combine_kernel(
    table_ptr,  # int64 [E]: address of each expert's first row
    row_bytes,
    ids_ptr,  # int [T * TOPK]
    w_ptr,  # float32 [T * TOPK] routing weights
    x_ptr,  # [T * TOPK, K]: each slot's activation
    r_ptr,  # [T, N] float32 residual
    y_ptr,  # [T, N] float32
    lut_ptr,
    N,
    K,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,  # TOPK rounded up to a power of two
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    ASM: tl.constexpr = True,
    NEXT_NORM: tl.constexpr = False,  # the next layer's attention norm, 8-bit form, by the last program of a row
    done_ptr=None,  # int32 [>= T] zeros: programs of row t done (NEXT_NORM)
    nw_ptr=None,  # [N] the next layer's norm weight (NEXT_NORM)
    q_ptr=None,  # [T, N] float32 for quantize_q8's layout (NEXT_NORM)
    eps=0.0,
    BLOCK_D: tl.constexpr = 1,  # N rounded up to a power of two (NEXT_NORM)
):
    """y[t] = r[t] + sum over the token's slots s of w[s] * (W_ids[s] . x[s]): the down projection of every
    selected expert, the weighted combine and the residual add in one launch. The rows of all the slots form one
    set (their loads go out together) and are summed in a fixed order, so the result does not vary run to run.
    With NEXT_NORM the last program of a row to finish (an atomic count) also writes rms_norm(y[t]) * nw rounded
    to 8 bits, the next layer's q/k/v input, in place of that layer's own norm launch."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    r = tl.arange(0, SLOTS * BLOCK_N)
    j = r // BLOCK_N
    jc = tl.minimum(j, TOPK - 1)  # padding slots read a real slot's address; their rows are masked off
    offs = pid_n * BLOCK_N + r % BLOCK_N
    rmask = (offs < N) & (j < TOPK)
    s = t * TOPK + jc
    e = tl.load(ids_ptr + s).to(tl.int64)
    base = tl.load(table_ptr + e).to(tl.pointer_type(tl.uint8))  # [SLOTS * BLOCK_N]
    x_rows = (x_ptr + s.to(tl.int64) * K)[:, None, None]
    part = _row_dot((base + offs.to(tl.int64) * row_bytes)[:, None, None], x_rows, K, rmask, lut_ptr, QTYPE,
                    SLOTS * BLOCK_N, SB, ASM)  # fmt: skip
    wt = tl.where(j < TOPK, tl.load(w_ptr + s), 0.0)
    acc = tl.sum(tl.reshape(part * wt, [SLOTS, BLOCK_N]), axis=0)  # [BLOCK_N]
    offs1 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m1 = offs1 < N
    acc += tl.load(r_ptr + t * N + offs1, mask=m1, other=0.0)
    tl.store(y_ptr + t * N + offs1, acc, mask=m1)
    if NEXT_NORM:
        if last_to_finish(done_ptr + t):
            od = tl.arange(0, BLOCK_D)
            md = od < N
            h = tl.load(y_ptr + t * N + od, mask=md, other=0.0, volatile=True)  # other programs' rows: not L1
            yv = h * tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
            yv = yv * tl.load(nw_ptr + od, mask=md, other=0.0).to(tl.float32)
            store_q8(tl.where(md, yv, 0.0), q_ptr + t * N, N, BLOCK_D)
            tl.store(done_ptr + t, 0)


_BLOCK_N = 16
# Launch shapes per block type and class (see _config), measured by bench/gemv_graph_micro.py on the GPU and kept in
# gemv_tuned.json beside this file: [rows a program, super-blocks a step, warps, kernel variant].
# STRATA_GEMV_TUNED names another file.
_TUNED_FILE = Path(runtime_switches().gemv_tuned or Path(__file__).with_name("gemv_tuned.json"))


@functools.cache
def _tuned() -> dict[str, dict[str, list[int]]]:
    try:
        return json.loads(_TUNED_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _config(qtype: QT, n: int, k: int, kind: str = "dense") -> tuple[int, int, int, int]:
    """(rows a program, super-blocks a step, warps, kernel variant) for a launch, per block type and class
    ("small" and "large" dense weights, "moe" for the experts' gate/up, "moe_down" for their down projection with
    the combine). The variant is one of the kernel bodies that compute this block type (see _row_dot)."""
    cls = kind if kind != "dense" else "small" if n <= 8192 else "large"
    tuned = _tuned().get(qtype.name, {})
    int8 = int8_activations()
    got = (tuned.get(cls + ":q8") if int8 else None) or tuned.get(cls)
    got = got or tuned.get("small" if n <= 8192 else "large") or [_BLOCK_N, 1, 4]
    allowed = set(_VARIANTS.get(qtype, ()))
    if not int8:
        allowed -= APPROXIMATE
    variant = got[3] if len(got) > 3 and got[3] in allowed else KERNEL_TYPES[qtype][0]
    return got[0], got[1], got[2], variant


_GLU = {"silu": 1, "gelu_tanh": 2}


def _activations(x: torch.Tensor, variant: int, q8: bool) -> torch.Tensor:
    """x as the body reads it: rounded to 8 bits for the APPROXIMATE bodies (unless `q8` says it already is)."""
    if q8 and variant not in APPROXIMATE:  # a float body would read the packed bytes as activations
        raise ValueError(f"8-bit activations given to GEMV body {variant}, which reads floats (see wants_q8)")
    return quantize_q8(x) if variant in APPROXIMATE and not q8 else x


def wants_q8(qtype: QT, n: int, k: int, kind: str = "dense") -> bool:
    """Whether the launch picked for this weight reads 8-bit activations (quantize_q8's layout): with
    `--activations int8` (int8_activations) where the tuning file names an 8-bit body for the class."""
    return qtype in KERNEL_TYPES and _config(qtype, n, k, kind)[3] in APPROXIMATE


def supports(qtype: QT, k: int) -> bool:
    if qtype not in KERNEL_TYPES:
        return False
    elems = KERNEL_TYPES[qtype][1]
    return k % elems == 0


def gemv(
    raw: torch.Tensor,
    qtype: QT,
    n: int,
    k: int,
    x: torch.Tensor,
    block_n: int | None = None,
    num_warps: int | None = None,
    variant: int | None = None,
    sb: int | None = None,
    out_dtype: torch.dtype = torch.float32,
    residual: torch.Tensor | None = None,
    q8: bool = False,
) -> torch.Tensor:
    """raw uint8 [n, row_bytes] on CUDA, x [T, k] -> [T, n] in out_dtype (accumulated in float32), plus
    `residual` [T, n] where given (the residual add of the stream folded into the projection). `q8`: x is
    already quantize_q8's output (for the 8-bit bodies)."""
    x = x.contiguous()
    t = x.shape[0]
    y = torch.empty(t, n, dtype=out_dtype, device=x.device)
    bn, step, warps, tuned_variant = _config(qtype, n, k)
    block_n, sb, num_warps = block_n or bn, sb or step, num_warps or warps
    grid = (triton.cdiv(n, block_n), t)
    qid = tuned_variant if variant is None else variant
    x = _activations(x, qid, q8)
    res = residual.contiguous() if residual is not None else y
    _gemv_kernel[grid](
        raw, raw.shape[-1], x, y, res, lut(qtype, x.device), n, k,
        QTYPE=qid, BLOCK_N=block_n, SB=sb, HAS_RES=residual is not None, ASM=not _INTERPRETED, num_warps=num_warps,
    )  # fmt: skip
    return y


def moe_gemv(
    table: torch.Tensor,
    qtype: QT,
    row_bytes: int,
    ids: torch.Tensor,
    x: torch.Tensor,
    n: int,
    k: int,
    topk: int,
    x_per_slot: bool = False,
    up_table: torch.Tensor | None = None,
    act: str | None = None,
    launch: tuple[int, int, int] | None = None,
    variant: int | None = None,
    q8: bool = False,
) -> torch.Tensor:
    """For each (token, slot) s with expert ids[s]: y[s] = W_e . x (or act(W_e . x) * U_e . x with `up_table`).
    ids [T, topk] (device), x [T, k] or [T * topk, k] -> float32 [T * topk, n]."""
    x = x.contiguous()
    flat = ids.reshape(-1).contiguous()
    s = flat.numel()
    y = torch.empty(s, n, dtype=torch.float32, device=x.device)
    glu = _GLU[act] if up_table is not None and act is not None else 0
    block_n, sb, warps, tuned_variant = _config(qtype, n, k, "moe")
    if launch is not None:
        block_n, sb, warps = launch
    grid = (triton.cdiv(n, block_n), s)
    qid = tuned_variant if variant is None else variant
    x = _activations(x, qid, q8)
    _moe_gemv_kernel[grid](
        table,
        up_table if up_table is not None else table,
        row_bytes,
        flat,
        x,
        y,
        lut(qtype, x.device),
        n,
        k,
        topk,
        QTYPE=qid,
        BLOCK_N=block_n,
        SB=sb,
        X_PER_SLOT=int(x_per_slot),
        FUSE_GLU=glu,
        ASM=not _INTERPRETED,
        num_warps=warps,
    )
    return y


def moe_down_combine(
    table: torch.Tensor,
    qtype: QT,
    row_bytes: int,
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    n: int,
    k: int,
    launch: tuple[int, int, int] | None = None,
    variant: int | None = None,
    q8: bool = False,
    next_norm: tuple[torch.Tensor, float, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """ids, weights [T, topk], x [T * topk, k] (each slot's activation), residual [T, n] float32 ->
    float32 [T, n] = residual + the routing-weighted sum of the selected experts' down projections.
    `next_norm` (weight [n], eps, out float32 [T, n], done int32 [>= T] zeros): also rms_norm(y) * weight rounded
    to 8 bits (quantize_q8's layout) into out, from the same launch."""
    t, topk = ids.shape
    y = torch.empty(t, n, dtype=torch.float32, device=x.device)
    block_n, sb, warps, tuned_variant = _config(qtype, n, k, "moe_down")
    if launch is not None:
        block_n, sb, warps = launch
    qid = tuned_variant if variant is None else variant
    x = x.contiguous()
    x = _activations(x, qid, q8)
    extra = {}
    if next_norm is not None:
        nw, eps, q_out, done = next_norm
        extra = dict(
            NEXT_NORM=True, done_ptr=done, nw_ptr=nw, q_ptr=q_out, eps=eps, BLOCK_D=triton.next_power_of_2(n)
        )
    _moe_gemv_combine_kernel[(triton.cdiv(n, block_n), t)](
        table, row_bytes, ids.contiguous(), weights.contiguous(), x, residual.contiguous(), y,
        lut(qtype, x.device), n, k, TOPK=topk, SLOTS=triton.next_power_of_2(topk), QTYPE=qid, BLOCK_N=block_n, SB=sb,
        ASM=not _INTERPRETED, num_warps=warps, **extra,
    )  # fmt: skip
    return y
