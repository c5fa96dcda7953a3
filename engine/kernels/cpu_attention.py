"""Attention of a CPU decode step's few rows over a float32 KV cache, in one Numba call
(cpu_blocks_jit.attend_rows, compiled on first use and cached on disk): each row against the keys up to its own
position (within the window), as a one-token step reads them, so that a row's output is the same, to the bit,
alone and in a step of several.

Through torch the same step was ~20 small operations a row and layer (the causal mask, the grouped products, the
masked softmax, the reshapes): ~100-150 us each on 2 cores over a few dozen keys."""

import torch

from engine.kernels import cpu_blocks

# Rows of up to this many multiply-adds in their key products (heads x keys x head size) run here, on the calling
# thread; longer ones through torch's products on every core. One row of Qwen2.5-0.5B's 14 heads of 64 on 2
# cores: 16.8 / 61.1 / 200 us here against 97.7 / 141.5 / 253 through torch over 70 / 300 / 1,000 keys, 791
# against 582 over 4,000.
MAX_MACS = 1 << 20


def takes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_keys: int) -> bool:
    """Whether `attend` computes a row over `n_keys` keys: float32 queries and cache on the CPU, a row within
    MAX_MACS, and the CPU kernels here."""
    _, h, d = q.shape
    return (
        not q.is_cuda
        and q.dtype == keys.dtype == values.dtype == torch.float32
        and h * n_keys * d <= MAX_MACS
        and cpu_blocks.available()[0]
    )


def attend(
    q: torch.Tensor,  # [T, H, Dk] float32
    keys: torch.Tensor,  # [S, Hkv, Dk]: the cache's positions, at least up to the last row's
    values: torch.Tensor,  # [S, Hkv, Dv]
    pos: torch.Tensor,  # [T] int64: each row's position
    window: int,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """-> [T, H, Dv] float32: each row's attention over the keys at positions <= its own (and within `window` of
    it when window > 0), soft-capped scores when softcap > 0."""
    t, h, _ = q.shape
    out = torch.empty(t, h, values.shape[2])
    p = pos.numpy() if pos.dtype == torch.int64 else pos.to(torch.int64).numpy()
    top = int(p.max())
    if top >= keys.shape[0]:
        raise ValueError(f"a row at position {top} attends past the {keys.shape[0]} positions given")
    qn = q.numpy() if q.is_contiguous() else q.contiguous().numpy()
    cpu_blocks.attend_rows(qn, keys.numpy(), values.numpy(), p, window, scale, softcap, out.numpy())
    return out
