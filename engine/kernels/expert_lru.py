"""The expert cache's admission and eviction on the device, inside the decode step (graph-safe, no host round trip).

Per layer the cache keeps, on the device, each expert's slot (-1: host RAM only), each slot's expert and a score per
slot: the step it was last used (LRU) or a use count that decays every step (LFU with decay). One launch (one
program) marks this step's hits, then admits each miss into the slot with the lowest score that this step does not
use, rewriting the address tables; a second launch copies the admitted experts from pinned host memory into their
slots with wide loads (as stage_copy does into its staging area). The expert kernels then read every selection from
per-selection tables: a slot, or host memory for a miss that could not be admitted (more misses than free slots) or
the CPU computes. A miss costs the same PCIe bytes as staging it; a later hit costs none. The rules are
engine/experts/trace.py's `hit_rate` (its simulator), which the tests compare against."""

import torch
import triton
import triton.language as tl

from engine.kernels.stage_copy import copy_chunk

POLICIES = ("lru", "lfu")


@triton.jit
def _admit_kernel(
    ids_ptr,  # int64 [S]: the step's selections
    claim_ptr,  # int32 [S]: 1 where the CPU computes the selection (CLAIM)
    rows_ptr,  # int64 [1]: selections of rows below it count in the hit statistics (all S when not ROWS)
    slot_of_ptr,  # int32 [E]: expert -> slot, -1 when in host RAM only
    expert_in_ptr,  # int32 [C]: slot -> expert, -1 when empty
    score_ptr,  # float32 [C]: LFU's decayed use count
    mark_ptr,  # int64 [C]: the step that last used the slot: LRU's key (this step's slots are never evicted)
    clock_ptr,  # int64 [1]: steps so far
    stats_ptr,  # int64 [3]: hits, misses, admissions
    tab_ptr,  # int64 [3, E]: the cache's tables (what the prompt path and the CPU hand-off read)
    host_ptr,  # int64 [3, E]: each expert's pinned host address
    base_ptr,  # int64 [3]: address of slot 0 per projection
    nbytes_ptr,  # int64 [3]: bytes of one expert (and one slot) per projection
    job_ptr,  # int32 [S]: out: the slot to fill for a selection admitted now, else -1
    out_ptr,  # int64 [3, OUT_STRIDE]: out: the address each selection's kernels read (first S of each row)
    OUT_STRIDE,
    S,
    E,
    C,
    K,  # selections a row (top-k)
    decay,
    LFU: tl.constexpr,
    CLAIM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # The slots' state lives in registers while the step's misses are admitted one by one (a loop over the
    # distinct misses only, no memory round trip between them), then is written back once.
    clock = tl.load(clock_ptr) + 1
    tl.store(clock_ptr, clock)
    os_ = tl.arange(0, BLOCK_S)
    ms = os_ < S
    oc = tl.arange(0, BLOCK_C)
    mc = oc < C
    e = tl.load(ids_ptr + os_, mask=ms, other=-1)
    sl = tl.load(slot_of_ptr + e, mask=ms, other=-1)
    hit = ms & (sl >= 0)
    real = S
    if ROWS:
        real = tl.load(rows_ptr) * K
    counted = ms & (os_ < real)
    tl.atomic_add(stats_ptr, tl.sum((hit & counted).to(tl.int64), axis=0))
    tl.atomic_add(stats_ptr + 1, tl.sum((ms & ~hit & counted).to(tl.int64), axis=0))
    used = tl.sum(((sl[:, None] == oc[None, :]) & hit[:, None]).to(tl.int32), axis=0) > 0  # [C] slots hit now
    mk = tl.load(mark_ptr + oc, mask=mc, other=0)
    mk = tl.where(used, clock, mk)
    exin = tl.load(expert_in_ptr + oc, mask=mc, other=-1)
    if LFU:
        sc = tl.load(score_ptr + oc, mask=mc, other=0.0) * decay
        sc += tl.sum(((sl[:, None] == oc[None, :]) & hit[:, None]).to(tl.float32), axis=0)
    miss = ms & ~hit
    if CLAIM:
        miss = miss & (tl.load(claim_ptr + os_, mask=ms, other=1) == 0)
    # the first selection of each missed expert (two rows of a step may choose the same one)
    earlier = (e[:, None] == e[None, :]) & (os_[None, :] < os_[:, None]) & miss[None, :]  # [S, S]: j before i
    first = miss & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    order = tl.cumsum(first.to(tl.int32), axis=0)
    job = tl.full([BLOCK_S], -1, tl.int32)
    n = tl.sum(first.to(tl.int32), axis=0)
    for j in range(n):
        at = first & (order == j + 1)
        es = tl.sum(tl.where(at, e, 0), axis=0)
        free = mc & (mk != clock)  # not used by this step
        if LFU:
            key = tl.where(free, sc, float("inf"))
        else:  # least recently used: the oldest mark
            key = tl.where(free, mk, 1 << 62)
        if tl.sum(free.to(tl.int32), axis=0) > 0:
            v = tl.argmin(key, axis=0)
            old = tl.sum(tl.where(oc == v, exin, 0), axis=0)
            if old >= 0:
                tl.store(slot_of_ptr + old, -1)
                for p in tl.static_range(3):
                    tl.store(tab_ptr + p * E + old, tl.load(host_ptr + p * E + old))
            tl.store(slot_of_ptr + es, v.to(tl.int32))
            for p in tl.static_range(3):
                tl.store(
                    tab_ptr + p * E + es, tl.load(base_ptr + p) + v.to(tl.int64) * tl.load(nbytes_ptr + p)
                )
            mk = tl.where(oc == v, clock, mk)
            exin = tl.where(oc == v, es.to(tl.int32), exin)
            if LFU:
                sc = tl.where(oc == v, 1.0, sc)
            job = tl.where(at, v.to(tl.int32), job)
    tl.store(mark_ptr + oc, mk, mask=mc)
    tl.store(expert_in_ptr + oc, exin, mask=mc)
    if LFU:
        tl.store(score_ptr + oc, sc, mask=mc)
    tl.store(job_ptr + os_, job, mask=ms)
    tl.atomic_add(stats_ptr + 2, tl.sum((job >= 0).to(tl.int64), axis=0))
    tl.debug_barrier()  # the table stores above, before the reads below
    # the addresses each selection's kernels read: its slot or host memory; a claimed one reads slot 0 (weight 0)
    for p in tl.static_range(3):
        a = tl.load(tab_ptr + p * E + e, mask=ms, other=0)
        if CLAIM:
            cl = tl.load(claim_ptr + os_, mask=ms, other=0) != 0
            a = tl.where(cl, tl.load(base_ptr + p), a)
        tl.store(out_ptr + p * OUT_STRIDE + os_, a, mask=ms)


@triton.jit
def _fill_kernel(
    ids_ptr,  # int64 [S]
    job_ptr,  # int32 [S]: slot to fill, -1: none
    host_ptr,  # int64 [3, E]
    base_ptr,  # int64 [3]
    nbytes_ptr,  # int64 [3]
    E,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    c = tl.program_id(1)
    p = tl.program_id(2)
    v = tl.load(job_ptr + s)
    if v >= 0:
        e = tl.load(ids_ptr + s)
        nb = tl.load(nbytes_ptr + p)
        src_w = tl.load(host_ptr + p * E + e).to(tl.pointer_type(tl.int64))
        dst_w = (tl.load(base_ptr + p) + v.to(tl.int64) * nb).to(tl.pointer_type(tl.int64))
        copy_chunk(src_w, dst_w, c * CHUNK, nb // 8, CHUNK, BLOCK)


CHUNK_WORDS = 8192  # 64 KB a program, as stage_copy


class DeviceLru:
    """One layer's device-side residency: admits a step's misses into its slots, evicting by `policy`."""

    def __init__(
        self,
        device: torch.device,
        slot_of: list[int],
        expert_in: list[int],
        tables: torch.Tensor,
        host: torch.Tensor,
        bases: list[int],
        nbytes: torch.Tensor,
        policy: str,
        decay: float,
        most: int,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--expert-policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.lfu = policy == "lfu"
        self.decay = decay
        self.slot_of = torch.tensor(slot_of, dtype=torch.int32, device=device)
        self.expert_in = torch.tensor(expert_in, dtype=torch.int32, device=device)
        c = len(expert_in)
        self.score = torch.zeros(c, dtype=torch.float32, device=device)
        self.mark = torch.zeros(c, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.stats = torch.zeros(3, dtype=torch.int64, device=device)  # hits, misses, admissions
        self.tables, self.host, self.nbytes = tables, host, nbytes
        self.bases = torch.tensor(bases, dtype=torch.int64, device=device)
        self.words = int(nbytes.max().item()) // 8
        self.job = torch.empty(most, dtype=torch.int32, device=device)
        self.out = torch.empty(3, most, dtype=torch.int64, device=device)

    def admit(
        self, ids: torch.Tensor, claim: torch.Tensor | None = None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A step's selections ids [T, k] -> int64 [3, T * k]: the address each selection's gate, up and down
        kernels read (read with the identity as ids), after admitting the misses it could."""
        s = ids.numel()
        flat = ids.reshape(-1)
        e, c = self.slot_of.shape[0], self.expert_in.shape[0]
        out = self.out[:, :s]
        _admit_kernel[(1,)](
            flat, claim if claim is not None else flat, rows if rows is not None else flat, self.slot_of,
            self.expert_in, self.score, self.mark, self.clock, self.stats, self.tables, self.host, self.bases,
            self.nbytes, self.job, self.out, self.out.shape[1], s, e, c, ids.shape[1], self.decay, LFU=self.lfu,
            CLAIM=claim is not None, ROWS=rows is not None, BLOCK_S=triton.next_power_of_2(s),
            BLOCK_C=triton.next_power_of_2(c), num_warps=4,
        )  # fmt: skip
        grid = (s, triton.cdiv(self.words, CHUNK_WORDS), 3)
        _fill_kernel[grid](
            flat, self.job, self.host, self.bases, self.nbytes, e, CHUNK=CHUNK_WORDS, BLOCK=1024
        )
        return out
