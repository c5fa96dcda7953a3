"""RMS normalisation, computed in float32 whatever the activations' dtype."""

import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import cpu_blocks


def _fused():  # the Triton kernel where it can run (CUDA with Triton), else None
    return kernels.loaded("fused")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [..., D] -> x / rms(x) * weight, as out_dtype (default: x's dtype)."""
    out_dtype = out_dtype or x.dtype
    if x.is_cuda:
        fused = _fused()
        if fused is not None:
            return fused.rms_norm(x, weight, eps, out_dtype)
    if not x.is_cuda and (weight is None or not weight.is_cuda) and cpu_blocks.available()[0]:
        # every CPU row through the one kernel, whatever its dtype and layout, so a row's bits are the same alone
        # and in a step of several (whose rows may be slices)
        w = None if weight is None else weight.float().contiguous()
        y = cpu_blocks.rms_norm(x.float().contiguous(), w, eps)
        return y if out_dtype == torch.float32 else y.to(out_dtype)
    xf = x.float()
    if weight is not None and weight.dtype == torch.float32:
        # one ATen call, the same float32 operations (bit-equal over 300 random shapes and scales): 9 us for a
        # decode row on 2 cores against 15 for the five below, a CPU decode step calling it ~70 times
        return F.rms_norm(xf, (xf.shape[-1],), weight, eps).to(out_dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(out_dtype)
