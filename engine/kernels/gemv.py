"""Triton matrix-vector kernels that compute directly on GGUF blocks (decode: a few rows of activations).

One kernel body serves dense weights and routed experts: for experts the weight pointer of each (token, slot) comes
from a device-side table (`int64` addresses, one per expert: a VRAM slot or pinned host memory read over PCIe), so
one launch covers every selected expert of a layer with no host synchronisation, and the launch can be captured
in a CUDA graph. The dequantization happens in registers; nothing is written back to memory but the outputs.
"""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT

from engine.gguf.quants import code_values
from engine.kernels import int8_activations
from engine.kernels.fused import last_to_finish, quantize_rows_q8, store_q8
from engine.kernels.launch import INTERPRETED as _INTERPRETED
from engine.kernels.launch import pdl_args, pdl_enter, prefetch_l2
from engine.kernels.rows_mma import rows_mma
from engine.kernels.rows_mma import takes as mma_takes
from engine.kernels.tuning import tuned as _tuned
from engine.kernels.vec_dot import _row_dot
from installer.engine_options import runtime_switches

# qtype -> (constexpr id, elements per block, bytes per block)
KERNEL_TYPES: dict[QT, tuple[int, int, int]] = {
    QT.Q4_K: (0, 256, 144),
    QT.Q6_K: (1, 256, 210),
    QT.Q8_0: (2, 32, 34),
    QT.Q4_0: (3, 32, 18),
    QT.Q5_K: (4, 256, 176),
    QT.F32: (6, 1, 4),  # the MoE router's float32 rows
    QT.MXFP4: (8, 32, 17),
    QT.IQ4_XS: (9, 256, 136),
}


def lut(qtype: QT, device: torch.device) -> torch.Tensor:
    """float32 [16] code values of a lookup-table block type on `device` (a placeholder for the others; cached
    per device by code_values, so a captured step copies nothing)."""
    return code_values(QT.IQ4_NL if qtype == QT.IQ4_XS else QT.MXFP4, device)


