"""Missed experts copied from pinned host memory into a VRAM staging area before a decode step's expert kernels.

The expert kernels can read a missed expert straight from host memory (`--expert-misses direct`), but they do so
with the small loads of a matrix-vector product, which PCIe serves poorly. This kernel instead moves each
missed expert of the step across PCIe with wide 8-byte loads, into one staging slot per (token, slot), and writes
a per-slot address table (the staging slot for a miss, the VRAM slot for a hit) that the expert kernels then read
with the identity as their expert ids (`--expert-misses copy`, the default: 1.7-1.85x the direct reads' decode
tokens/s with 0-50% of the experts in VRAM on an H200). One launch a layer, no host synchronisation."""

import torch
import triton
import triton.language as tl


@triton.jit
def _stage_kernel(
    ids_ptr,  # int64 [S]: expert of each (token, slot)
    claim_ptr,  # int32 [S]: 1 where the CPU computes the slot (engine/experts/cpu_misses.py): no copy
    tab_ptr,  # int64 [3, E]: the cache's tables (gate, up, down): VRAM slot or host address per expert
    host_ptr,  # int64 [3, E]: each expert's address in pinned host memory
    nbytes_ptr,  # int64 [3]: bytes of one expert per projection
    out_ptr,  # int64 [3, S]: address each slot's kernels read
    stage_addr,  # address of the staging area [3, S, STRIDE] bytes
    E,
    S,
    STRIDE,  # bytes a staging slot holds (a multiple of 8)
    CHUNK: tl.constexpr,  # 8-byte words a program copies
    BLOCK: tl.constexpr,
    CLAIM: tl.constexpr,
):
    s = tl.program_id(0)
    c = tl.program_id(1)
    p = tl.program_id(2)
    e = tl.load(ids_ptr + s)
    a = tl.load(tab_ptr + p * E + e)
    h = tl.load(host_ptr + p * E + e)
    dst = stage_addr + (p * S + s).to(tl.int64) * STRIDE
    if c == 0:
        tl.store(out_ptr + p * S + s, tl.where(a == h, dst, a))
    skip = False
    if CLAIM:
        skip = tl.load(claim_ptr + s) != 0
    if a == h and not skip:  # a miss: this program's chunk of the expert crosses PCIe in wide loads
        words = tl.load(nbytes_ptr + p) // 8
        copy_chunk(
            h.to(tl.pointer_type(tl.int64)), dst.to(tl.pointer_type(tl.int64)), c * CHUNK, words, CHUNK, BLOCK
        )


@triton.jit
def copy_chunk(src_w, dst_w, lo, words, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One program's chunk of an expert: 8-byte words lo .. lo + CHUNK (at most `words`), BLOCK a load."""
    hi = tl.minimum(lo + CHUNK, words)
    for off in range(lo, hi, BLOCK):
        k = off + tl.arange(0, BLOCK)
        m = k < hi
        tl.store(dst_w + k, tl.load(src_w + k, mask=m), mask=m)


CHUNK_WORDS = 8192  # 64 KB a program


class Stager:
    """The staging area and address tables of one expert cache (decode steps of one token: S = k slots)."""

    def __init__(self, device: torch.device, slots: int, stride: int) -> None:
        self.slots = slots
        self.stride = -(-stride // 8) * 8
        # zeros: a slot the CPU claims is read from whatever its staging slot last held (its weight is zero), and
        # zero bytes decode as zero weights where that is nothing yet
        self.area = torch.zeros(3, slots, self.stride, dtype=torch.uint8, device=device)
        self.out = torch.empty(3, slots, dtype=torch.int64, device=device)
        self.identity = torch.arange(slots, dtype=torch.int64, device=device).view(1, slots)

    def stage(
        self,
        ids: torch.Tensor,
        tables: torch.Tensor,
        host: torch.Tensor,
        nbytes: torch.Tensor,
        claim: torch.Tensor | None = None,
        launch: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        """ids [1, k] -> int64 [3, k]: the address each slot's gate, up and down kernels read. `claim` int32 [k]:
        slots the CPU computes, not copied. `launch`: (8-byte words a program copies, words a load, warps),
        default (CHUNK_WORDS, 1024, Triton's default); bench/stage_copy_micro.py measures them."""
        s = ids.numel()
        assert s == self.slots
        words = int(self.stride // 8)
        chunk, block, warps = launch if launch is not None else (CHUNK_WORDS, 1024, 4)
        grid = (s, triton.cdiv(words, chunk), 3)
        _stage_kernel[grid](
            ids.reshape(-1), claim if claim is not None else ids, tables, host, nbytes, self.out, self.area.data_ptr(),
            tables.shape[1], s, self.stride, CHUNK=chunk, BLOCK=block, CLAIM=claim is not None, num_warps=warps,
        )  # fmt: skip
        return self.out
