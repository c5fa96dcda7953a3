"""The Numba kernels of engine/experts/cpu_q4k.py, imported only where Numba is installed and the CPU has AVX2
(that module says why not otherwise). Compiled on first use and cached on disk."""

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.experts.cpu_q4k import BLOCK_BYTES, QK, ROWS_PER_TASK

i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
v32i8, v16i16, v8i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
u64 = np.uint64  # unsigned offsets: Numba adds no negative-index fix-up, so the loads stay plain


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _load32(builder, base, off):
    p = builder.bitcast(builder.gep(base, [off]), v32i8.as_pointer())
    return builder.load(p, align=1)


def _splat16(builder, v):
    v = builder.trunc(v, i16)
    vec = builder.insert_element(ir.Constant(v16i16, ir.Undefined), v, ir.Constant(i32, 0))
    return builder.shuffle_vector(vec, ir.Constant(v16i16, ir.Undefined), ir.Constant(ir.VectorType(i32, 16), [0] * 16))  # fmt: skip


@intrinsic
def block_dot(typingctx, w, o, xq, xo, sc):
    """sum over a block's 256 codes of sc[sub-block] * code * xq: w uint8 array with the 128 code bytes at o,
    xq int8 array with the block's 256 quantized inputs at xo, sc int32 [8] the sub-blocks' 6-bit scales."""
    sig = types.int32(w, o, xq, xo, sc)

    def codegen(context, builder, signature, args):
        oo, xoo = args[1], args[3]
        wp, xp, sp = (cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i]).data
                      for i in (0, 2, 4))  # fmt: skip
        maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
        maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
        low4, shift4 = ir.Constant(v32i8, [15] * 32), ir.Constant(v32i8, [4] * 32)
        acc = ir.Constant(v8i32, None)
        for c in range(4):  # 32 bytes: sub-block 2c in the low nibbles, 2c+1 in the high ones
            q = _load32(builder, wp, builder.add(oo, ir.Constant(i64, 32 * c)))
            xl = _load32(builder, xp, builder.add(xoo, ir.Constant(i64, 64 * c)))
            xh = _load32(builder, xp, builder.add(xoo, ir.Constant(i64, 64 * c + 32)))
            pl = builder.call(maddubs, [builder.and_(q, low4), xl])  # 16 x (q*x + q*x), no saturation
            ph = builder.call(maddubs, [builder.lshr(q, shift4), xh])
            s0 = builder.load(builder.gep(sp, [ir.Constant(i64, 2 * c)]))
            s1 = builder.load(builder.gep(sp, [ir.Constant(i64, 2 * c + 1)]))
            acc = builder.add(acc, builder.call(maddwd, [pl, _splat16(builder, s0)]))
            acc = builder.add(acc, builder.call(maddwd, [ph, _splat16(builder, s1)]))
        return builder.call(_fn(builder, "llvm.vector.reduce.add.v8i32", i32, [v8i32]), [acc])

    return sig, codegen


@nb.njit(fastmath=True, cache=True)
def quantize(x, xq, xd, xs):
    """x float32 [K] -> xq int8 [K] (per 256: round(x / d), d = max|x| / 127), xd [K/256] the d's, xs int32
    [K/32] the sums of xq per 32 (they carry the blocks' minimums)."""
    for b in range(x.shape[0] // QK):
        amax = np.float32(0.0)
        for i in range(QK):
            amax = max(amax, abs(x[b * QK + i]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if amax > 0 else np.float32(0.0)
        xd[b] = d
        for g in range(8):
            t = 0
            for i in range(32):
                v = np.int32(np.rint(x[b * QK + g * 32 + i] * inv))
                xq[b * QK + g * 32 + i] = v
                t += v
            xs[b * 8 + g] = t


@nb.njit(inline="always", fastmath=True)
def row_dot(w, r0, n_blocks, xq, xd, xs, f16, sc):
    """One Q4_K row (its bytes at r0 of w) . the quantized input."""
    acc = np.float32(0.0)
    for b in range(n_blocks):
        o = r0 + u64(b) * u64(BLOCK_BYTES)
        d = f16[np.int32(w[o]) | (np.int32(w[o + u64(1)]) << 8)]
        dmin = f16[np.int32(w[o + u64(2)]) | (np.int32(w[o + u64(3)]) << 8)]
        mins = 0
        for j in range(8):  # llama.cpp's get_scale_min_k4
            uj = u64(j)
            if j < 4:
                sc[j] = w[o + u64(4) + uj] & 63
                m = w[o + u64(8) + uj] & 63
            else:
                sc[j] = (w[o + u64(8) + uj] & 15) | ((w[o + uj] >> 6) << 4)
                m = (w[o + u64(8) + uj] >> 4) | ((w[o + u64(4) + uj] >> 6) << 4)
            mins += np.int32(m) * xs[b * 8 + j]
        sumi = block_dot(w, o + u64(16), xq, u64(b * QK), sc)
        acc += xd[b] * (d * np.float32(sumi) - dmin * np.float32(mins))
    return acc


@nb.njit(parallel=True, fastmath=True, nogil=True, cache=True)
def mix(gate, up, down, f, d, ids, ws, x, out, f16):
    """out[D] = sum_j ws[j] * down_j(silu(gate_j x) * up_j x) for the experts ids[j]: gate, up the flat
    Q4_K bytes of [E, f, d], down of [E, d, f]; x float32 [d]."""
    nt = ids.shape[0]
    rb1, rb2 = u64(d // QK * BLOCK_BYTES), u64(f // QK * BLOCK_BYTES)
    xq = np.empty(d, np.int8)
    xd = np.empty(d // QK, np.float32)
    xs = np.empty(d // 32, np.int32)
    quantize(x, xq, xd, xs)
    h = np.empty((nt, f), np.float32)
    tasks = (f + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for t in nb.prange(nt * tasks):
        j = t // tasks
        n0 = (t - j * tasks) * ROWS_PER_TASK
        e = u64(ids[j])
        sc = np.empty(8, np.int32)
        for n in range(n0, min(f, n0 + ROWS_PER_TASK)):
            r = (e * u64(f) + u64(n)) * rb1
            a = row_dot(gate, r, d // QK, xq, xd, xs, f16, sc)
            b = row_dot(up, r, d // QK, xq, xd, xs, f16, sc)
            h[j, n] = a / (np.float32(1.0) + np.exp(-a)) * b
    hq = np.empty((nt, f), np.int8)
    hd = np.empty((nt, f // QK), np.float32)
    hs = np.empty((nt, f // 32), np.int32)
    for j in range(nt):
        quantize(h[j], hq[j], hd[j], hs[j])
    for t in nb.prange((d + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        sc = np.empty(8, np.int32)
        for n in range(t * ROWS_PER_TASK, min(d, t * ROWS_PER_TASK + ROWS_PER_TASK)):
            s = np.float32(0.0)
            for j in range(nt):
                r = (u64(ids[j]) * u64(d) + u64(n)) * rb2
                s += ws[j] * row_dot(down, r, f // QK, hq[j], hd[j], hs[j], f16, sc)
            out[n] = s
