"""Triton kernel for the attention of a prompt chunk (many query rows) straight from the KV cache.

Flash-style: each program holds a block of one head's query rows and walks the key blocks those rows may see with an
online softmax, so nothing of size rows x keys is ever written. It reads the cache as it lies ([ctx, Hkv, D], float
or int8 with a scale per position and head, or q4_0's packed bytes dequantized as a tile loads), so a chunk deep in
a long prompt neither copies the cache to another dtype nor repeats the key heads over the query heads, and it skips
the key blocks the causal mask (and a sliding window) rule out: the torch path it replaces did all three, which held
a 32,768-token prompt at 0.29x llama.cpp.
Key blocks that every row of the program sees in full run without the mask's arithmetic."""

import torch
import triton
import triton.language as tl

from engine.kernels.attention import Q4_0, cache_layout, head_rows, q4_tile


@triton.jit
def _block(
    q,
    acc,
    m_i,
    l_i,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    p,  # [BM] positions of the rows (-1: a row past the chunk)
    s0,
    HKV,
    Dk,
    Dv,
    span,
    window,
    qk_scale,
    softcap,
    dk,
    dv,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
):
    s = s0 + tl.arange(0, BLOCK_N)
    sm = s < span
    if QUANT == 2:  # heads of DK = DV values, dk and dv their lanes
        kt = tl.trans(q4_tile(kc_ptr, ks_ptr, s, sm, HKV * (DK // 2), HKV * (DK // 32), BLOCK_N, DK))
    else:
        kt = tl.load(
            kc_ptr + s[None, :] * (HKV * Dk) + dk[:, None], mask=sm[None, :] & (dk[:, None] < Dk), other=0.0
        )  # [DK, BN]
    if IEEE:  # float32 compute stays float32 (no TF32 rounding)
        sc = tl.dot(q, kt.to(q.dtype), input_precision="ieee")
    else:
        sc = tl.dot(q, kt.to(q.dtype))  # int8 codes are exact in bf16/f16; their scale multiplies the scores
    if QUANT == 1:
        sc = sc * tl.load(ks_ptr + s * HKV, mask=sm, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:  # softcap * tanh(x / softcap), in the log2 domain after
        x = sc * (qk_scale / softcap)
        sc = softcap * (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0) * 1.4426950408889634
    else:
        sc = sc * (qk_scale * 1.4426950408889634)
    if MASK:
        ok = (s[None, :] <= p[:, None]) & sm[None, :]
        if window > 0:
            ok = ok & (p[:, None] - s[None, :] < window)
        sc = tl.where(ok, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    # a row with nothing seen yet: no NaN from -inf - -inf
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    pr = tl.math.exp2(sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    if QUANT == 2:
        vb = q4_tile(vc_ptr, vs_ptr, s, sm, HKV * (DV // 2), HKV * (DV // 32), BLOCK_N, DV)
    else:
        vb = tl.load(
            vc_ptr + s[:, None] * (HKV * Dv) + dv[None, :], mask=sm[:, None] & (dv[None, :] < Dv), other=0.0
        )  # [BN, DV]
    if QUANT == 1:
        pr = pr * tl.load(vs_ptr + s * HKV, mask=sm, other=0.0).to(tl.float32)[None, :]
    if IEEE:
        pv = tl.dot(pr, vb.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(pr.to(q.dtype), vb.to(q.dtype))
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _prefill_attn_kernel(
    q_ptr,  # [T, H, Dk]
    kc_ptr,  # [ctx, HKV, Dk] float, int8 codes, or q4_0 bytes [ctx, HKV, Dk/2] (QUANT)
    vc_ptr,  # [ctx, HKV, Dv]
    ks_ptr,  # [ctx, HKV] scales of the keys ([ctx, HKV, Dk/32] for q4_0)
    vs_ptr,  # [ctx, HKV]
    pos_ptr,  # [T] int64
    sink_ptr,  # [H] float32 (SINKS)
    o_ptr,  # [T, H, Dv]
    T,
    H,
    HKV,
    Dk,
    Dv,
    span,
    window,  # 0: none
    qk_scale,
    softcap,
    G: tl.constexpr,  # query heads per key head
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    IEEE: tl.constexpr,
):
    h = tl.program_id(0)  # heads fastest: the G heads that read one key head's blocks run side by side (L2)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # the last rows, which see the most keys, first
    hk = h // G
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < T
    p = tl.load(pos_ptr + rows, mask=rm, other=-1).to(tl.int32)
    q_lo = tl.min(tl.where(rm, p, 2147483647), axis=0)
    q_hi = tl.max(p, axis=0)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + (rows[:, None] * H + h) * Dk + dk[None, :], mask=rm[:, None] & (dk[None, :] < Dk), other=0.0
    )  # [BM, DK]
    kc_ptr, vc_ptr, ks_ptr, vs_ptr = head_rows(
        kc_ptr, vc_ptr, ks_ptr, vs_ptr, hk, Dk, Dv, QUANT, BLOCK_DK, BLOCK_DV
    )
    if SINKS:  # the sink's logit is one more column of every row's softmax, with no value
        sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    hi = tl.minimum(q_hi + 1, span)
    lo = q_lo * 0
    if window > 0:
        lo = tl.maximum(q_lo - window + 1, 0)
    lo = lo // BLOCK_N * BLOCK_N
    # [lo, full_lo): blocks the window cuts into; [full_lo, full_hi): blocks every row sees whole; then the
    # diagonal blocks, masked again
    full_lo = lo
    if window > 0:
        full_lo = tl.maximum(tl.cdiv(q_hi - window + 1, BLOCK_N) * BLOCK_N, lo)
    full_hi = tl.maximum((tl.minimum(q_lo + 1, span)) // BLOCK_N * BLOCK_N, full_lo)
    for s0 in range(lo, tl.minimum(full_lo, hi), BLOCK_N):
        acc, m_i, l_i = _block(
            q, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, vs_ptr, p, s0, HKV, Dk, Dv, span, window, qk_scale,
            softcap, dk, dv, BLOCK_N, True, QUANT, SOFTCAP, IEEE, BLOCK_DK, BLOCK_DV,
        )  # fmt: skip
    for s0 in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _block(
            q, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, vs_ptr, p, s0, HKV, Dk, Dv, span, window, qk_scale,
            softcap, dk, dv, BLOCK_N, False, QUANT, SOFTCAP, IEEE, BLOCK_DK, BLOCK_DV,
        )  # fmt: skip
    for s0 in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _block(
            q, acc, m_i, l_i, kc_ptr, vc_ptr, ks_ptr, vs_ptr, p, s0, HKV, Dk, Dv, span, window, qk_scale,
            softcap, dk, dv, BLOCK_N, True, QUANT, SOFTCAP, IEEE, BLOCK_DK, BLOCK_DV,
        )  # fmt: skip
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a pad row saw nothing: zeros, not NaN
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (rows[:, None] * H + h) * Dv + dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=rm[:, None] & (dv[None, :] < Dv),
    )


def _tiles(t: int, d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for t rows of head size d (padded) in `dtype`."""
    # float32 tiles and large heads: half the shared memory per block
    wide = dtype == torch.float32 or d > 128
    bm = 64 if wide else 128
    bm = min(bm, max(16, triton.next_power_of_2(t)))
    bn = 32 if wide else 64
    return bm, bn, 4 if bm <= 64 else 8, 2 if wide else 3


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    span: int,
    window: int,
    scale: float,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, Dk] at positions `pos` [T] (int64, any order) over cache positions below `span` -> [T, H, Dv] in q's
    dtype. Each row sees the positions <= its own (and within `window` of it when window > 0). `k_cache`/`v_cache`
    [ctx, Hkv, D] are the cache's own rows: float, or int8 codes with `k_scale`/`v_scale` [ctx, Hkv, 1] (a scale per
    position and head), or q4_0 bytes [ctx, Hkv, D/2] with scales [ctx, Hkv, D/32]. `sinks` [H] (float32): a logit per head that joins every row's softmax with no value."""
    t, h, dk = q.shape
    hkv = k_cache.shape[1]
    quant, _, dv = cache_layout(k_cache, k_scale, v_cache)
    per = 2 if quant == Q4_0 else 1  # values a stored element holds
    assert h % hkv == 0 and k_cache.stride(2) == 1 and k_cache.stride(0) == hkv * dk // per
    assert v_cache.stride(2) == 1 and v_cache.stride(0) == hkv * dv // per
    q = q.contiguous()
    out = torch.empty(t, h, dv, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    bdk, bdv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    bm, bn, warps, stages = _tiles(t, max(bdk, bdv), q.dtype)
    _prefill_attn_kernel[(h, triton.cdiv(t, bm))](
        q,
        k_cache,
        v_cache,
        k_scale if k_scale is not None else k_cache,
        v_scale if v_scale is not None else v_cache,
        pos,
        sinks if sinks is not None else q,
        out,
        t,
        h,
        hkv,
        dk,
        dv,
        span,
        window,
        scale,
        softcap,
        G=h // hkv,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_DK=bdk,
        BLOCK_DV=bdv,
        QUANT=quant,
        SOFTCAP=softcap > 0,
        SINKS=sinks is not None,
        IEEE=q.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
    )
    return out