# Other kernel bodies for a block type, chosen per launch class by the tuning file.
_VARIANTS: dict[QT, tuple[int, ...]] = {QT.Q4_K: (0, 5, 10, 12), QT.Q6_K: (1, 11, 13), QT.F32: (6,)}
# Bodies on activations rounded to 8 bits (quantize_q8), as llama.cpp's MMVQ computes: not the float product the
# others give, so they run only under `--activations int8` (the default; see int8_activations).
APPROXIMATE = {12, 13}


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> float32 [T, K] holding, per row, K int8 values (x / scale rounded, a scale per 32) and then
    (scale, scale * sum of the 32 values) per block: the activations of the 8-bit bodies (APPROXIMATE), laid out so
    that a row starts K elements after the last, as the kernels index activations. One launch on a GPU."""
    if x.is_cuda or _INTERPRETED:
        return quantize_rows_q8(x)
    return quantize_q8_torch(x)


def quantize_q8_torch(x: torch.Tensor) -> torch.Tensor:
    """quantize_q8 in torch ops (the same rounding: times the reciprocal of the scale, half up)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // 32, 32)
    d = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = torch.floor(xb * inv[..., None] + 0.5).clamp(-127, 127)
    out = torch.zeros(t, k, dtype=torch.float32, device=x.device)
    raw = out.view(torch.uint8)  # [T, 4K] bytes
    raw[:, :k] = q.to(torch.int8).reshape(t, k).view(torch.uint8)
    meta = torch.stack((d, d * q.sum(dim=-1)), dim=-1).reshape(t, k // 16)  # float32 pairs
    raw[:, k : k + k // 4] = meta.contiguous().view(torch.uint8)
    return out


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """The float values the 8-bit bodies compute with for activations x [T, K]: quantize_q8's int8 codes times
    their block scales (the reference for those bodies, and what a float path must use to give their products)."""
    t, k = x.shape
    raw = quantize_q8_torch(x).view(torch.uint8)
    q = raw[:, :k].contiguous().view(torch.int8).float().reshape(t, k // 32, 32)
    d = raw[:, k : k + k // 4].contiguous().view(torch.float32).reshape(t, k // 32, 2)[..., :1]
    return (q * d).reshape(t, k)


@triton.jit
def _gemv_kernel(
    w_ptr,
    row_bytes,
    x_ptr,
    y_ptr,
    r_ptr,  # [T, N] residual added to the output (HAS_RES)
    lut_ptr,  # float32 [16]: the code values of the lookup-table types (MXFP4, IQ4_XS)
    N,
    K,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    HAS_RES: tl.constexpr,
    ASM: tl.constexpr = True,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
    PREFETCH: tl.constexpr = False,  # the program's rows into L2 before the wait (PDL)
):
    """y[t, n] = W[n, :] . x[t, :] (+ r[t, n]) for a dense weight."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    if PREFETCH:
        n0 = pid_n * BLOCK_N
        prefetch_l2(w_ptr + n0.to(tl.int64) * row_bytes, tl.minimum(BLOCK_N, N - n0) * row_bytes, PDL)
    pdl_enter(PDL)
    offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs < N
    w_rows = (w_ptr + offs.to(tl.int64) * row_bytes)[:, None, None]
    x_rows = (x_ptr + t * K + tl.zeros([1], dtype=tl.int32))[:, None, None]  # one activation row for all
    acc = _row_dot(w_rows, x_rows, K, nmask, lut_ptr, QTYPE, BLOCK_N, SB, ASM)
    if HAS_RES:
        acc += tl.load(r_ptr + t * N + offs, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * N + offs, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _glu(gate, up, FUSE_GLU: tl.constexpr):
    """act(gate) * up: 1 SiLU, 2 GELU (tanh form)."""
    if FUSE_GLU == 1:
        return gate / (1.0 + tl.exp(-gate)) * up
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0)) * up


@triton.jit
def _moe_gemv_kernel(
    table_ptr,  # int64 [E]: address of each expert's first row (VRAM slot or pinned host memory)
    table2_ptr,  # int64 [E]: the up projection's table when FUSE_GLU
    row_bytes,
    ids_ptr,  # int [S]: expert id of each (token, slot), S = T * k
    x_ptr,  # [T, K] (X_PER_SLOT == 0) or [S, K]
    y_ptr,  # [S, N] float32
    lut_ptr,
    N,
    K,
    TOPK,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,  # Q4_K super-blocks read per step (more loads in flight)
    X_PER_SLOT: tl.constexpr,
    FUSE_GLU: tl.constexpr,  # 0: plain, 1: silu(gate) * up, 2: gelu_tanh(gate) * up
    ASM: tl.constexpr = True,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s).to(tl.int64)
    if X_PER_SLOT:
        x_row = x_ptr + s * K
    else:
        x_row = x_ptr + (s // TOPK) * K
    x_rows = (x_row + tl.zeros([1], dtype=tl.int32))[:, None, None]
    w_base = tl.load(table_ptr + e).to(tl.pointer_type(tl.uint8))
    if FUSE_GLU == 0:
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs < N
        acc = _row_dot((w_base + offs.to(tl.int64) * row_bytes)[:, None, None], x_rows, K, nmask, lut_ptr, QTYPE,
                       BLOCK_N, SB, ASM)  # fmt: skip
        tl.store(y_ptr + s * N + offs, acc.to(y_ptr.dtype.element_ty), mask=nmask)
    else:
        # The gate rows and the up rows of this block as one set of 2 * BLOCK_N rows: their loads go out together.
        u_base = tl.load(table2_ptr + e).to(tl.pointer_type(tl.uint8))
        r = tl.arange(0, 2 * BLOCK_N)
        offs2 = pid_n * BLOCK_N + r % BLOCK_N
        base = tl.where(r < BLOCK_N, w_base, u_base)
        both = _row_dot((base + offs2.to(tl.int64) * row_bytes)[:, None, None], x_rows, K, offs2 < N, lut_ptr, QTYPE,
                        2 * BLOCK_N, SB, ASM)  # fmt: skip
        gate, up = tl.split(tl.permute(tl.reshape(both, [2, BLOCK_N]), [1, 0]))  # [BLOCK_N] each
        acc = _glu(gate, up, FUSE_GLU)
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + s * N + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def _moe_gemv_combine_kernel(
    table_ptr,  # int64 [E]: address of each expert's first row
    row_bytes,
    ids_ptr,  # int [T * TOPK]
    w_ptr,  # float32 [T * TOPK] routing weights
    x_ptr,  # [T * TOPK, K]: each slot's activation
    r_ptr,  # [T, N] float32 residual
    y_ptr,  # [T, N] float32
    lut_ptr,
    N,
    K,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,  # TOPK rounded up to a power of two
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    ASM: tl.constexpr = True,
    NEXT_NORM: tl.constexpr = False,  # the next layer's attention norm, 8-bit form, by the last program of a row
    done_ptr=None,  # int32 [>= T] zeros: programs of row t done (NEXT_NORM)
    nw_ptr=None,  # [N] the next layer's norm weight (NEXT_NORM)
    q_ptr=None,  # [T, N] float32 for quantize_q8's layout (NEXT_NORM)
    eps=0.0,
    BLOCK_D: tl.constexpr = 1,  # N rounded up to a power of two (NEXT_NORM)
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    """y[t] = r[t] + sum over the token's slots s of w[s] * (W_ids[s] . x[s]): the down projection of every
    selected expert, the weighted combine and the residual add in one launch. The rows of all the slots form one
    set (their loads go out together) and are summed in a fixed order, so the result does not vary run to run.
    With NEXT_NORM the last program of a row to finish (an atomic count) also writes rms_norm(y[t]) * nw rounded
    to 8 bits, the next layer's q/k/v input, in place of that layer's own norm launch."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    r = tl.arange(0, SLOTS * BLOCK_N)
    j = r // BLOCK_N
    jc = tl.minimum(j, TOPK - 1)  # padding slots read a real slot's address; their rows are masked off
    offs = pid_n * BLOCK_N + r % BLOCK_N
    rmask = (offs < N) & (j < TOPK)
    s = t * TOPK + jc
    e = tl.load(ids_ptr + s).to(tl.int64)
    base = tl.load(table_ptr + e).to(tl.pointer_type(tl.uint8))  # [SLOTS * BLOCK_N]
    x_rows = (x_ptr + s.to(tl.int64) * K)[:, None, None]
    part = _row_dot((base + offs.to(tl.int64) * row_bytes)[:, None, None], x_rows, K, rmask, lut_ptr, QTYPE,
                    SLOTS * BLOCK_N, SB, ASM)  # fmt: skip
    wt = tl.where(j < TOPK, tl.load(w_ptr + s), 0.0)
    acc = tl.sum(tl.reshape(part * wt, [SLOTS, BLOCK_N]), axis=0)  # [BLOCK_N]
    offs1 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m1 = offs1 < N
    acc += tl.load(r_ptr + t * N + offs1, mask=m1, other=0.0)
    tl.store(y_ptr + t * N + offs1, acc, mask=m1)
    if NEXT_NORM:
        if last_to_finish(done_ptr + t):
            od = tl.arange(0, BLOCK_D)
            md = od < N
            h = tl.load(y_ptr + t * N + od, mask=md, other=0.0, volatile=True)  # other programs' rows: not L1
            yv = h * tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
            yv = yv * tl.load(nw_ptr + od, mask=md, other=0.0).to(tl.float32)
            store_q8(tl.where(md, yv, 0.0), q_ptr + t * N, N, BLOCK_D)
            tl.store(done_ptr + t, 0)


@triton.jit
def _gemv_rows_kernel(
    w_ptr,
    row_bytes,
    x_ptr,
    y_ptr,
    r_ptr,
    lut_ptr,
    N,
    K,
    T,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,  # activation rows a program takes
    SB: tl.constexpr,
    HAS_RES: tl.constexpr,
    ASM: tl.constexpr = True,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    """_gemv_kernel for several activation rows (the decode rows of several slots): a program takes BLOCK_N
    weight rows times G activation rows as one set of BLOCK_N * G dot products, so each weight block is fetched
    from memory once for the G rows (the copies of its address in the set are served by the same load)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    r = tl.arange(0, BLOCK_N * G)
    offs = pid_n * BLOCK_N + r // G
    t = tl.program_id(1) * G + r % G
    m = (offs < N) & (t < T)
    tc = tl.minimum(t, T - 1)  # rows past T read a real row; their results are not stored
    w_rows = (w_ptr + offs.to(tl.int64) * row_bytes)[:, None, None]
    x_rows = (x_ptr + tc.to(tl.int64) * K)[:, None, None]
    acc = _row_dot(w_rows, x_rows, K, m, lut_ptr, QTYPE, BLOCK_N * G, SB, ASM)
    out = tc.to(tl.int64) * N + offs
    if HAS_RES:
        acc += tl.load(r_ptr + out, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _moe_gemv_grouped_kernel(
    table_ptr,
    table2_ptr,
    row_bytes,
    ids_ptr,  # int [S]: expert id of each (token, slot)
    x_ptr,  # [T, K] (X_PER_SLOT == 0) or [S, K]
    y_ptr,  # [S, N] float32
    lut_ptr,
    N,
    K,
    TOPK,
    S,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    G: tl.constexpr,  # (token, slot) pairs of one expert a program takes
    SP: tl.constexpr,  # S rounded up to a power of two
    X_PER_SLOT: tl.constexpr,
    FUSE_GLU: tl.constexpr,
    ASM: tl.constexpr = True,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    """_moe_gemv_kernel for a step of several token rows, the pairs that chose one expert taken together: the
    program of pair s works only where s is the first, the (G+1)-th, ... pair of its expert in the step, and then
    computes that pair and the next G - 1 of the same expert as one set of rows, so the expert's blocks are
    fetched once for them. Found from the ids alone (no sort, no host): graph-safe, and the same every run."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    e = tl.load(ids_ptr + s)
    pos = tl.arange(0, SP)
    same = tl.load(ids_ptr + pos, mask=pos < S, other=-1) == e
    rank = tl.cumsum(same.to(tl.int32), axis=0) - 1  # each pair's place among its expert's pairs
    mine = tl.sum(tl.where(pos == s, rank, 0), axis=0)
    if mine % G == 0:
        gi = tl.arange(0, G)
        sel = same[None, :] & (rank[None, :] == mine + gi[:, None])  # [G, SP]: the pair of each place
        pair = tl.sum(tl.where(sel, pos[None, :], 0), axis=1)
        valid = tl.sum(sel.to(tl.int32), axis=1) > 0
        nloc = tl.arange(0, BLOCK_N)
        offs = tl.reshape(tl.broadcast_to((pid_n * BLOCK_N + nloc)[:, None], [BLOCK_N, G]), [BLOCK_N * G])
        prs = tl.reshape(tl.broadcast_to(pair[None, :], [BLOCK_N, G]), [BLOCK_N * G])
        ok = tl.reshape(tl.broadcast_to(valid[None, :], [BLOCK_N, G]), [BLOCK_N * G]) & (offs < N)
        if X_PER_SLOT:
            xr = prs
        else:
            xr = prs // TOPK
        x_rows = (x_ptr + xr.to(tl.int64) * K)[:, None, None]
        w_base = tl.load(table_ptr + e.to(tl.int64)).to(tl.pointer_type(tl.uint8))
        if FUSE_GLU == 0:
            acc = _row_dot((w_base + offs.to(tl.int64) * row_bytes)[:, None, None], x_rows, K, ok, lut_ptr, QTYPE,
                           BLOCK_N * G, SB, ASM)  # fmt: skip
        else:
            u_base = tl.load(table2_ptr + e.to(tl.int64)).to(tl.pointer_type(tl.uint8))
            r = tl.arange(0, 2 * BLOCK_N * G)
            half = r // (BLOCK_N * G)
            offs2 = tl.reshape(tl.broadcast_to(offs[None, :], [2, BLOCK_N * G]), [2 * BLOCK_N * G])
            ok2 = tl.reshape(tl.broadcast_to(ok[None, :], [2, BLOCK_N * G]), [2 * BLOCK_N * G])
            x2 = tl.reshape(tl.broadcast_to(xr[None, :], [2, BLOCK_N * G]), [2 * BLOCK_N * G])
            base = tl.where(half == 0, w_base, u_base)
            both = _row_dot((base + offs2.to(tl.int64) * row_bytes)[:, None, None],
                            (x_ptr + x2.to(tl.int64) * K)[:, None, None], K, ok2, lut_ptr, QTYPE, 2 * BLOCK_N * G, SB,
                            ASM)  # fmt: skip
            gate, up = tl.split(tl.permute(tl.reshape(both, [2, BLOCK_N * G]), [1, 0]))
            acc = _glu(gate, up, FUSE_GLU)
        tl.store(y_ptr + prs.to(tl.int64) * N + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_kernel(
    yp_ptr,  # [T * TOPK, N] float32: each slot's down projection
    w_ptr,  # [T * TOPK] routing weights
    r_ptr,  # [T, N] float32 residual
    y_ptr,  # [T, N] float32
    N,
    TOPK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NEXT_NORM: tl.constexpr = False,
    nw_ptr=None,
    q_ptr=None,
    eps=0.0,
    PDL: tl.constexpr = False,  # launched early (engine/kernels/launch.py)
):
    """y[t] = r[t] + sum over the token's slots j (in order) of w[j] * yp[j]; with NEXT_NORM also the next
    layer's attention norm rounded to 8 bits (as _moe_gemv_combine_kernel's), the whole row being this
    program's."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    od = tl.arange(0, BLOCK_D)
    md = od < N
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        wj = tl.load(w_ptr + t * TOPK + j)
        acc += wj * tl.load(yp_ptr + (t * TOPK + j).to(tl.int64) * N + od, mask=md, other=0.0)
    acc += tl.load(r_ptr + t * N + od, mask=md, other=0.0)
    tl.store(y_ptr + t * N + od, acc, mask=md)
    if NEXT_NORM:
        yv = acc * tl.rsqrt(tl.sum(acc * acc, axis=0) / N + eps)
        yv = yv * tl.load(nw_ptr + od, mask=md, other=0.0).to(tl.float32)
        store_q8(tl.where(md, yv, 0.0), q_ptr + t * N, N, BLOCK_D)


_BLOCK_N = 16


def _config(qtype: QT, n: int, k: int, kind: str = "dense") -> tuple[int, int, int, int]:
    """(rows a program, super-blocks a step, warps, kernel variant) for a launch, per block type and class
    ("small" and "large" dense weights, "moe" for the experts' gate/up, "moe_down" for their down projection with
    the combine). The variant is one of the kernel bodies that compute this block type (see _row_dot)."""
    cls = kind if kind != "dense" else "small" if n <= 8192 else "large"
    tuned = _tuned().get(qtype.name, {})
    int8 = int8_activations()
    got = (tuned.get(cls + ":q8") if int8 else None) or tuned.get(cls)
    got = got or tuned.get("small" if n <= 8192 else "large") or [_BLOCK_N, 1, 4]
    allowed = set(_VARIANTS.get(qtype, ()))
    if not int8:
        allowed -= APPROXIMATE
    variant = got[3] if len(got) > 3 and got[3] in allowed else KERNEL_TYPES[qtype][0]
    return got[0], got[1], got[2], variant


_GLU = {"silu": 1, "gelu_tanh": 2}
# Token rows of a batched launch (several slots' decode rows), as the tuning file's "<class>:q8:r<bucket>" keys.
ROW_BUCKETS = (2, 4, 8, 16)
# Untuned batched launches: [rows a program, super-blocks a step, warps, variant (the per-row one), G]
_ROWS_DEFAULT = {"dense": (2, 4, 4, 2), "moe": (2, 4, 2, 2), "moe_down": (2, 4, 2, 2)}


def row_bucket(rows: int) -> int:
    return next((b for b in ROW_BUCKETS if rows <= b), ROW_BUCKETS[-1])


def mma_config(qtype: QT, n: int, k: int, rows: int) -> tuple[int, int, int] | None:
    """(columns a program, programs along K, warps) of engine.kernels.rows_mma for a batched dense launch, where
    the tuning file has a "<class>:q8:mma:r<bucket>" entry (bench/gemv_graph_micro.py --tokens writes one where it
    beat the GEMV bodies); None: the GEMV bodies."""
    if not mma_takes(qtype, k, rows):
        return None
    cls = "small" if n <= 8192 else "large"
    got = _tuned().get(qtype.name, {}).get(f"{cls}:q8:mma:r{row_bucket(rows)}")
    return (got[0], got[1], got[2]) if got and len(got) == 3 else None


def rows_config(qtype: QT, n: int, k: int, kind: str, rows: int) -> tuple[int, int, int, int, int] | None:
    """(rows a program, super-blocks a step, warps, variant, G) of the batched launch for `rows` token rows, or
    None where each row gets its own programs: one row, a float body (those give each row of a batch exactly the
    sums it gets alone), or STRATA_BATCHED_GEMV=0. G: activation rows (dense) or pairs of one expert (moe) a
    program takes."""
    if rows < 2 or not runtime_switches().batched_gemv:
        return None
    variant = _config(qtype, n, k, kind)[3]
    if variant not in APPROXIMATE:
        return None
    cls = kind if kind != "dense" else "small" if n <= 8192 else "large"
    got = _tuned().get(qtype.name, {}).get(f"{cls}:q8:r{row_bucket(rows)}")
    if got and len(got) == 5 and got[3] in APPROXIMATE:
        return got[0], got[1], got[2], got[3], got[4]
    dbn, dsb, dwarps, g = _ROWS_DEFAULT[kind]
    return dbn, dsb, dwarps, variant, g


def _activations(x: torch.Tensor, variant: int, q8: bool) -> torch.Tensor:
    """x as the body reads it: rounded to 8 bits for the APPROXIMATE bodies (unless `q8` says it already is)."""
    if q8 and variant not in APPROXIMATE:  # a float body would read the packed bytes as activations
        raise ValueError(f"8-bit activations given to GEMV body {variant}, which reads floats (see wants_q8)")
    return quantize_q8(x) if variant in APPROXIMATE and not q8 else x


def wants_q8(qtype: QT, n: int, k: int, kind: str = "dense") -> bool:
    """Whether the launch picked for this weight reads 8-bit activations (quantize_q8's layout): with
    `--activations int8` (int8_activations) where the tuning file names an 8-bit body for the class."""
    return qtype in KERNEL_TYPES and _config(qtype, n, k, kind)[3] in APPROXIMATE


def supports(qtype: QT, k: int) -> bool:
    if qtype not in KERNEL_TYPES:
        return False
    elems = KERNEL_TYPES[qtype][1]
    return k % elems == 0


def gemv(
    raw: torch.Tensor,
    qtype: QT,
    n: int,
    k: int,
    x: torch.Tensor,
    block_n: int | None = None,
    num_warps: int | None = None,
    variant: int | None = None,
    sb: int | None = None,
    out_dtype: torch.dtype = torch.float32,
    residual: torch.Tensor | None = None,
    q8: bool = False,
) -> torch.Tensor:
    """raw uint8 [n, row_bytes] on CUDA, x [T, k] -> [T, n] in out_dtype (accumulated in float32), plus
    `residual` [T, n] where given (the residual add of the stream folded into the projection). `q8`: x is
    already quantize_q8's output (for the 8-bit bodies)."""
    x = x.contiguous()
    t = x.shape[0]
    y = torch.empty(t, n, dtype=out_dtype, device=x.device)
    rc = rows_config(qtype, n, k, "dense", t) if variant is None else None
    if rc is not None:
        bn, step, warps, qid, g = rc
        x = _activations(x, qid, q8)
        mma = mma_config(qtype, n, k, t)
        if mma is not None:  # int8 tensor cores, where the tuning file found them faster
            return rows_mma(raw, qtype, n, k, x, out_dtype, residual, *mma)
        res = residual.contiguous() if residual is not None else y
        _gemv_rows_kernel[(triton.cdiv(n, bn), triton.cdiv(t, g))](
            raw, raw.shape[-1], x, y, res, lut(qtype, x.device), n, k, t,
            QTYPE=qid, BLOCK_N=bn, G=g, SB=step, HAS_RES=residual is not None, ASM=not _INTERPRETED, num_warps=warps,
            **pdl_args(x.device),
        )  # fmt: skip
        return y
    bn, step, warps, tuned_variant = _config(qtype, n, k)
    block_n, sb, num_warps = block_n or bn, sb or step, num_warps or warps
    grid = (triton.cdiv(n, block_n), t)
    qid = tuned_variant if variant is None else variant
    x = _activations(x, qid, q8)
    res = residual.contiguous() if residual is not None else y
    pa = pdl_args(x.device)
    _gemv_kernel[grid](
        raw, raw.shape[-1], x, y, res, lut(qtype, x.device), n, k,
        QTYPE=qid, BLOCK_N=block_n, SB=sb, HAS_RES=residual is not None, ASM=not _INTERPRETED, num_warps=num_warps,
        PREFETCH=bool(pa) and t == 1, **pa,
    )  # fmt: skip
    return y


def moe_gemv(
    table: torch.Tensor,
    qtype: QT,
    row_bytes: int,
    ids: torch.Tensor,
    x: torch.Tensor,
    n: int,
    k: int,
    topk: int,
    x_per_slot: bool = False,
    up_table: torch.Tensor | None = None,
    act: str | None = None,
    launch: tuple[int, int, int] | None = None,
    variant: int | None = None,
    q8: bool = False,
) -> torch.Tensor:
    """For each (token, slot) s with expert ids[s]: y[s] = W_e . x (or act(W_e . x) * U_e . x with `up_table`).
    ids [T, topk] (device), x [T, k] or [T * topk, k] -> float32 [T * topk, n]."""
    x = x.contiguous()
    flat = ids.reshape(-1).contiguous()
    s = flat.numel()
    y = torch.empty(s, n, dtype=torch.float32, device=x.device)
    glu = _GLU[act] if up_table is not None and act is not None else 0
    rc = (
        rows_config(qtype, n, k, "moe", ids.shape[0])
        if ids.dim() == 2 and launch is None and variant is None
        else None
    )
    if rc is not None:
        block_n, sb, warps, qid, g = rc
        x = _activations(x, qid, q8)
        _moe_gemv_grouped_kernel[(triton.cdiv(n, block_n), s)](
            table, up_table if up_table is not None else table, row_bytes, flat, x, y, lut(qtype, x.device), n, k,
            topk, s, QTYPE=qid, BLOCK_N=block_n, SB=sb, G=g, SP=triton.next_power_of_2(s), X_PER_SLOT=int(x_per_slot),
            FUSE_GLU=glu, ASM=not _INTERPRETED, num_warps=warps, **pdl_args(x.device),
        )  # fmt: skip
        return y
    block_n, sb, warps, tuned_variant = _config(qtype, n, k, "moe")
    if launch is not None:
        block_n, sb, warps = launch
    grid = (triton.cdiv(n, block_n), s)
    qid = tuned_variant if variant is None else variant
    x = _activations(x, qid, q8)
    _moe_gemv_kernel[grid](
        table,
        up_table if up_table is not None else table,
        row_bytes,
        flat,
        x,
        y,
        lut(qtype, x.device),
        n,
        k,
        topk,
        QTYPE=qid,
        BLOCK_N=block_n,
        SB=sb,
        X_PER_SLOT=int(x_per_slot),
        FUSE_GLU=glu,
        ASM=not _INTERPRETED,
        num_warps=warps,
        **pdl_args(x.device),
    )
    return y


def moe_down_combine(
    table: torch.Tensor,
    qtype: QT,
    row_bytes: int,
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    n: int,
    k: int,
    launch: tuple[int, int, int] | None = None,
    variant: int | None = None,
    q8: bool = False,
    next_norm: tuple[torch.Tensor, float, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """ids, weights [T, topk], x [T * topk, k] (each slot's activation), residual [T, n] float32 ->
    float32 [T, n] = residual + the routing-weighted sum of the selected experts' down projections.
    `next_norm` (weight [n], eps, out float32 [T, n], done int32 [>= T] zeros): also rms_norm(y) * weight rounded
    to 8 bits (quantize_q8's layout) into out, from the same launch."""
    t, topk = ids.shape
    y = torch.empty(t, n, dtype=torch.float32, device=x.device)
    rc = rows_config(qtype, n, k, "moe_down", t) if launch is None and variant is None else None
    if rc is not None:  # each pair's product, the experts' shared ones together; then the combine by token
        block_n, sb, warps, qid, g = rc
        x = _activations(x.contiguous(), qid, q8)
        flat = ids.reshape(-1).contiguous()
        s = flat.numel()
        part = torch.empty(s, n, dtype=torch.float32, device=x.device)
        _moe_gemv_grouped_kernel[(triton.cdiv(n, block_n), s)](
            table, table, row_bytes, flat, x, part, lut(qtype, x.device), n, k, topk, s,
            QTYPE=qid, BLOCK_N=block_n, SB=sb, G=g, SP=triton.next_power_of_2(s), X_PER_SLOT=1, FUSE_GLU=0,
            ASM=not _INTERPRETED, num_warps=warps, **pdl_args(x.device),
        )  # fmt: skip
        extra = {}
        if next_norm is not None:
            nw, eps, q_out, _ = next_norm  # the whole row is one program's: no count of finished programs
            extra = dict(NEXT_NORM=True, nw_ptr=nw, q_ptr=q_out, eps=eps)
        _combine_kernel[(t,)](
            part, weights.contiguous(), residual.contiguous(), y, n, TOPK=topk, BLOCK_D=triton.next_power_of_2(n),
            num_warps=4, **extra, **pdl_args(x.device),
        )  # fmt: skip
        return y
    block_n, sb, warps, tuned_variant = _config(qtype, n, k, "moe_down")
    if launch is not None:
        block_n, sb, warps = launch
    qid = tuned_variant if variant is None else variant
    x = x.contiguous()
    x = _activations(x, qid, q8)
    extra = {}
    if next_norm is not None:
        nw, eps, q_out, done = next_norm
        extra = dict(
            NEXT_NORM=True, done_ptr=done, nw_ptr=nw, q_ptr=q_out, eps=eps, BLOCK_D=triton.next_power_of_2(n)
        )
    _moe_gemv_combine_kernel[(triton.cdiv(n, block_n), t)](
        table, row_bytes, ids.contiguous(), weights.contiguous(), x, residual.contiguous(), y,
        lut(qtype, x.device), n, k, TOPK=topk, SLOTS=triton.next_power_of_2(topk), QTYPE=qid, BLOCK_N=block_n, SB=sb,
        ASM=not _INTERPRETED, num_warps=warps, **extra, **pdl_args(x.device),
    )  # fmt: skip
    return y
