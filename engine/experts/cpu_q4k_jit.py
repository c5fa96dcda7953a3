"""The Numba kernels of engine/experts/cpu_q4k.py, imported only where Numba is installed and the CPU has AVX2
(that module says why not otherwise). Compiled on first use and cached on disk; serve_step, which answers a decode
step's mailbox requests with these kernels or the block kernels, is compiled once per process (not cached)."""

import functools
import types as types_module

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.typed import List as TypedList

from engine.experts.cpu_q4k import (
    BLOCK_BYTES,
    Q6K_BYTES,
    QK,
    ROWS_PER_TASK,
    ST_AT,
    ST_BAD,
    ST_BAD_ROW,
    ST_CYCLES,
    ST_HELD,
    ST_PAIRS,
)
from engine.kernels.cpu_blocks_jit import F16 as BLOCKS_F16  # noqa: F401  (StepServer passes it to serve_step)
from engine.kernels.cpu_blocks_jit import _broadcast as broadcast  # an IR value in every lane
from engine.kernels.cpu_blocks_jit import mix as blocks_mix

PARALLEL_ROWS = 4  # as in engine/kernels/cpu_blocks_jit.py

i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
v32i8, v16i16, v8i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
u64 = np.uint64  # unsigned offsets: Numba adds no negative-index fix-up, so the loads stay plain


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _load32(builder, base, off):
    p = builder.bitcast(builder.gep(base, [off]), v32i8.as_pointer())
    return builder.load(p, align=1)


def _at(builder, base, off, ty):
    """A pointer to a ty at byte offset off (i64) of the i8* base."""
    return builder.bitcast(builder.gep(base, [off]), ty.as_pointer())


def _q4k_block(builder, wp, oo, xp, xoo, sp, soo):
    """One Q4_K block (bytes at oo of wp) . 256 int8 inputs (at xoo of xp; their int16 sums per 32 at soo of sp),
    left unreduced: (8 int32 lanes of sum(sc * code * x), 4 int32 lanes of sum(m * sums), d, dmin)."""
    f32, v2i32, v8i8, v8i16, v4i32 = (ir.FloatType(), ir.VectorType(i32, 2), ir.VectorType(i8, 8),
                                      ir.VectorType(i16, 8), ir.VectorType(i32, 4))  # fmt: skip
    maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
    maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
    maddwd128 = _fn(builder, "llvm.x86.sse2.pmadd.wd", v4i32, [v8i16, v8i16])

    def at(off: int):
        return builder.add(oo, ir.Constant(i64, off))

    # d and dmin: two halves (F16C converts them)
    dd = builder.fpext(builder.load(_at(builder, wp, oo, ir.VectorType(ir.HalfType(), 2)), align=1),
                       ir.VectorType(f32, 2))  # fmt: skip
    d, dmin = (builder.extract_element(dd, ir.Constant(i32, i)) for i in (0, 1))
    # the 12 bytes of 6-bit scales and minimums, unpacked four at a time
    u0, u1, u2 = (builder.load(_at(builder, wp, at(off), i32), align=1) for off in (4, 8, 12))
    k1, k2, k3 = (ir.Constant(i32, m) for m in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))

    def top2(u):  # bits 6-7 of each byte, moved to bits 4-5
        return builder.shl(builder.and_(builder.lshr(u, ir.Constant(i32, 6)), k3), ir.Constant(i32, 4))

    sc_hi = builder.or_(builder.and_(u2, k2), top2(u0))
    mn_hi = builder.or_(builder.and_(builder.lshr(u2, ir.Constant(i32, 4)), k2), top2(u1))

    def bytes8(lo, hi):
        v = builder.insert_element(ir.Constant(v2i32, ir.Undefined), lo, ir.Constant(i32, 0))
        return builder.bitcast(builder.insert_element(v, hi, ir.Constant(i32, 1)), v8i8)

    scales = bytes8(builder.and_(u0, k1), sc_hi)
    mins = builder.zext(bytes8(builder.and_(u1, k1), mn_hi), v8i16)
    sums = builder.load(_at(builder, builder.bitcast(sp, i8.as_pointer()), builder.mul(soo, ir.Constant(i64, 2)), v8i16), align=2)  # fmt: skip
    summ = builder.call(maddwd128, [mins, sums])
    sc16 = builder.zext(scales, v8i16)

    def splat16(j: int):  # scale j in all 16 lanes: one shuffle of the widened scales
        return builder.shuffle_vector(sc16, ir.Constant(v8i16, ir.Undefined), ir.Constant(ir.VectorType(i32, 16), [j] * 16))  # fmt: skip

    low4, shift4 = ir.Constant(v32i8, [15] * 32), ir.Constant(v32i8, [4] * 32)
    acc = ir.Constant(v8i32, None)
    for c in range(4):  # 32 bytes: sub-block 2c in the low nibbles, 2c+1 in the high ones
        q = _load32(builder, wp, at(16 + 32 * c))
        xl = _load32(builder, xp, builder.add(xoo, ir.Constant(i64, 64 * c)))
        xh = _load32(builder, xp, builder.add(xoo, ir.Constant(i64, 64 * c + 32)))
        pl = builder.call(maddubs, [builder.and_(q, low4), xl])  # 16 x (q*x + q*x), no saturation
        ph = builder.call(maddubs, [builder.lshr(q, shift4), xh])
        acc = builder.add(acc, builder.call(maddwd, [pl, splat16(2 * c)]))
        acc = builder.add(acc, builder.call(maddwd, [ph, splat16(2 * c + 1)]))
    return acc, summ, d, dmin


