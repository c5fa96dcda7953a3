"""Weights kept in GGUF block format; dequantized tile by tile only where they are used."""

import torch
from gguf import GGMLQuantizationType as QT

from engine import kernels
from engine.gguf.quants import dequantize
from engine.kernels import cpu_blocks
from installer.engine_options import int8_activations

_FLOAT_VIEWS = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
# Up to this many activation rows, CUDA matmuls on supported block types run the block-format GEMV kernels.
_GEMV_MAX_ROWS = 16


def _gemv_for(qtype: QT, n_in: int):  # -> the kernel, or None where it does not apply (or no Triton)
    gemv = kernels.loaded("gemv")
    return gemv.gemv if gemv is not None and gemv.supports(qtype, n_in) else None


def _rows_for(qtype: QT, n_in: int, rows: int):  # -> the few-rows tile kernel, or None (GEMV per row)
    rows_gemm = kernels.loaded("rows_gemm") if rows > 1 else None
    return rows_gemm.rows_gemm if rows_gemm is not None and rows_gemm.takes(qtype, n_in, rows) else None


def _deq_kernel_for(qtype: QT, n_in: int):  # -> the GPU decoder, or None where it does not apply
    dequant, moe_gemm = kernels.loaded("dequant"), kernels.loaded("moe_gemm")
    if dequant is None or moe_gemm is None:
        return None
    return dequant.dequantize_rows if moe_gemm.decodes(qtype, n_in) else None


