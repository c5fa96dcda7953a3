"""The hand-off of a decode step's missed experts between the GPU and a CPU thread, with no host synchronisation.

A layer's `post` launch decides on the device which missed experts the CPU computes (at most quota[misses] of the
ones the CPU holds), writes the step's expert ids, weights and input row into a pinned host mailbox, and raises
the mailbox's request number last. A CPU thread (engine/experts/cpu_misses.py) polls those numbers, computes its
experts and writes their weighted sum and the answer number back. The GPU meanwhile copies and computes the other
misses; the layer's `collect` launch then waits, on the device, for the answer number and adds the CPU's sum to
the layer output. Both launches have fixed addresses and read the step number from a device counter, so a decode
step that contains them can still be one CUDA graph.

A step of T rows (T * K (row, slot) pairs, at most PM) hands over whole experts: the CPU takes an expert for every
row that chose it, so its blocks are read once a step, and the quota counts the step's distinct missed experts.

A mailbox row (int32 words; floats stored as their bits), for at most PM pairs and rows of D floats:
  [0] request number (written last)   [1] distinct experts missed   [2] pairs taken by the CPU   [3] the GPU's wait
  [4] rows T   [8, 8+PM) expert ids of the pairs   [8+PM, 8+2PM) taken (0/1)   [8+2PM, 8+3PM) routing weights
  [X, X+T*D) the experts' float32 input rows   [R] answer number (the CPU writes it last)   [Y, Y+T*D) the sums
with X = 8 + 3PM rounded up to 16 words, R = X + (PM/K)*D rounded up likewise, Y = R + 16: request and answer sit in
cache lines of their own."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.launch import INTERPRETED as _INTERPRETED  # no inline PTX (the fence) there

HDR_REQ, HDR_MISS, HDR_TAKE, HDR_WAIT, HDR_ROWS = 0, 1, 2, 3, 4
IDS = 8
# Polls of the answer number (each a PCIe read of ~1 us) before the GPU gives up on the CPU and says so in the
# mailbox: a dead CPU thread must not hang the card.
WAIT_LIMIT = 1 << 22
# the same offsets as the kernels see them (a jitted function reads constexpr globals only)
_REQ, _MISS, _TAKE, _WAIT, _ROWS = (
    tl.constexpr(HDR_REQ),
    tl.constexpr(HDR_MISS),
    tl.constexpr(HDR_TAKE),
    tl.constexpr(HDR_WAIT),
    tl.constexpr(HDR_ROWS),
)
_IDS = tl.constexpr(IDS)


class Layout(NamedTuple):
    """Where a mailbox row keeps what (int32 words), for at most `pairs` (row, slot) pairs of k slots a row."""

    pairs: int
    x: int  # the input rows' first word
    answer: int
    y: int  # the sums' first word
    words: int


def _up16(n: int) -> int:
    return -(-n // 16) * 16


def row_layout(k: int, d: int, rows: int = 1) -> Layout:
    """The mailbox row of steps of at most `rows` rows of k slots, and rows of d floats."""
    pm = rows * k
    x = _up16(IDS + 3 * pm)
    r = _up16(x + rows * d)
    return Layout(pm, x, r, r + 16, _up16(r + 16 + rows * d))


@triton.jit
def _fence_sys(v):
    # orders this thread's earlier writes before its later ones for every observer, the host included
    return tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _post_kernel(
    ids_ptr,  # int64 [P]: the step's experts, P = T * K pairs
    w_ptr,  # float32 [P]: their routing weights
    x_ptr,  # float32 [T, D]: the experts' input rows
    cpu_ptr,  # int32 [E]: 1 where the CPU holds the expert
    tab_ptr,  # int64 [E]: the cache's gate table (an expert is missed where it holds the host address)
    host_ptr,  # int64 [E]: each expert's gate address in host memory
    quota_ptr,  # int32 [PM + 1] in pinned host memory: experts the CPU may take when the step misses m
    claim_ptr,  # int32 [P] out: 1 where the CPU computes the pair
    wg_ptr,  # float32 [P] out: the weights with the CPU's pairs zeroed (the GPU's sum)
    cnt_ptr,  # int32 [1]: this layer's request number (on the device)
    taken_ptr,  # int64 [1]: pairs the CPU was given, all layers and steps together
    box_ptr,  # int32 [row words]: this layer's mailbox row in pinned host memory
    P,
    T,
    D,
    PM,  # the most pairs a row holds (the layout's offsets)
    X,  # the input rows' first word
    BP: tl.constexpr,
    BD: tl.constexpr,
    FENCE: tl.constexpr,
):
    j = tl.arange(0, BP)
    mk = j < P
    e = tl.load(ids_ptr + j, mask=mk, other=-1)
    w = tl.load(w_ptr + j, mask=mk, other=0.0)
    miss = (tl.load(tab_ptr + e, mask=mk, other=0) == tl.load(host_ptr + e, mask=mk, other=1)) & mk
    held = miss & (tl.load(cpu_ptr + e, mask=mk, other=0) != 0)
    same = e[:, None] == e[None, :]
    first = mk & (
        tl.max((same & (j[None, :] < j[:, None])).to(tl.int32), axis=1) == 0
    )  # an expert counts once
    n_miss = tl.sum((first & miss).to(tl.int32), 0)
    quota = tl.load(quota_ptr + n_miss, volatile=True)
    one = first & held
    rank = tl.cumsum(one.to(tl.int32), 0) - one.to(tl.int32)  # among the held missed experts, in pair order
    mine = one & (rank < quota)
    take = mk & (tl.max((same & mine[None, :]).to(tl.int32), axis=1) > 0)  # every pair of a taken expert
    n_take = tl.sum(take.to(tl.int32), 0)
    tl.store(claim_ptr + j, take.to(tl.int32), mask=mk)
    tl.store(wg_ptr + j, tl.where(take, 0.0, w), mask=mk)
    seq = tl.load(cnt_ptr) + 1
    tl.debug_barrier()  # every thread has read the old number before any writes the new one
    tl.store(cnt_ptr, seq)
    tl.atomic_add(taken_ptr, n_take.to(tl.int64))
    tl.store(box_ptr + _IDS + j, e.to(tl.int32), mask=mk)
    tl.store(box_ptr + _IDS + PM + j, take.to(tl.int32), mask=mk)
    tl.store((box_ptr + _IDS + 2 * PM + j).to(tl.pointer_type(tl.float32)), w, mask=mk)
    tl.store(box_ptr + _MISS, n_miss)
    tl.store(box_ptr + _TAKE, n_take)
    tl.store(box_ptr + _ROWS, T)
    xf = (box_ptr + X).to(tl.pointer_type(tl.float32))
    for off in range(0, T * D, BD):
        o = off + tl.arange(0, BD)
        m = o < T * D
        tl.store(xf + o, tl.load(x_ptr + o, mask=m), mask=m)
    if FENCE:
        seq = _fence_sys(seq)
    tl.debug_barrier()  # all of the row is written (and fenced) before the request number
    tl.store(box_ptr + _REQ, seq)


@triton.jit
def _collect_kernel(
    out_ptr,  # float32 [T, D]: the layer's output rows, the CPU's sums added in place
    claim_ptr,  # int32 [P]
    cnt_ptr,  # int32 [1]: this layer's request number
    box_ptr,  # int32 [row words]
    N,  # T * D
    R,  # the answer word
    Y,  # the sums' first word
    P,
    BK: tl.constexpr,
    BD: tl.constexpr,
    LIMIT: tl.constexpr,
    FENCE: tl.constexpr,
):
    j = tl.arange(0, BK)
    n = tl.sum(tl.load(claim_ptr + j, mask=j < P, other=0), 0)
    if n > 0:
        seq = tl.load(cnt_ptr)
        got = tl.load(box_ptr + R, volatile=True)
        i = 0
        while (got != seq) & (i < LIMIT):
            got = tl.load(box_ptr + R, volatile=True)
            i += 1
        if FENCE:
            got = _fence_sys(got)
        tl.store(box_ptr + _WAIT, tl.where(got == seq, i, -1))  # -1: the CPU never answered
        yf = (box_ptr + Y).to(tl.pointer_type(tl.float32))
        for off in range(0, N, BD):
            o = off + tl.arange(0, BD)
            m = o < N
            y = tl.load(yf + o, mask=m, other=0.0, volatile=True)
            tl.store(out_ptr + o, tl.load(out_ptr + o, mask=m) + tl.where(got == seq, y, 0.0), mask=m)


def post(
    ids: torch.Tensor,
    w: torch.Tensor,
    x: torch.Tensor,
    cpu: torch.Tensor,
    table: torch.Tensor,
    host: torch.Tensor,
    quota: torch.Tensor,
    claim: torch.Tensor,
    wg: torch.Tensor,
    cnt: torch.Tensor,
    taken: torch.Tensor,
    box: torch.Tensor,
    layout: Layout,
) -> None:
    """A step's layer: ids [T, K], w [T, K] float32, x [T, D] float32 (device); box: the layer's mailbox row
    (pinned, laid out as `layout`). Fills claim [T * K] and wg [T * K] (device) and the mailbox, then raises its
    request number."""
    p, (t, d) = ids.numel(), x.shape
    if p > layout.pairs:
        raise ValueError(f"a step of {p} (row, slot) pairs does not fit a mailbox of {layout.pairs}")
    _post_kernel[(1,)](
        ids.view(-1), w.view(-1), x.view(-1), cpu, table, host, quota, claim, wg, cnt, taken, box, p, t, d,
        layout.pairs, layout.x, BP=max(16, triton.next_power_of_2(p)), BD=min(1024, triton.next_power_of_2(t * d)),
        FENCE=not _INTERPRETED, num_warps=4,
    )  # fmt: skip


def collect(
    out: torch.Tensor, claim: torch.Tensor, cnt: torch.Tensor, box: torch.Tensor, layout: Layout
) -> None:
    """Waits (on the device) for the CPU's answer to this layer's request and adds its sums to out [T, D] float32
    in place; nothing where the CPU took no pair."""
    p, n = claim.numel(), out.numel()
    _collect_kernel[(1,)](
        out.view(-1), claim, cnt, box, n, layout.answer, layout.y, p, BK=max(16, triton.next_power_of_2(p)),
        BD=min(1024, triton.next_power_of_2(n)), LIMIT=WAIT_LIMIT, FENCE=not _INTERPRETED, num_warps=4,
    )  # fmt: skip