def _row_codegen(q6k: bool):
    """A row of blocks (its bytes at r0 of w) . the quantized input (xq int8, xd float32 a scale per 256, xs int16
    sums per 32 for Q4_K, per 16 for Q6_K): each block's integer lanes scaled into float lanes that are summed once,
    at the row's end (a horizontal sum a block cost as much as a block's products)."""
    block_bytes, sums = (Q6K_BYTES, 16) if q6k else (BLOCK_BYTES, 8)

    def codegen(context, builder, signature, args):
        r, n_blocks = args[1], args[2]
        wp, xp, dp, sp = (cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i]).data
                          for i in (0, 3, 4, 5))  # fmt: skip
        f32 = ir.FloatType()
        v8f32, v4f32 = ir.VectorType(f32, 8), ir.VectorType(f32, 4)

        accf = cgutils.alloca_once_value(builder, ir.Constant(v8f32, None))
        accm = cgutils.alloca_once_value(builder, ir.Constant(v4f32, None))
        with cgutils.for_range(builder, n_blocks) as loop:
            b = loop.index
            o = builder.add(r, builder.mul(b, ir.Constant(i64, block_bytes)))
            xo, so = builder.mul(b, ir.Constant(i64, QK)), builder.mul(b, ir.Constant(i64, sums))
            xdb = builder.load(builder.gep(dp, [b]))
            if q6k:
                lanes, d = _q6k_block(builder, wp, o, xp, xo, sp, so)
            else:
                lanes, summ, d, dmin = _q4k_block(builder, wp, o, xp, xo, sp, so)
                m = broadcast(builder, builder.fmul(dmin, xdb), v4f32)
                builder.store(
                    builder.fadd(builder.load(accm), builder.fmul(builder.sitofp(summ, v4f32), m)), accm
                )
            s = broadcast(builder, builder.fmul(d, xdb), v8f32)
            builder.store(
                builder.fadd(builder.load(accf), builder.fmul(builder.sitofp(lanes, v8f32), s)), accf
            )
        zero = ir.Constant(f32, 0.0)
        tot = builder.call(
            _fn(builder, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f32]), [zero, builder.load(accf)]
        )
        mn = builder.call(
            _fn(builder, "llvm.vector.reduce.fadd.v4f32", f32, [f32, v4f32]), [zero, builder.load(accm)]
        )
        return builder.fsub(tot, mn)

    return codegen


@intrinsic
def row_dot_q4k(typingctx, w, r0, n_blocks, xq, xd, xs):
    """One row of Q4_K blocks . the quantized input (_row_codegen)."""
    return types.float32(w, r0, n_blocks, xq, xd, xs), _row_codegen(False)


@intrinsic
def row_dot_q6k(typingctx, w, r0, n_blocks, xq, xd, xs16):
    """One row of Q6_K blocks . the quantized input (_row_codegen)."""
    return types.float32(w, r0, n_blocks, xq, xd, xs16), _row_codegen(True)


