"""The hand-off of a decode step's missed experts between the GPU and a CPU thread, with no host synchronisation.

A layer's `post` launch decides on the device which missed experts the CPU computes (at most quota[misses] of the
ones the CPU holds), writes the step's expert ids, weights and input row into a pinned host mailbox, and raises
the mailbox's request number last. A CPU thread (engine/experts/cpu_misses.py) polls those numbers, computes its
experts and writes their weighted sum and the answer number back. The GPU meanwhile copies and computes the other
misses; the layer's `collect` launch then waits, on the device, for the answer number and adds the CPU's sum to
the layer output. Both launches have fixed addresses and read the step number from a device counter, so a decode
step that contains them can still be one CUDA graph.

A mailbox row (int32 words; floats stored as their bits):
  [0] request number (written last)   [1] misses of the step   [2] slots taken by the CPU   [3] the GPU's wait
  [8, 8+K) expert ids   [8+K, 8+2K) taken (0/1)   [8+2K, 8+3K) routing weights
  [X, X+D) the experts' float32 input          [R] answer number (the CPU writes it last)   [Y, Y+D) the sum
with X = 64, R = X + D rounded up to 16 words, Y = R + 16: request and answer sit in cache lines of their own."""

import torch
import triton
import triton.language as tl

from engine.kernels.gemv import _INTERPRETED  # no inline PTX (the fence) in Triton's interpreter

HDR_REQ, HDR_MISS, HDR_TAKE, HDR_WAIT = 0, 1, 2, 3
IDS = 8
X_OFF = 64
# Polls of the answer number (each a PCIe read of ~1 us) before the GPU gives up on the CPU and says so in the
# mailbox: a dead CPU thread must not hang the card.
WAIT_LIMIT = 1 << 22
# the same offsets as the kernels see them (a jitted function reads constexpr globals only)
_REQ, _MISS, _TAKE, _WAIT = (
    tl.constexpr(HDR_REQ),
    tl.constexpr(HDR_MISS),
    tl.constexpr(HDR_TAKE),
    tl.constexpr(HDR_WAIT),
)
_IDS, _X = tl.constexpr(IDS), tl.constexpr(X_OFF)


