"""A dense Q4_K or Q6_K weight times the decode rows of several slots (2-16) on int8 tensor cores, as llama.cpp's
MMQ does for small batches: each weight sub-block of 32 is unpacked once into int8 codes and multiplied with the
8-bit codes of all the rows at once (tl.dot, the rows padded to 16), then scaled by the weight's and each row's
block scales. The GEMV bodies (engine/kernels/vec_dot.py) instead unpack the weight again for every row or pair of
rows; at 8 rows the output head of Qwen3-30B-A3B took 746 us that way.

Activations are quantize_q8's rows (engine/kernels/gemv.py): K int8 codes, then (scale, scale * sum of codes) per
32, so the products are the 8-bit GEMV bodies' (the same integer sums, summed in another order)."""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT

from engine.kernels.vec_dot import k_scales

TYPES = {QT.Q4_K: 0, QT.Q6_K: 1}
BLOCK_M = 16  # the rows padded to the int8 MMA's smallest tile


@triton.jit
def _x_block(xb, col, mm, L32):
    """The int8 codes [BLOCK_M, 32] of the 32 activations from column `col` of each row (byte pointers xb [M])."""
    return tl.load(xb[:, None] + col + L32[None, :], mask=mm[:, None], other=0)


@triton.jit
def _rows_mma_kernel(
    w_ptr,  # uint8 [N, row_bytes]
    row_bytes,
    x_ptr,  # float32 [T, K]: quantize_q8's rows
    y_ptr,  # [T, N], or float32 [SPLIT, T, N] partial sums when SPLIT > 1
    r_ptr,  # [T, N] float32 residual (HAS_RES, SPLIT == 1)
    N,
    K,
    T,
    QTYPE: tl.constexpr,  # 0 Q4_K, 1 Q6_K
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,  # programs along K (each its share of the super-blocks)
    HAS_RES: tl.constexpr,
):
    pid = tl.program_id(0)
    part = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, BLOCK_M)
    mm = m < T
    xb = x_ptr.to(tl.pointer_type(tl.int8)) + m.to(tl.int64) * (4 * K)  # each row's codes
    meta = (xb + K).to(tl.pointer_type(tl.float32))  # each row's (scale, scale * sum) pairs
    L32 = tl.arange(0, 32)
    wr = w_ptr + n.to(tl.int64) * row_bytes  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    nsb = K // 256
    per = tl.cdiv(nsb, SPLIT)
    for sb in range(part * per, tl.minimum(nsb, part * per + per)):
        if QTYPE == 0:
            base = wr + sb * 144
            d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=nm, other=0.0).to(tl.float32)
            dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=nm, other=0.0).to(tl.float32)
            for j in tl.static_range(8):  # sub-block j: the low (even j) or high nibbles of 32 bytes
                sc, mn = k_scales(base, j, nm)
                qb = tl.load(base[None, :] + 16 + 32 * (j // 2) + L32[:, None], mask=nm[None, :], other=0)
                q = (qb & 15) if j % 2 == 0 else (qb >> 4)  # [32, BLOCK_N]
                dot = tl.dot(_x_block(xb, sb * 256 + 32 * j, mm, L32), q.to(tl.int8), out_dtype=tl.int32)
                blk = (sb * 8 + j) * 2
                dx = tl.load(meta + blk, mask=mm, other=0.0)
                sx = tl.load(meta + blk + 1, mask=mm, other=0.0)
                acc += (
                    dx[:, None] * (d * sc)[None, :] * dot.to(tl.float32) - sx[:, None] * (dmin * mn)[None, :]
                )
        else:
            base = wr + sb * 210
            d = tl.load((base + 208).to(tl.pointer_type(tl.float16)), mask=nm, other=0.0).to(tl.float32)
            for c in tl.static_range(8):  # elements 32c..32c+31: half h = c // 4, quarter a = c % 4 of it
                h = c // 4
                a = c % 4
                ql = tl.load(base[None, :] + 64 * h + 32 * (a % 2) + L32[:, None], mask=nm[None, :], other=0)
                qh = tl.load(base[None, :] + 128 + 32 * h + L32[:, None], mask=nm[None, :], other=0)
                q = (((ql >> (4 * (a // 2))) & 15) | (((qh >> (2 * a)) & 3) << 4)).to(tl.int32) - 32
                q8 = q.to(tl.int8)  # [32, BLOCK_N], -32..31
                sp = (base + 192 + 8 * h + 2 * a).to(tl.pointer_type(tl.int8))
                sc_lo = tl.load(sp, mask=nm, other=0).to(tl.float32)  # the scale of each 16
                sc_hi = tl.load(sp + 1, mask=nm, other=0).to(tl.float32)
                xq = _x_block(xb, sb * 256 + 32 * c, mm, L32)
                lo = tl.dot(tl.where(L32[None, :] < 16, xq, 0).to(tl.int8), q8, out_dtype=tl.int32)
                hi = tl.dot(tl.where(L32[None, :] >= 16, xq, 0).to(tl.int8), q8, out_dtype=tl.int32)
                dx = tl.load(meta + (sb * 8 + c) * 2, mask=mm, other=0.0)
                acc += (
                    dx[:, None]
                    * d[None, :]
                    * (sc_lo[None, :] * lo.to(tl.float32) + sc_hi[None, :] * hi.to(tl.float32))
                )
    out = m[:, None].to(tl.int64) * N + n[None, :]
    om = mm[:, None] & nm[None, :]
    if SPLIT > 1:
        tl.store(y_ptr + part * T * N + out, acc, mask=om)
    else:
        if HAS_RES:
            acc += tl.load(r_ptr + out, mask=om, other=0.0)
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=om)


def takes(qtype: QT, k: int, rows: int) -> bool:
    return qtype in TYPES and k % 256 == 0 and 2 <= rows <= BLOCK_M


def rows_mma(
    raw: torch.Tensor,
    qtype: QT,
    n: int,
    k: int,
    xq: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    residual: torch.Tensor | None = None,
    block_n: int = 32,
    split: int = 1,
    num_warps: int = 4,
) -> torch.Tensor:
    """raw uint8 [n, row_bytes] (Q4_K or Q6_K) on CUDA, xq [T, k] quantize_q8's rows (2 <= T <= 16) -> [T, n] in
    out_dtype (accumulated in float32), plus `residual` [T, n] (float32) where given. `split` programs share each
    column block's super-blocks (their partial sums added after), for weights with few column blocks."""
    t = xq.shape[0]
    if not takes(qtype, k, t):
        raise ValueError(f"rows_mma takes Q4_K/Q6_K rows of a multiple of 256, 2-{BLOCK_M} of them")
    split = max(1, min(split, k // 256))
    y = torch.empty(t, n, dtype=out_dtype, device=xq.device)
    dst = y if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=xq.device)
    res = residual.contiguous() if residual is not None else y
    _rows_mma_kernel[(triton.cdiv(n, block_n), split)](
        raw, raw.shape[-1], xq.contiguous(), dst, res, n, k, t,
        QTYPE=TYPES[qtype], BLOCK_N=block_n, BLOCK_M=BLOCK_M, SPLIT=split, HAS_RES=residual is not None,
        num_warps=num_warps,
    )  # fmt: skip
    if split > 1:
        total = dst.sum(0)
        if residual is not None:
            total += residual
        y.copy_(total)
    return y