def _q6k_block(builder, wp, oo, xp, xoo, sp, soo):
    """One Q6_K block (210 bytes at oo of wp: 128 of low nibbles, 64 of high bit pairs, 16 int8 scales, half d) .
    256 int8 inputs (at xoo of xp; their int16 sums per 16 at soo of sp), left unreduced: (8 int32 lanes of
    sum(sc * (code - 32) * x), the 32 taken out through the inputs' sums, d)."""
    f32, v16i8 = ir.FloatType(), ir.VectorType(i8, 16)
    maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
    maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])

    def at(off: int):
        return builder.add(oo, ir.Constant(i64, off))

    def splat8(v: int):
        return ir.Constant(v32i8, [v] * 32)

    sc = builder.sext(
        builder.load(_at(builder, wp, at(192), v16i8), align=1), v16i16
    )  # a scale per 16 values
    d = builder.fpext(builder.load(_at(builder, wp, at(208), ir.HalfType()), align=1), f32)
    acc = ir.Constant(v8i32, None)
    for n in range(2):  # two halves of 128 values: 64 bytes of low nibbles, 32 of high bit pairs
        ql0, ql1 = _load32(builder, wp, at(64 * n)), _load32(builder, wp, at(64 * n + 32))
        qh = _load32(builder, wp, at(128 + 32 * n))
        his = [
            builder.shl(builder.and_(builder.lshr(qh, splat8(2 * k)), splat8(3)), splat8(4)) for k in range(4)
        ]
        codes = [builder.or_(builder.and_(ql0, splat8(15)), his[0]), builder.or_(builder.and_(ql1, splat8(15)), his[1]),
                 builder.or_(builder.lshr(ql0, splat8(4)), his[2]), builder.or_(builder.lshr(ql1, splat8(4)), his[3])]  # fmt: skip
        for k, q in enumerate(codes):  # values 128n + 32k .. +32, scales 8n + 2k and 8n + 2k + 1
            xv = _load32(builder, xp, builder.add(xoo, ir.Constant(i64, 128 * n + 32 * k)))
            j = 8 * n + 2 * k
            s2 = builder.shuffle_vector(sc, ir.Constant(v16i16, ir.Undefined),
                                        ir.Constant(ir.VectorType(i32, 16), [j] * 8 + [j + 1] * 8))  # fmt: skip
            acc = builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [q, xv]), s2]))
    sums = builder.load(_at(builder, builder.bitcast(sp, i8.as_pointer()), builder.mul(soo, ir.Constant(i64, 2)), v16i16), align=2)  # fmt: skip
    corr = builder.call(maddwd, [sc, sums])  # sc * (the inputs' sum per 16), in pairs
    return builder.sub(acc, builder.mul(corr, ir.Constant(v8i32, [32] * 8))), d