def row_layout(k: int, d: int) -> tuple[int, int, int]:
    """(answer word R, sum start Y, row words) of a mailbox row for k slots and rows of d floats."""
    if IDS + 3 * k > X_OFF:
        raise ValueError(
            f"{k} expert slots a token do not fit the mailbox header (at most {(X_OFF - IDS) // 3})"
        )
    r = -(-(X_OFF + d) // 16) * 16
    y = r + 16
    return r, y, -(-(y + d) // 16) * 16


@triton.jit
def _fence_sys(v):
    # orders this thread's earlier writes before its later ones for every observer, the host included
    return tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _post_kernel(
    ids_ptr,  # int64 [K]: the step's experts
    w_ptr,  # float32 [K]: their routing weights
    x_ptr,  # float32 [D]: the experts' input row
    cpu_ptr,  # int32 [E]: 1 where the CPU holds the expert
    tab_ptr,  # int64 [E]: the cache's gate table (an expert is missed where it holds the host address)
    host_ptr,  # int64 [E]: each expert's gate address in host memory
    quota_ptr,  # int32 [K + 1] in pinned host memory: slots the CPU may take when the step misses m experts
    claim_ptr,  # int32 [K] out: 1 where the CPU computes the slot
    wg_ptr,  # float32 [K] out: the weights with the CPU's slots zeroed (the GPU's sum)
    cnt_ptr,  # int32 [1]: this layer's request number (on the device)
    taken_ptr,  # int64 [1]: slots the CPU was given, all layers and steps together
    box_ptr,  # int32 [row words]: this layer's mailbox row in pinned host memory
    D,
    K: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    FENCE: tl.constexpr,
):
    j = tl.arange(0, BK)
    mk = j < K
    e = tl.load(ids_ptr + j, mask=mk, other=0)
    w = tl.load(w_ptr + j, mask=mk, other=0.0)
    miss = (tl.load(tab_ptr + e, mask=mk, other=0) == tl.load(host_ptr + e, mask=mk, other=1)) & mk
    held = miss & (tl.load(cpu_ptr + e, mask=mk, other=0) != 0)
    n_miss = tl.sum(miss.to(tl.int32), 0)
    quota = tl.load(quota_ptr + n_miss, volatile=True)
    rank = tl.cumsum(held.to(tl.int32), 0) - held.to(tl.int32)  # among the held misses, in slot order
    take = held & (rank < quota)
    n_take = tl.sum(take.to(tl.int32), 0)
    tl.store(claim_ptr + j, take.to(tl.int32), mask=mk)
    tl.store(wg_ptr + j, tl.where(take, 0.0, w), mask=mk)
    seq = tl.load(cnt_ptr) + 1
    tl.debug_barrier()  # every thread has read the old number before any writes the new one
    tl.store(cnt_ptr, seq)
    tl.atomic_add(taken_ptr, n_take.to(tl.int64))
    tl.store(box_ptr + _IDS + j, e.to(tl.int32), mask=mk)
    tl.store(box_ptr + _IDS + K + j, take.to(tl.int32), mask=mk)
    tl.store((box_ptr + _IDS + 2 * K + j).to(tl.pointer_type(tl.float32)), w, mask=mk)
    tl.store(box_ptr + _MISS, n_miss)
    tl.store(box_ptr + _TAKE, n_take)
    xf = (box_ptr + _X).to(tl.pointer_type(tl.float32))
    for off in range(0, D, BD):
        o = off + tl.arange(0, BD)
        m = o < D
        tl.store(xf + o, tl.load(x_ptr + o, mask=m), mask=m)
    if FENCE:
        seq = _fence_sys(seq)
    tl.debug_barrier()  # all of the row is written (and fenced) before the request number
    tl.store(box_ptr + _REQ, seq)


@triton.jit
def _collect_kernel(
    out_ptr,  # float32 [D]: the layer's output row, the CPU's sum added in place
    claim_ptr,  # int32 [K]
    cnt_ptr,  # int32 [1]: this layer's request number
    box_ptr,  # int32 [row words]
    D,
    R,  # the answer word
    Y,  # the sum's first word
    K: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    LIMIT: tl.constexpr,
    FENCE: tl.constexpr,
):
    j = tl.arange(0, BK)
    n = tl.sum(tl.load(claim_ptr + j, mask=j < K, other=0), 0)
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
        for off in range(0, D, BD):
            o = off + tl.arange(0, BD)
            m = o < D
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
) -> None:
    """One token's layer: ids [1, K], w [1, K] float32, x [1, D] float32 (device); box: the layer's mailbox row
    (pinned). Fills claim [K] and wg [K] (device) and the mailbox, then raises its request number."""
    k, d = ids.numel(), x.numel()
    _post_kernel[(1,)](
        ids.view(-1), w.view(-1), x.view(-1), cpu, table, host, quota, claim, wg, cnt, taken, box, d,
        K=k, BK=triton.next_power_of_2(k), BD=min(1024, triton.next_power_of_2(d)), FENCE=not _INTERPRETED,
        num_warps=4,
    )  # fmt: skip


def collect(out: torch.Tensor, claim: torch.Tensor, cnt: torch.Tensor, box: torch.Tensor) -> None:
    """Waits (on the device) for the CPU's answer to this layer's request and adds its sum to out [1, D] float32
    in place; nothing where the CPU took no slot."""
    k, d = claim.numel(), out.numel()
    r, y, _ = row_layout(k, d)
    _collect_kernel[(1,)](
        out.view(-1), claim, cnt, box, d, r, y, K=k, BK=triton.next_power_of_2(k),
        BD=min(1024, triton.next_power_of_2(d)), LIMIT=WAIT_LIMIT, FENCE=not _INTERPRETED, num_warps=4,
    )  # fmt: skip
