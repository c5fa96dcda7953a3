"""GGUF blocks -> floats on the GPU in one launch (the tile decoder of the grouped expert kernel), for the matmuls
of prompt chunks: the torch decoders in engine/gguf/quants.py take some twenty small kernels a weight, which made
a short prompt wait on the host rather than the GPU."""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT

from engine.kernels.moe_gemm import TILE_TYPES, _deq_tile


@triton.jit
def _dequant_kernel(raw_ptr, row_bytes, out_ptr, N, K, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n, sb*256 : sb*256+256] for BLOCK_N rows n: program (row block, 256-element step sb)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sb = tl.program_id(1)
    nm = n < N
    w_rows = (raw_ptr + n.to(tl.int64) * row_bytes)[:, None, None]
    w = _deq_tile(w_rows, sb, nm, K, QTYPE, BLOCK_N)  # [BLOCK_N, 256]
    kk = sb * 256 + tl.arange(0, 256)
    out = out_ptr + n[:, None].to(tl.int64) * K + kk[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=nm[:, None] & (kk[None, :] < K))


_BLOCK_N = 16


def dequantize_rows(raw: torch.Tensor, qtype: QT, k: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 blocks [..., row_bytes] on CUDA (rows of k elements) -> [..., k] in dtype; the types and row lengths
    engine.kernels.moe_gemm.decodes accepts."""
    rows = raw.reshape(-1, raw.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    n = rows.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=raw.device)
    if n:
        grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(k, 256))
        _dequant_kernel[grid](rows, rows.shape[1], out, n, k, QTYPE=TILE_TYPES[qtype],
                              BLOCK_N=_BLOCK_N, num_warps=4)  # fmt: skip
    return out.reshape(*raw.shape[:-1], k)