class FloatCache:
    """A RAM budget for dequantized copies of weights on the CPU. Dequantizing blocks costs more than the matmul
    itself on a CPU (a 270M-parameter model: ~2.5 s a token, against ~0.1 s from float copies), so weights keep a
    float copy, first used first kept, while the budget lasts; the rest are dequantized per use as before."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0

    def take(self, nbytes: int) -> bool:
        if self.used + nbytes > self.budget:
            return False
        self.used += nbytes
        return True


# Largest dequantized tile a matmul materialises at once (elements): bounds the transient memory of big heads.
_TILE_ELEMS = 1 << 20
# Up to this many activation rows a CPU matmul multiplies the blocks in place (engine.kernels.cpu_blocks); more rows
# (a prompt chunk) go through float tiles of the weight decoded for that product and a float GEMM.
_CPU_BLOCK_ROWS = 8


class QTensor:
    """A weight of logical shape `shape` stored as raw GGUF blocks `raw` ([..., row_bytes], uint8)."""

    __slots__ = ("cache", "cpu", "dense", "parts", "qtype", "raw", "shape")

    def __init__(self, raw: torch.Tensor, qtype: QT, shape: tuple[int, ...]) -> None:
        self.raw = raw
        self.qtype = qtype
        self.shape = tuple(shape)
        self.cache: FloatCache | None = None  # where a CPU matmul may keep its dequantized copy
        self.dense: torch.Tensor | None = None  # that copy, once made
        self.parts: dict[int, QTensor] | None = None  # slices kept (experts), so that their copies last
        self.cpu: cpu_blocks.Weight | None = None  # the CPU kernels' view of raw, made at the first product

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()

    def to(self, device: torch.device | str) -> "QTensor":
        return QTensor(self.raw.to(device), self.qtype, self.shape)

    def _deq(self, raw: torch.Tensor, rows_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.qtype in _FLOAT_VIEWS:
            return (
                raw.contiguous().view(_FLOAT_VIEWS[self.qtype]).reshape(*rows_shape, self.shape[-1]).to(dtype)
            )
        if raw.is_cuda:
            deq = _deq_kernel_for(self.qtype, self.shape[-1])
            if deq is not None:  # one launch instead of the torch decoder's many small kernels
                return deq(raw, self.qtype, self.shape[-1], dtype).reshape(*rows_shape, self.shape[-1])
        return dequantize(raw, self.qtype, dtype=dtype).reshape(*rows_shape, self.shape[-1])

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole tensor as floats (small tensors: norms, biases, one expert)."""
        return self._deq(self.raw, self.shape[:-1], dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `index` of a 2-D weight (an embedding lookup): only those rows are dequantized."""
        sel = self.raw.index_select(0, index.to(self.raw.device))  # [N, row_bytes]
        return self._deq(sel, (index.numel(),), dtype)

    def __getitem__(self, i: int) -> "QTensor":
        """Slice along the first dimension (one expert of a 3-D expert tensor). Under a float-copy budget the
        slice is kept, with the budget, so that an expert used again finds its float copy."""
        if self.cache is None:
            return QTensor(self.raw[i], self.qtype, self.shape[1:])
        if self.parts is None:
            self.parts = {}
        part = self.parts.get(i)
        if part is None:
            part = self.parts[i] = QTensor(self.raw[i], self.qtype, self.shape[1:])
            part.cache = self.cache
        return part

    def _gemv(self, x: torch.Tensor):  # -> the GEMV kernel `linear(x)` runs, or None (the other paths)
        n_in = self.shape[1]
        return _gemv_for(self.qtype, n_in) if x.is_cuda and x.numel() <= _GEMV_MAX_ROWS * n_in else None

    def reads_q8(self, x: torch.Tensor) -> bool:
        """Whether `linear(x)` runs a GEMV body on 8-bit activations (engine.kernels.gemv.wants_q8): a caller
        that normalises x may then write that form in the same launch and pass it as `q8`."""
        if self._gemv(x) is None:
            return False
        return kernels.gemv.wants_q8(self.qtype, *self.shape)

    def linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        q8: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x @ W.T for a 2-D weight [n_out, n_in]; x [..., n_in] -> [..., n_out]. With `residual` (float32, the
        output's shape) the result is residual + x @ W.T in float32, one kernel on the GEMV path. `q8`: x rounded
        to 8 bits (engine.kernels.gemv.quantize_q8), for a GEMV launch that reads it (wants_q8); the launch then
        reads q8 only, and gives out_dtype (default x's)."""
        n_out, n_in = self.shape
        gemv = self._gemv(x)
        if gemv is not None:  # decode: compute on the blocks, no dequantized copy
            flat = x.reshape(-1, n_in) if q8 is None else q8.reshape(-1, n_in)
            # several rows (slots decoding together): each weight tile decoded once for all of them
            gemv = _rows_for(self.qtype, n_in, flat.shape[0]) or gemv
            if residual is not None:
                res = residual.reshape(-1, n_out)
                y = gemv(self.raw, self.qtype, n_out, n_in, flat, out_dtype=torch.float32, residual=res,
                         q8=q8 is not None)  # fmt: skip
            else:
                y = gemv(
                    self.raw, self.qtype, n_out, n_in, flat, out_dtype=out_dtype or x.dtype, q8=q8 is not None
                )
            return y.reshape(*x.shape[:-1], n_out)
        if residual is not None:
            return residual + self.linear(x).float()
        if self.takes_cpu_blocks(x):
            return self._cpu_linear(x)
        if self.dense is not None and self.dense.dtype == x.dtype:
            return x @ self.dense.T
        if self.cache is not None and not x.is_cuda and self.cache.take(n_out * n_in * x.element_size()):
            self.dense = self._deq(self.raw, (n_out,), x.dtype)  # dequantized once, not per token
            return x @ self.dense.T
        if self.qtype in _FLOAT_VIEWS:
            return x @ self._deq(self.raw, (n_out,), x.dtype).T
        step = max(1, _TILE_ELEMS // n_in)
        if step >= n_out:
            return x @ self._deq(self.raw, (n_out,), x.dtype).T
        parts = [
            x @ self._deq(self.raw[r : r + step], (min(step, n_out - r),), x.dtype).T
            for r in range(0, n_out, step)
        ]
        return torch.cat(parts, dim=-1)

    def _cpu_blocks(self) -> bool:
        """Whether CPU matmuls of this weight (of each expert's slice, for a 3-D one) run the block kernels: int8
        activations (not --activations float), a block type they read, and Numba."""
        return (
            not self.raw.is_cuda
            and len(self.shape) in (2, 3)
            and int8_activations()
            and cpu_blocks.supports(self.qtype, self.shape[-1])
        )

    def in_blocks_on_cpu(self) -> bool:
        """Whether CPU matmuls of this weight read it where it lies: the block kernels, or F32 (a float view)."""
        return self.qtype == QT.F32 or self._cpu_blocks()

    def cpu_weight(self) -> "cpu_blocks.Weight":
        """This 2-D weight as the CPU's block kernels take it (worked out once)."""
        if self.cpu is None:
            self.cpu = cpu_blocks.Weight(self.raw, self.qtype, self.shape[0], self.shape[1])
        return self.cpu

    def takes_cpu_blocks(self, x: torch.Tensor) -> bool:
        """Whether linear(x) runs on the CPU's block kernels (decode rows: in place)."""
        return not x.is_cuda and self.dense is None and len(self.shape) == 2 and self._cpu_blocks()

    def _cpu_linear(self, x: torch.Tensor) -> torch.Tensor:
        n_out, n_in = self.shape
        rows = x.numel() // n_in
        if rows <= _CPU_BLOCK_ROWS:
            y = self.cpu_weight().matmul(x)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        step = max(1, _TILE_ELEMS // n_in)
        # bfloat16 tiles where the cores multiply them natively: Gemma 3 270M's 64-token prompt on 2 cores ~1.5x
        bf16 = cpu_blocks.bf16_gemm()
        xg = x.to(torch.bfloat16) if bf16 else x
        parts = [
            xg
            @ cpu_blocks.dequantize(self.raw[r : r + step], self.qtype, min(step, n_out - r), n_in, bf16)
            .to(xg.dtype)
            .T
            for r in range(0, n_out, step)
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.to(x.dtype)


def linear_many(weights: "list[QTensor]", x: torch.Tensor) -> list[torch.Tensor]:
    """[w.linear(x) for w in weights], the same values: where every weight takes decode rows on the CPU's block
    kernels with the same input width (q, k and v; gate and up), in one call (cpu_blocks.matmul_many), x quantized
    once and one parallel region for all."""
    if x.dim() == 2 and x.shape[0] <= _CPU_BLOCK_ROWS and all(w.takes_cpu_blocks(x) for w in weights):
        cws = [w.cpu_weight() for w in weights]
        if cpu_blocks.in_one_call(cws, x.shape[0]):
            ys = cpu_blocks.matmul_many(cws, x)
            return ys if x.dtype == torch.float32 else [y.to(x.dtype) for y in ys]
    return [w.linear(x) for w in weights]
