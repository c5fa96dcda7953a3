"""Fused elementwise kernels for the decode step: RMS norm, and per-head RMS norm + RoPE of queries and keys.
Each replaces the handful of small torch kernels it stands for: at batch 1 their launches, not their bytes, cost."""

import torch
import triton
import triton.language as tl

from engine.kernels.launch import pdl_args, pdl_enter
from engine.kernels.tuning import tuned


@triton.jit
def store_q8(y, q_row, D, BLOCK: tl.constexpr):
    """Row y [BLOCK] (float32; D real values, D a multiple of 32) rounded to 8 bits with a scale per 32, stored at
    the float32 pointer `q_row` as engine.kernels.gemv.quantize_q8 lays it out: D int8 values, then (scale,
    scale * sum of the 32 values) per block."""
    qb = q_row.to(tl.pointer_type(tl.int8))
    store_q8_rows(
        y[None, :],
        qb[None],
        (qb + D).to(tl.pointer_type(tl.float32))[None],
        tl.full([1], 1, tl.int1),
        D,
        1,
        BLOCK,
    )


@triton.jit
def store_q8_rows(y, q_rows, meta_rows, rmask, D, R: tl.constexpr, BLOCK: tl.constexpr):
    """Rows y [R, BLOCK] (float32, D real values each, D a multiple of 32; rows where rmask [R] is false are
    skipped) rounded to 8 bits with a scale per 32: the int8 values at the int8 pointers q_rows [R], the (scale,
    scale * sum of the 32 values) pairs at the float32 pointers meta_rows [R]. store_q8 is the one-row case; the
    decode attention writes each head's slice of a row this way."""
    yb = tl.reshape(y, [R, BLOCK // 32, 32])
    d = tl.max(tl.abs(yb), axis=2) / 127.0  # [R, BLOCK / 32]
    inv = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)
    q = tl.floor(yb * inv[:, :, None] + 0.5)  # round half up (quantize_q8 rounds the same way)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    o32 = tl.arange(0, BLOCK // 32)
    offs = o32[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BLOCK / 32, 32]
    tl.store(q_rows[:, None, None] + offs[None], q.to(tl.int8), mask=rmask[:, None, None] & (offs[None] < D))
    bm = rmask[:, None] & (o32[None, :] * 32 < D)
    tl.store(meta_rows[:, None] + 2 * o32[None, :], d, mask=bm)
    tl.store(meta_rows[:, None] + 2 * o32[None, :] + 1, d * tl.sum(q, axis=2), mask=bm)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, y2_ptr, q_ptr, D, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr, TWO: tl.constexpr,
    Q8: tl.constexpr,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + offs, y.to(y_ptr.dtype.element_ty), mask=m)
    if TWO:  # a float32 copy too (the MoE router reads float32)
        tl.store(y2_ptr + row * D + offs, y, mask=m)
    if Q8:  # and the 8-bit form the approximate GEMV bodies read (--activations int8)
        store_q8(tl.where(m, y, 0.0), q_ptr + row * D, D, BLOCK)


@triton.jit
def _q8_kernel(x_ptr, q_ptr, D, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * D + offs, mask=offs < D, other=0.0).to(tl.float32)
    store_q8(x, q_ptr + row * D, D, BLOCK)


