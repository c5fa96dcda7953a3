"""A dense weight times a few activation rows (the decode rows of several slots, 2-16 of them), on tensor cores,
each weight tile decoded from its GGUF blocks once for all the rows.

The GEMV kernels (engine/kernels/gemv.py) give each activation row its own programs, which decode the same weight
blocks again for every row: at 8 rows the dense projections and the output head of a Qwen3-30B-A3B step took 4.9x
their one-row time (bench/rows_bench.py --profile). Here a program decodes a BLOCK_N-row tile of the weight 256
elements at a time (moe_gemm's tile decoders) and multiplies it with all the rows at once (tl.dot, the rows padded
to 16). Activations rounded to 8 bits (gemv.quantize_q8's layout) are read as their codes times their block
scales, the values the 8-bit GEMV bodies compute with."""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT

from engine.kernels.moe_gemm import _deq_tile, decodes, tile_variant
from installer.engine_options import runtime_switches

ROWS = range(2, 17)  # activation rows this kernel takes (one row: the GEMV bodies)
BLOCK_M = 16  # the rows padded to tl.dot's smallest tile


@triton.jit
def _rows_gemm_kernel(
    w_ptr,  # uint8 [N, row_bytes]
    row_bytes,
    x_ptr,  # [T, K] activations (float), or quantize_q8's rows (Q8: K int8 codes, then a (scale, sum) per 32)
    y_ptr,  # [T, N]
    r_ptr,  # [T, N] float32 residual (HAS_RES)
    T,
    N,
    K,
    QTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    Q8: tl.constexpr,
    HAS_RES: tl.constexpr,
    IEEE: tl.constexpr,  # float32 activations: no TF32 rounding either
):
    pn = tl.program_id(0)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, BLOCK_M)
    mm = m < T
    w_rows = (w_ptr + n.to(tl.int64) * row_bytes)[:, None, None]
    k256 = tl.arange(0, 256)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for sb in range(0, tl.cdiv(K, 256)):
        kk = sb * 256 + k256[None, :]
        xm = mm[:, None] & (kk < K)
        if Q8:
            rows = x_ptr.to(tl.pointer_type(tl.uint8)) + m[:, None].to(tl.int64) * (4 * K)
            code = tl.load(rows.to(tl.pointer_type(tl.int8)) + kk, mask=xm, other=0).to(tl.float32)
            scale = tl.load((rows + K + (kk // 32) * 8).to(tl.pointer_type(tl.float32)), mask=xm, other=0.0)
            xt = code * scale
        else:
            xt = tl.load(x_ptr + m[:, None].to(tl.int64) * K + kk, mask=xm, other=0.0).to(tl.float32)
        wt = _deq_tile(
            w_rows, sb, nm, K, QTYPE, BLOCK_N
        )  # float32: TF32 keeps 10 bits of it, bf16 would keep 7
        if IEEE:
            acc += tl.dot(xt, tl.trans(wt), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wt), input_precision="tf32")
    out = m[:, None].to(tl.int64) * N + n[None, :]
    om = mm[:, None] & nm[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + out, mask=om, other=0.0)
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=om)


def takes(qtype: QT, k: int, rows: int) -> bool:
    """Whether a product of `rows` activation rows with a weight of this block type and row length runs here:
    with STRATA_ROWS_GEMM=1 (off by default: slower than the GEMV at 2-16 rows on an H200, bench/rows_bench.py)."""
    return rows in ROWS and decodes(qtype, k) and runtime_switches().rows_gemm


def rows_gemm(
    raw: torch.Tensor,
    qtype: QT,
    n: int,
    k: int,
    x: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    residual: torch.Tensor | None = None,
    q8: bool = False,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """raw uint8 [n, row_bytes] on CUDA, x [T, k] (T in ROWS; with `q8`, quantize_q8's output) -> [T, n] in
    out_dtype (accumulated in float32), plus `residual` [T, n] (float32) where given: gemv's contract."""
    x = x.contiguous()
    t = x.shape[0]
    if t not in ROWS:
        raise ValueError(f"rows_gemm takes {ROWS.start}-{ROWS.stop - 1} rows, not {t}")
    y = torch.empty(t, n, dtype=out_dtype, device=x.device)
    res = residual.contiguous() if residual is not None else y
    _rows_gemm_kernel[(triton.cdiv(n, block_n),)](
        raw, raw.shape[-1], x, y, res, t, n, k,
        QTYPE=tile_variant(qtype), BLOCK_M=BLOCK_M, BLOCK_N=block_n, Q8=q8, HAS_RES=residual is not None,
        IEEE=not q8 and x.dtype == torch.float32, num_warps=num_warps,
    )  # fmt: skip
    return y