@nb.njit(fastmath=True, cache=True)
def quantize(x, xq, xd, xs, xs16):
    """x float32 [K] -> xq int8 [K] (per 256: round(x / d), d = max|x| / 127), xd [K/256] the d's, xs int16
    [K/32] and xs16 [K/16] the sums of xq per 32 and per 16 (they carry Q4_K's minimums and Q6_K's offset of 32)."""
    for b in range(x.shape[0] // QK):
        amax = np.float32(0.0)
        for i in range(QK):
            amax = max(amax, abs(x[b * QK + i]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if amax > 0 else np.float32(0.0)
        xd[b] = d
        for g in range(16):
            t = 0
            for i in range(16):
                v = np.int32(np.rint(x[b * QK + g * 16 + i] * inv))
                xq[b * QK + g * 16 + i] = v
                t += v
            xs16[b * 16 + g] = t
        for g in range(8):
            xs[b * 8 + g] = xs16[b * 16 + 2 * g] + xs16[b * 16 + 2 * g + 1]


@nb.njit(inline="always", fastmath=True)
def row_dot(w, r0, n_blocks, xq, xd, xs, xs16, q6k):
    """One row (its bytes at r0 of w; Q6_K blocks where q6k, else Q4_K) . the quantized input."""
    if q6k:
        return row_dot_q6k(w, r0, n_blocks, xq, xd, xs16)
    return row_dot_q4k(w, r0, n_blocks, xq, xd, xs)


@nb.njit(inline="always")
def _q8_rows(rows, k):
    """Room for `rows` rows of k values quantized as `quantize` writes them: codes, scales, sums per 32 and per 16."""
    return (
        np.empty((rows, k), np.int8),
        np.empty((rows, k // QK), np.float32),
        np.empty((rows, k // 32), np.int16),
        np.empty((rows, k // 16), np.int16),
    )


# group_pairs and box_pairs as in engine/kernels/cpu_blocks_jit.py, repeated here: Numba's disk cache keeps a
# function with the code of every jitted function it calls, but knows only its own file's changes.
@nb.njit(nogil=True, cache=True)
def group_pairs(ids, tok, ws, n_exp, n_tok):
    """(expert, token) pairs ids, tok int64 [n], ws float32 [n] -> (ids, tok, ws, starts, 0): the pairs in a stable
    order by expert (a counting sort), group g being starts[g] .. starts[g + 1]; or (.., 1) for an expert id
    outside 0..n_exp-1, (.., 2) for a token row outside 0..n_tok-1 (the caller says which)."""
    n = ids.shape[0]
    cnt = np.zeros(n_exp + 1, np.int64)
    for j in range(n):
        if ids[j] < 0 or ids[j] >= n_exp:
            return ids, tok, ws, cnt[:0], 1
        if tok[j] < 0 or tok[j] >= n_tok:
            return ids, tok, ws, cnt[:0], 2
        cnt[ids[j] + 1] += 1
    groups = 0
    for e in range(n_exp):
        groups += cnt[e + 1] > 0
        cnt[e + 1] += cnt[e]
    gi, gt, gw = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.float32)
    starts = np.empty(groups + 1, np.int64)
    g = 0
    for e in range(n_exp):
        if cnt[e + 1] > cnt[e]:
            starts[g] = cnt[e]
            g += 1
    starts[groups] = n
    for j in range(n):
        at = cnt[ids[j]]
        cnt[ids[j]] += 1
        gi[at], gt[at], gw[at] = ids[j], tok[j], ws[j]
    return gi, gt, gw, starts, 0


@nb.njit(nogil=True, cache=True)
def box_pairs(box, boxf, at_ids, at_take, at_w, n, k):
    """The pairs a decode step's mailbox row hands the CPU (engine/kernels/cpu_handoff.py): of its n (row, slot)
    pairs those whose flag at at_take is set -> (expert ids int64, token rows int64, weights float32), read from
    the int32 row box (ids at at_ids) and its float32 view boxf (weights at at_w)."""
    m = 0
    for p in range(n):
        m += box[at_take + p] != 0
    ids, tok, ws = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.float32)
    j = 0
    for p in range(n):
        if box[at_take + p] != 0:
            ids[j], tok[j], ws[j] = box[at_ids + p], p // k, boxf[at_w + p]
            j += 1
    return ids, tok, ws


@nb.njit(parallel=True, fastmath=True, nogil=True, cache=True)
def mix(gate, up, down, down_q6k, f, d, box, boxf, at_ids, at_take, at_w, n_box, k, ids, tok, ws, x, out):
    """out[t] = sum over the pairs j of token t of ws[j] * down_j(silu(gate_j x[t]) * up_j x[t]), for the (expert,
    token) pairs j: ids[j] the expert, tok[j] the token, in any order (grouped here by expert: each weight row is
    read once for all of an expert's pairs), or, where n_box >= 0, the pairs a mailbox row hands over (box_pairs:
    one call answers a decode step's request). gate, up: the flat Q4_K bytes of [E, f, d]; down: the Q4_K (or,
    with down_q6k, Q6_K) bytes of [E, d, f]; x float32 [T, d]; out float32 [T, d] (written, zeros where a token
    has no pair). -> 0, or group_pairs' error code (nothing written).

    The grouping lives in this one parallel function, not in a caller: a cached function that calls a parallel
    one crashed when it was loaded from Numba's cache (numba 0.68, where the callee had been loaded from the cache
    when the caller was compiled)."""
    if n_box >= 0:
        ids, tok, ws = box_pairs(box, boxf, at_ids, at_take, at_w, n_box, k)
    rb1 = u64(d // QK * BLOCK_BYTES)
    ids, tok, ws, starts, bad = group_pairs(ids, tok, ws, gate.shape[0] // (f * int(rb1)), x.shape[0])
    if bad:
        return bad
    nt, n_tok, n_grp = ids.shape[0], x.shape[0], starts.shape[0] - 1
    rb2 = u64(f // QK * (Q6K_BYTES if down_q6k else BLOCK_BYTES))
    xq, xd, xs, xs16 = _q8_rows(n_tok, d)
    if n_tok >= PARALLEL_ROWS:  # a batched step's rows side by side (~3 us a row of 2048 values)
        for t in nb.prange(n_tok):
            quantize(x[t], xq[t], xd[t], xs[t], xs16[t])
    else:
        for t in range(n_tok):
            quantize(x[t], xq[t], xd[t], xs[t], xs16[t])
    h = np.empty((nt, f), np.float32)
    tasks = (f + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for t in nb.prange(n_grp * tasks):
        g = t // tasks
        n0 = (t - g * tasks) * ROWS_PER_TASK
        e = u64(ids[starts[g]])
        for n in range(n0, min(f, n0 + ROWS_PER_TASK)):
            r = (e * u64(f) + u64(n)) * rb1
            for j in range(starts[g], starts[g + 1]):
                i = tok[j]
                a = row_dot(gate, r, d // QK, xq[i], xd[i], xs[i], xs16[i], False)
                b = row_dot(up, r, d // QK, xq[i], xd[i], xs[i], xs16[i], False)
                h[j, n] = a / (np.float32(1.0) + np.exp(-a)) * b
    hq, hd, hs, hs16 = _q8_rows(nt, f)
    if nt >= 2 * PARALLEL_ROWS:
        for j in nb.prange(nt):
            quantize(h[j], hq[j], hd[j], hs[j], hs16[j])
    else:
        for j in range(nt):
            quantize(h[j], hq[j], hd[j], hs[j], hs16[j])
    for t in nb.prange((d + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        n0, n1 = t * ROWS_PER_TASK, min(d, t * ROWS_PER_TASK + ROWS_PER_TASK)
        for n in range(n0, n1):
            for i in range(n_tok):
                out[i, n] = np.float32(0.0)
        # an expert's rows of the task in turn: one stream of its blocks at a time (dozens of experts' rows taken
        # row by row outran the prefetchers); each output still adds its pairs in j's order
        for g in range(n_grp):
            e = u64(ids[starts[g]])
            for n in range(n0, n1):
                r = (e * u64(d) + u64(n)) * rb2
                for j in range(starts[g], starts[g + 1]):
                    out[tok[j], n] += ws[j] * row_dot(
                        down, r, f // QK, hq[j], hd[j], hs[j], hs16[j], down_q6k
                    )
    return 0


# ---------------------------------------------------------------------------------------------------------------
# A decode step's mailbox requests answered in one call that holds no GIL (engine/experts/cpu_misses.py)


def _item_ptr(context, builder, aryty, ary, idx):
    a = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, a, [idx])


@intrinsic
def load_acquire(typingctx, arr, idx):
    """arr[idx] (int32) read with acquire order: neither hoisted out of a polling loop nor passed by a later read
    (the device writes the mailbox while the host polls it)."""
    sig = types.int32(arr, idx)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(
            _item_ptr(context, builder, signature.args[0], args[0], args[1]), "acquire", 4
        )

    return sig, codegen


@intrinsic
def store_release(typingctx, arr, idx, val):
    """arr[idx] = val (an integer array) with release order: every write before it is seen first (the sums before
    the answer, a kernel's output before its lock is let go)."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        dt = signature.args[0].dtype
        v = context.cast(builder, args[2], signature.args[2], dt)
        ptr = _item_ptr(context, builder, signature.args[0], args[0], args[1])
        builder.store_atomic(v, ptr, "release", dt.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def try_lock(typingctx, arr, idx):
    """Take the lock arr[idx] (int64: 0 free, 1 taken) if it is free, with acquire order -> whether it was taken."""
    sig = types.boolean(arr, idx)

    def codegen(context, builder, signature, args):
        ptr = _item_ptr(context, builder, signature.args[0], args[0], args[1])
        res = builder.cmpxchg(ptr, ir.Constant(i64, 0), ir.Constant(i64, 1), "acquire", "monotonic")
        return builder.extract_value(res, 1)

    return sig, codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (for the time spent in the kernels; cpu_misses converts it)."""

    def codegen(context, builder, signature, args):
        return builder.call(_fn(builder, "llvm.readcyclecounter", i64, []), [])

    return types.int64(), codegen


@intrinsic
def spin_pause(typingctx):
    """x86's pause: a polling loop's hint to the core (and its other hardware thread)."""

    def codegen(context, builder, signature, args):
        builder.call(_fn(builder, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.void(), codegen


def _serve_step(
    box,
    done,
    posts,
    first,
    spin_cycles,
    lay,
    q4k,
    gates,
    ups,
    downs,
    q6k,
    kinds,
    row_bytes,
    f,
    d,
    f16,
    state,
    lock,
):
    """Answer mailbox rows posts[first:] in order, each once the device has raised its request number: its taken
    pairs (read from the row) computed by the row's layer's kernels into the row's sums, then its answer number,
    last. box: the mailboxes, int32 [rows, words] (pinned: the device reads and writes them); done int32 [rows]: the
    last request number answered per row; lay int64: (pairs a row holds, first word of the inputs, the answer, the
    sums, slots a row k, most rows a step, request, taken count, rows, ids); per mailbox row: q4k (the Q4_K kernels,
    else the block kernels), the expert blocks gates/ups/downs (typed lists of flat uint8 arrays), q6k, kinds and
    row_bytes (the block kernels'). -> the index of the first post not answered: len(posts) once all are, less
    where the device has not raised a number within `spin_cycles` (the caller checks the time and calls again).
    A kernel that fails (an id out of range) answers with zeros and leaves its code in state. lock (int64 [1],
    shared by the process's servers): held while a request's kernels run, as the kernels' Python callers hold
    engine.kernels.cpu_blocks.LOCK, so that two stages' servers do not run two thread teams at once."""
    pm, x_at, ans_at, y_at, k, most = lay[0], lay[1], lay[2], lay[3], lay[4], lay[5]
    req_at, take_at, rows_at, ids_at = lay[6], lay[7], lay[8], lay[9]
    words = box.shape[1]
    flat = box.reshape(-1)
    boxf = box.view(np.float32)
    none_i, none_w = np.zeros(0, np.int64), np.zeros(0, np.float32)
    for i in range(first, posts.shape[0]):
        r = posts[i]
        c0 = cycles()
        while load_acquire(flat, r * words + req_at) == done[r]:
            if cycles() - c0 > spin_cycles:
                return i
            spin_pause()
        seq = box[r, req_at]
        t = min(max(box[r, rows_at], 1), most)
        state[ST_AT] = i
        # one request's kernels at a time in the process (another stage's server waits here)
        while not try_lock(lock, 0):
            spin_pause()
        state[ST_HELD] = 1
        c0 = cycles()
        row, rowf = box[r], boxf[r]
        x = rowf[x_at : x_at + t * d].reshape((t, d))
        y = rowf[y_at : y_at + t * d].reshape((t, d))
        if BLOCKS and not q4k[r]:  # a global constant: the branch is compiled only where a layer needs it
            bad = blocks_mix(gates[r], ups[r], downs[r], kinds[r], row_bytes[r, 0], row_bytes[r, 1], f, d, row,
                             rowf, ids_at, ids_at + pm, ids_at + 2 * pm, t * k, k, none_i, none_i, none_w, x, y,
                             f16)  # fmt: skip
        else:
            bad = mix(gates[r], ups[r], downs[r], q6k[r], f, d, row, rowf, ids_at, ids_at + pm, ids_at + 2 * pm,
                      t * k, k, none_i, none_i, none_w, x, y)  # fmt: skip
        if bad:
            y[:] = 0.0
            state[ST_BAD], state[ST_BAD_ROW] = bad, r
        state[ST_CYCLES] += cycles() - c0
        state[ST_HELD] = 0
        store_release(lock, 0, 0)
        state[ST_PAIRS] += box[r, take_at]
        store_release(flat, r * words + ans_at, seq)
        done[r] = seq
    return posts.shape[0]


BLOCKS = (
    True  # _serve_step's block-kernel branch (compiled only where a layer needs it: linking it takes seconds)
)


@functools.cache
def serve_step(blocks: bool):
    """_serve_step compiled once per process (not cached: it calls the parallel kernels, and a cached caller of
    them crashed when it was loaded, see mix), with the block kernels' branch only where `blocks`."""
    fn = types_module.FunctionType(_serve_step.__code__, {**globals(), "BLOCKS": blocks}, "serve_step")
    return nb.njit(nogil=True)(fn)


@nb.njit(cache=True)
def read_cycles():
    return cycles()


def one_at_a_time() -> bool:
    """Whether parallel kernels must not be called from two threads at once: Numba's own thread pool (no OpenMP or
    TBB found) aborts then. Asked after a parallel kernel has run (the layer is chosen at the first)."""
    try:
        return nb.threading_layer() == "workqueue"
    except ValueError:  # no parallel kernel has run yet: assume the worst
        return True


def typed_arrays(arrays):
    """A Numba typed list of these arrays (serve_step's per-row blocks)."""
    out = TypedList()
    for a in arrays:
        out.append(a)
    return out