def quantize_rows_q8(x: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> float32 [T, D] in quantize_q8's layout, one launch."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # the kernel writes every byte read
    return quantize_rows_q8_into(x, out)


def quantize_rows_q8_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """quantize_rows_q8 into `out` (float32 [T, D])."""
    t, d = x.shape
    _q8_kernel[(t,)](x.contiguous(), out, d, BLOCK=triton.next_power_of_2(d), **pdl_args(x.device))
    return out


def _rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    f32_copy: bool,
    q8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    d = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    y2 = torch.empty(x.shape, dtype=torch.float32, device=x.device) if f32_copy else None
    # no fill: the kernel writes every byte the GEMVs read (a fill would be one more launch)
    yq = torch.empty(x.shape, dtype=torch.float32, device=x.device) if q8 else None
    rows = xc.numel() // d
    _rms_norm_kernel[(rows,)](
        xc,
        weight if weight is not None else xc,
        y,
        y2 if y2 is not None else y,
        yq if yq is not None else y,
        d,
        eps,
        HAS_W=weight is not None,
        BLOCK=triton.next_power_of_2(d),
        TWO=f32_copy,
        Q8=q8,
        **pdl_args(x.device),
    )
    return y, y2, yq


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """x [..., D] -> normalised in float32, times weight, as out_dtype."""
    return _rms_norm(x, weight, eps, out_dtype, False)[0]


def rms_norm_q8(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype, f32_copy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`rms_norm` (and its float32 copy with f32_copy), and the same rounded to 8 bits (engine.kernels.gemv's
    quantize_q8 layout, for the approximate GEMV bodies), from one launch."""
    y, y2, yq = _rms_norm(x, weight, eps, out_dtype, f32_copy, q8=True)
    assert yq is not None
    return y, y2, yq


def rms_norm_pair(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` as out_dtype and as float32, from one launch."""
    y, y2, _ = _rms_norm(x, weight, eps, out_dtype, True)
    assert y2 is not None
    return y, y2


@triton.jit
def rope_pairs(offs, HALF: tl.constexpr, NEOX: tl.constexpr):
    """For features `offs` of a head: the frequency index, the partner feature each rotates with, and the sign
    of the partner's term. NEOX pairs (i, i + HALF); the other layout pairs (2i, 2i + 1)."""
    if NEOX:
        i = offs % HALF
        partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
        sign = tl.where(offs < HALF, -1.0, 1.0)
    else:
        i = offs // 2
        partner = tl.where(offs % 2 == 0, offs + 1, offs - 1)
        sign = tl.where(offs % 2 == 0, -1.0, 1.0)
    return i, partner, sign


@triton.jit
def _norm_rope_kernel(
    x_ptr,  # [T, H, Dh] contiguous
    w_ptr,  # [Dh] norm weight
    pos_ptr,  # [T] int64
    inv_ptr,  # [ROT/2] float32 effective inverse frequencies
    y_ptr,
    H,
    Dh,
    eps,
    mscale,
    ROT: tl.constexpr,
    HALF: tl.constexpr,  # ROT // 2
    BLOCK: tl.constexpr,  # >= Dh, power of two
    NORM: tl.constexpr,
    NEOX: tl.constexpr,
):
    row = tl.program_id(0)  # t * H + h
    t = row // H
    offs = tl.arange(0, BLOCK)
    m = offs < Dh
    x = tl.load(x_ptr + row * Dh + offs, mask=m, other=0.0).to(tl.float32)
    if NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) / Dh + eps)
        x = x * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    p = tl.load(pos_ptr + t).to(tl.float32)
    i, partner, sign = rope_pairs(offs, HALF, NEOX)
    rot = offs < ROT
    theta = p * tl.load(inv_ptr + i, mask=rot, other=0.0)
    xp = tl.load(x_ptr + row * Dh + partner, mask=rot, other=0.0).to(tl.float32)
    if NORM:  # the partner must be normalised like x: recompute its scaled value from the same row statistics
        xr = tl.load(x_ptr + row * Dh + offs, mask=m, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xr * xr, axis=0) / Dh + eps)
        xp = xp * inv_rms * tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    out = tl.where(rot, (x * tl.cos(theta) + sign * xp * tl.sin(theta)) * mscale, x)
    tl.store(y_ptr + row * Dh + offs, out.to(y_ptr.dtype.element_ty), mask=m)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    rot: int,
    neox: bool,
    mscale: float,
) -> torch.Tensor:
    """x [T, H, Dh] -> optional per-head RMS norm, then RoPE at positions `pos` [T], same dtype as x."""
    t, h, dh = x.shape
    xc = x.contiguous()
    y = torch.empty_like(xc)
    _norm_rope_kernel[(t * h,)](
        xc,
        weight if weight is not None else xc,
        pos,
        inv_freq,
        y,
        h,
        dh,
        eps,
        mscale,
        ROT=rot,
        HALF=rot // 2,
        BLOCK=triton.next_power_of_2(dh),
        NORM=weight is not None,
        NEOX=neox,
    )
    return y


