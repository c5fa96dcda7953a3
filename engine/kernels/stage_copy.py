"""Missed experts copied from pinned host memory into a VRAM staging area before a decode step's expert kernels.

The expert kernels can read a missed expert straight from host memory (`--expert-misses direct`), but they do so
with the small loads of a matrix-vector product, which PCIe serves poorly. This kernel instead moves each expert the
step misses across PCIe once, however many of the step's rows chose it, with wide 8-byte loads into a staging slot,
and writes the step's address tables (the layer's own, with each staged expert's entry pointing at its staging slot)
that the expert kernels then read with the step's own expert ids (`--expert-misses copy`, the default: 1.7-1.85x
the direct reads' decode tokens/s with 0-50% of the experts in VRAM on an H200). One launch a layer, no host
synchronisation. A step that misses more distinct experts than the area holds reads the rest in place."""

import torch
import triton
import triton.language as tl


@triton.jit
def _stage_kernel(
    ids_ptr,  # int64 [P]: the expert of each (row, slot) pair of the step
    claim_ptr,  # int32 [P]: 1 where the CPU computes the pair's expert (engine/experts/cpu_misses.py): no copy
    tab_ptr,  # int64 [3, E]: the cache's tables (gate, up, down): VRAM slot or host address per expert
    host_ptr,  # int64 [3, E]: each expert's address in pinned host memory
    nbytes_ptr,  # int64 [3]: bytes of one expert per projection
    out_ptr,  # int64 [3, E]: the step's tables
    stage_addr,  # address of the staging area [3, CAP, STRIDE] bytes
    E,
    P,
    CAP,  # experts the area holds
    STRIDE,  # bytes a staging slot holds (a multiple of 8)
    CHUNK: tl.constexpr,  # 8-byte words a program copies
    BLOCK: tl.constexpr,
    BP: tl.constexpr,  # P rounded up to a power of two
    BE: tl.constexpr,  # table entries a load
    CLAIM: tl.constexpr,
):
    c = tl.program_id(0)  # the staging slot
    ch = tl.program_id(1)  # the chunk of the expert
    p = tl.program_id(2)  # the projection
    i = tl.arange(0, BP)
    ok = i < P
    e = tl.load(ids_ptr + i, mask=ok, other=-1)
    # a pair's expert counts once: at the first pair that chose it
    dup = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    first = ok & (tl.max(dup.to(tl.int32), axis=1) == 0)
    miss = ok & (tl.load(tab_ptr + e, mask=ok, other=0) == tl.load(host_ptr + e, mask=ok, other=1))
    cpu = ok & (i < 0)
    if CLAIM:
        cpu = ok & (tl.load(claim_ptr + i, mask=ok, other=0) != 0)
    want = first & miss & (cpu == 0)
    rank = tl.cumsum(want.to(tl.int32), 0) - want.to(tl.int32)  # the expert's staging slot
    staged = want & (rank < CAP)
    area = stage_addr + p.to(tl.int64) * CAP * STRIDE
    if (c == 0) & (ch == 0):  # this projection's table for the step
        for off in range(0, E, BE):
            j = off + tl.arange(0, BE)
            tl.store(out_ptr + p * E + j, tl.load(tab_ptr + p * E + j, mask=j < E), mask=j < E)
        tl.debug_barrier()  # the layer's entries are written before the step's own replace some
        tl.store(out_ptr + p * E + e, area + rank.to(tl.int64) * STRIDE, mask=staged)
        # an expert the CPU computes is read from any VRAM bytes (its weight in the GPU's sum is zero)
        tl.store(out_ptr + p * E + e, area, mask=first & miss & cpu)
    mine = staged & (rank == c)
    if tl.sum(mine.to(tl.int32), 0) > 0:  # this slot's expert: this program's chunk of it crosses PCIe
        em = tl.sum(tl.where(mine, e, 0), 0)
        h = tl.load(host_ptr + p * E + em)
        dst = area + c.to(tl.int64) * STRIDE
        words = tl.load(nbytes_ptr + p) // 8
        copy_chunk(
            h.to(tl.pointer_type(tl.int64)),
            dst.to(tl.pointer_type(tl.int64)),
            ch * CHUNK,
            words,
            CHUNK,
            BLOCK,
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
    """The staging area and step tables of one expert cache: `slots` experts, each `stride` bytes a projection,
    for layers of `n_expert` experts."""

    def __init__(self, device: torch.device, slots: int, stride: int, n_expert: int) -> None:
        self.slots = slots
        self.stride = -(-stride // 8) * 8
        # zeros: an expert the CPU claims is read from whatever the first staging slot holds (its weight is zero),
        # and zero bytes decode as zero weights where that is nothing yet
        self.area = torch.zeros(3, slots, self.stride, dtype=torch.uint8, device=device)
        self.out = torch.empty(3, n_expert, dtype=torch.int64, device=device)

    def stage(
        self,
        ids: torch.Tensor,
        tables: torch.Tensor,
        host: torch.Tensor,
        nbytes: torch.Tensor,
        claim: torch.Tensor | None = None,
        launch: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        """ids [T, k] -> int64 [3, E]: the address each expert's gate, up and down kernels read this step (read
        with the step's own ids). `claim` int32 [T * k]: pairs whose expert the CPU computes, not copied. `launch`:
        (8-byte words a program copies, words a load, warps), default (CHUNK_WORDS, 1024, Triton's default);
        bench/stage_copy_micro.py measures them."""
        p = ids.numel()
        e = tables.shape[1]
        if e != self.out.shape[1]:
            raise ValueError(f"the staging tables are for {self.out.shape[1]} experts a layer, not {e}")
        words = int(self.stride // 8)
        chunk, block, warps = launch if launch is not None else (CHUNK_WORDS, 1024, 4)
        grid = (min(self.slots, p), triton.cdiv(words, chunk), 3)
        _stage_kernel[grid](
            ids.reshape(-1), claim if claim is not None else ids, tables, host, nbytes, self.out, self.area.data_ptr(),
            e, p, self.slots, self.stride, CHUNK=chunk, BLOCK=block, BP=max(16, triton.next_power_of_2(p)),
            BE=min(1024, triton.next_power_of_2(e)), CLAIM=claim is not None, num_warps=warps,
        )  # fmt: skip
        return self.out
