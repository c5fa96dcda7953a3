"""RMS normalisation, computed in float32 whatever the activations' dtype."""

import torch

from engine import kernels


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
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(out_dtype)