@triton.jit
def _topk_store(x, m, offs, w_row, ids_row, counts_ptr, K: tl.constexpr, KP2: tl.constexpr, NORM: tl.constexpr,
                COUNT: tl.constexpr):  # fmt: skip
    """Router logits x [BLOCK_E] (valid where m) -> softmax, the top K weights and ids stored at w_row / ids_row
    (renormalised when NORM), one count per selection into counts_ptr (when COUNT)."""
    x = tl.where(m, x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(m, p, 0.0)
    p = p / tl.sum(p, axis=0)
    kk = tl.arange(0, KP2)
    sel_w = tl.zeros([KP2], dtype=tl.float32)
    sel_i = tl.zeros([KP2], dtype=tl.int64)
    for j in tl.static_range(K):  # top-k by repeated arg-max, in descending order as torch.topk returns them
        best = tl.max(p, axis=0)
        idx = tl.argmax(p, axis=0)
        sel_w = tl.where(kk == j, best, sel_w)
        sel_i = tl.where(kk == j, idx.to(tl.int64), sel_i)
        p = tl.where(offs == idx, -1.0, p)
    if COUNT:  # one vector atomic after the loop: k scalar ones would each wait for their round trip
        tl.atomic_add(counts_ptr + sel_i, tl.full([KP2], 1, tl.int64), mask=kk < K)
    if NORM:
        sel_w = sel_w / tl.sum(sel_w, axis=0)
    tl.store(w_row + kk, sel_w, mask=kk < K)
    tl.store(ids_row + kk, sel_i, mask=kk < K)


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] float32
    w_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int64
    counts_ptr,  # [E] int64 (when COUNT)
    E,
    K: tl.constexpr,
    KP2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    NORM: tl.constexpr,
    COUNT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    x = tl.load(logits_ptr + t * E + offs, mask=m, other=float("-inf"))
    _topk_store(x, m, offs, w_ptr + t * K, ids_ptr + t * K, counts_ptr, K, KP2, NORM, COUNT)


