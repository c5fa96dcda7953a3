"""A routing trace replayed (or recorded) inside the step, CUDA-graph safe: one launch a MoE layer.

Which trace row a layer's tokens take is the number of tokens that layer has counted so far (its selection counts
sum to k a token, and the CUDA graphs' warm-up runs put them back), so record and replay agree with no counter of
their own, and a captured step advances through the trace as it replays. One program: it reads the count, then
walks the rows in blocks, so the count is read before its own additions."""

import torch
import triton
import triton.language as tl


@triton.jit
def _trace_kernel(
    counts_ptr,  # int64 [E]: this layer's selection counts (gains one per selection of the first `rows` rows)
    tab_ids_ptr,  # int16 [N, L, K]: the trace
    tab_w_ptr,  # float32 [N, L, K]
    ids_ptr,  # int64 [T, K]: replay: written; record: the router's, read
    w_ptr,  # float32 [T, K]: as ids
    rows_ptr,  # int64 [1]: rows that count (ROWS), else all T
    col,
    L,
    N,
    E,
    T,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
    REPLAY: tl.constexpr,
    ROWS: tl.constexpr,
):
    oe = tl.arange(0, BLOCK_E)
    done = tl.sum(tl.load(counts_ptr + oe, mask=oe < E, other=0), axis=0) // K  # tokens this layer counted
    real = T
    if ROWS:
        real = tl.load(rows_ptr)
    for start in range(0, T * K, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < T * K
        t = o // K
        j = o % K
        row = done + t
        if REPLAY:
            at = ((row % N) * L + col) * K + j
            e = tl.load(tab_ids_ptr + at, mask=m, other=0).to(tl.int64)
            tl.store(ids_ptr + o, e, mask=m)
            tl.store(w_ptr + o, tl.load(tab_w_ptr + at, mask=m, other=0.0), mask=m)
        else:
            e = tl.load(ids_ptr + o, mask=m, other=0)
            keep = m & (row < N) & (t < real)  # past the buffer's end: not recorded (the host says so)
            at = (row * L + col) * K + j
            tl.store(tab_ids_ptr + at, e.to(tl.int16), mask=keep)
            tl.store(tab_w_ptr + at, tl.load(w_ptr + o, mask=m, other=0.0), mask=keep)
        tl.atomic_add(counts_ptr + e, tl.full([BLOCK], 1, tl.int64), mask=m & (t < real))


def trace_route(
    counts: torch.Tensor,
    tab_ids: torch.Tensor,
    tab_w: torch.Tensor,
    col: int,
    ids: torch.Tensor,
    w: torch.Tensor,
    replay: bool,
    rows: torch.Tensor | None = None,
) -> None:
    """Replay (write ids [T, k] and w [T, k] from the trace) or record (write them into it) for column `col`,
    and count the selections into `counts` [E]."""
    t, k = ids.shape
    n, layers, _ = tab_ids.shape
    e = counts.shape[0]
    _trace_kernel[(1,)](
        counts, tab_ids, tab_w, ids, w, rows if rows is not None else counts, col, layers, n, e, t,
        K=k, BLOCK_E=triton.next_power_of_2(e), BLOCK=1024, REPLAY=replay, ROWS=rows is not None, num_warps=4,
    )  # fmt: skip
