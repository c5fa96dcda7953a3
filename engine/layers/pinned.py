"""Page-locked host memory: slabs of a power of two holding several tensors, and such memory seen as a CUDA tensor.

torch's pinned-memory allocator rounds every allocation up to a power of two (Qwen3-30B-A3B's 113 MB expert
projections took 128 MB each: 18.0 GiB of page-locked RAM for 15.2 GiB of blocks, 16.0 GiB in slabs; other sizes
lose up to half), so tensors that live as long as the model are placed together in slabs (`plan_slabs`).

`host_tensors` gives tensors that live in page-locked host RAM but that torch sees on a CUDA device: every CUDA
kernel and copy reads and writes them in place across PCIe (zero-copy, through the unified address space that
pinned memory has on every 64-bit CUDA platform), so code written for VRAM runs on them unchanged, CUDA graphs
included. The KV of layers that do not fit the card lives there (`--kv-resident`)."""

from collections.abc import Sequence

import torch

SLAB_BYTES = 1 << 30
PAGE = 4096  # each tensor starts on a page of its own


def _up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def plan_slabs(sizes: Sequence[int], slab: int = SLAB_BYTES) -> list[tuple[int, list[int]]]:
    """Slabs for tensors of `sizes` bytes, placed in order: [(slab bytes, a power of two; the byte offset of each
    tensor it holds)], the fewest bytes in all. A slab is at most `slab` bytes, or one tensor's power of two where a
    tensor is larger. A pure function (dynamic programming over where each slab starts)."""
    need = [_up(n) for n in sizes]
    n = len(need)
    # from tensor i on, the best plan: (bytes, slabs, this slab's size, the first tensor of the next slab)
    best: list[tuple[int, int, int, int]] = [(0, 0, 0, n)] * (n + 1)
    for i in range(n - 1, -1, -1):
        size = 1 << (need[i] - 1).bit_length()
        top = max(slab, size)
        choice = None
        while size <= top:
            j, used = i, 0
            while j < n and used + need[j] <= size:
                used += need[j]
                j += 1
            cand = (size + best[j][0], 1 + best[j][1], size, j)
            choice = cand if choice is None or cand[:2] < choice[:2] else choice
            if j == n:
                break  # a larger slab would only hold the same tensors
            size *= 2
        assert choice is not None
        best[i] = choice
    out: list[tuple[int, list[int]]] = []
    i = 0
    while i < n:
        _, _, size, j = best[i]
        offsets = [sum(need[i:m]) for m in range(i, j)]
        out.append((size, offsets))
        i = j
    return out


class _CudaView:
    """What torch.as_tensor needs to see `raw` (page-locked, uint8, 1-D) as memory of a CUDA device; keeps `raw`
    alive as long as the CUDA tensor is (torch holds this object)."""

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw
        self.__cuda_array_interface__ = {
            "shape": (raw.numel(),),
            "typestr": "|u1",
            "data": (raw.data_ptr(), False),
            "version": 2,
        }


def host_tensors(
    specs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device
) -> list[torch.Tensor]:
    """Zeroed tensors of the given (shape, dtype)s in page-locked host RAM (slabs, plan_slabs), as tensors of the
    CUDA `device` whose kernels reach them across PCIe. RuntimeError where the RAM cannot be pinned or mapped."""
    sizes = [_nbytes(shape, dt) for shape, dt in specs]
    out: list[torch.Tensor] = []
    i = 0
    for size, offsets in plan_slabs(sizes):
        with torch.cuda.device(device):  # pinned under the card's context: torch places the view on that card
            raw = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
            whole = torch.as_tensor(_CudaView(raw), device=device)
        if whole.data_ptr() != raw.data_ptr():  # torch copied it to the card instead of mapping it
            raise RuntimeError(f"page-locked host memory could not be mapped for {device}")
        out += views(whole, offsets, specs[i : i + len(offsets)])
        i += len(offsets)
    return out


def views(
    buf: torch.Tensor, offsets: Sequence[int], specs: Sequence[tuple[tuple[int, ...], torch.dtype]]
) -> list[torch.Tensor]:
    """Tensors of the (shape, dtype)s `specs` that are views of the bytes of `buf` (uint8, 1-D) at `offsets`."""
    return [
        buf[o : o + _nbytes(shape, dt)].view(dt).view(shape)
        for o, (shape, dt) in zip(offsets, specs, strict=True)
    ]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