def route(
    logits: torch.Tensor, k: int, norm: bool, counts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32) -> softmax, top-k weights [T, k] (renormalised when `norm`) and ids [T, k];
    `counts` [E] (int64) gains one per selection. One kernel for what takes eight in torch."""
    t, e = logits.shape
    lc = logits.contiguous()
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    _route_kernel[(t,)](
        lc,
        w,
        ids,
        counts if counts is not None else ids,
        e,
        K=k,
        KP2=triton.next_power_of_2(k),
        BLOCK_E=triton.next_power_of_2(e),
        NORM=norm,
        COUNT=counts is not None,
        num_warps=1,  # the top-k is k rounds of max + argmax: one warp's shuffles, no block-wide barriers
        **pdl_args(lc.device),
    )
    return w, ids


@triton.jit
def last_to_finish(done_row):
    """Whether this program is the last of its row of the grid (axis 0) to get here. It counts itself done at
    done_row (int32, zero before the launch) once all its threads' stores are out; the last one may then read what
    the others stored (volatile loads: not from L1) and must set done_row back to zero for the next launch."""
    tl.debug_barrier()
    return tl.atomic_add(done_row, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1


@triton.jit
def _norm_route_kernel(
    h_ptr,  # [T, D] float32 residual stream
    nw_ptr,  # [D] norm weight
    r_ptr,  # [E, D] float32 router rows
    logits_ptr,  # [T, E] float32 scratch
    done_ptr,  # [>= T] int32, zero between launches: programs of row t that have written their logits
    y_ptr,  # [T, D] normalised, out dtype (OUT_Y)
    y32_ptr,  # [T, D] normalised, float32 (OUT_Y32)
    q_ptr,  # [T, D] float32 holding quantize_q8's layout (Q8)
    w_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int64
    counts_ptr,  # [E] int64 (COUNT)
    D,
    E,
    eps,
    ROWS: tl.constexpr,  # router rows a program
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    KP2: tl.constexpr,
    NORM: tl.constexpr,
    COUNT: tl.constexpr,
    OUT_Y: tl.constexpr,
    OUT_Y32: tl.constexpr,
    Q8: tl.constexpr,
    SELECT: tl.constexpr,  # the top-k here (last program of a row), or logits only (`route` after)
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    """The FFN's RMS norm and the router's logits in one launch, and with SELECT the softmax + top-k too. Every
    program normalises the row itself (8 KB from L2: cheaper than a launch) and computes ROWS logits; with SELECT
    the last program of a row to finish (last_to_finish) reads all E logits back and selects."""
    pdl_enter(PDL)
    p = tl.program_id(0)
    t = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    h = tl.load(h_ptr + t * D + offs, mask=m, other=0.0)
    nw = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps) * nw
    if p == 0:
        if OUT_Y:
            tl.store(y_ptr + t * D + offs, y.to(y_ptr.dtype.element_ty), mask=m)
        if OUT_Y32:
            tl.store(y32_ptr + t * D + offs, y, mask=m)
        if Q8:
            store_q8(tl.where(m, y, 0.0), q_ptr + t * D, D, BLOCK)
    e = p * ROWS + tl.arange(0, ROWS)
    em = e < E
    wr = tl.load(
        r_ptr + e.to(tl.int64)[:, None] * D + offs[None, :], mask=em[:, None] & m[None, :], other=0.0
    )
    tl.store(logits_ptr + t * E + e, tl.sum(wr * y[None, :], axis=1), mask=em)
    if SELECT:
        if last_to_finish(done_ptr + t):
            oe = tl.arange(0, BLOCK_E)
            me = oe < E
            x = tl.load(logits_ptr + t * E + oe, mask=me, other=float("-inf"), volatile=True)  # not from L1
            _topk_store(x, me, oe, w_ptr + t * K, ids_ptr + t * K, counts_ptr, K, KP2, NORM, COUNT)
            tl.store(done_ptr + t, 0)


def norm_route(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    k: int,
    norm: bool,
    counts: torch.Tensor | None,
    done: torch.Tensor,
    out_dtype: torch.dtype | None,
    f32_copy: bool,
    q8: bool,
    launch: tuple[int, int] | None = None,
    select: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """h [T, D] float32 -> (rms_norm(h) as out_dtype or None, its float32 copy or None, its 8-bit form
    (quantize_q8's layout) or None, top-k weights [T, k], ids [T, k]) for the router `router` [E, D] float32:
    `rms_norm_q8` + the router's GEMV + `route` in one launch (or two, with the top-k apart). `done` [>= T] int32
    zeros, owned by the caller (one per call site: the kernel counts in it and leaves it zeroed). `launch`: (router
    rows a program, warps), by default the tuning file's; `select` False (or the tuning file's third value 0): the
    top-k in a `route` launch of its own after this one."""
    t, d = h.shape
    e = router.shape[0]
    dev = h.device
    block = triton.next_power_of_2(d)
    if launch is None:
        # the tuning file's pick (bench/gemv_graph_micro.py measures them): rows, warps, select
        got = tuned().get("F32", {}).get("norm_route") or [4, 4, 1]
        launch, select = (got[0], got[1]), select and bool(got[2])
    rows, warps = launch
    # the router rows a program holds: [ROWS, BLOCK] floats in registers
    rows = max(1, min(rows, 8192 // block))
    y = torch.empty(t, d, dtype=out_dtype, device=dev) if out_dtype is not None else None
    y32 = torch.empty(t, d, dtype=torch.float32, device=dev) if f32_copy else None
    yq = torch.empty(t, d, dtype=torch.float32, device=dev) if q8 else None
    logits = torch.empty(t, e, dtype=torch.float32, device=dev)
    w = torch.empty(t, k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, k, dtype=torch.int64, device=dev)
    _norm_route_kernel[(triton.cdiv(e, rows), t)](
        h.contiguous(), norm_weight, router, logits, done, y if y is not None else logits,
        y32 if y32 is not None else logits, yq if yq is not None else logits, w, ids,
        counts if counts is not None else ids, d, e, eps,
        ROWS=rows, BLOCK=block, BLOCK_E=triton.next_power_of_2(e), K=k, KP2=triton.next_power_of_2(k), NORM=norm,
        COUNT=counts is not None, OUT_Y=y is not None, OUT_Y32=f32_copy, Q8=q8, SELECT=select, num_warps=warps,
        **pdl_args(h.device),
    )  # fmt: skip
    if not select:
        w, ids = route(logits, k, norm, counts)
    return y, y32, yq, w, ids
