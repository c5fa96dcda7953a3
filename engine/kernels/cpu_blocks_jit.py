"""The Numba kernels of engine/kernels/cpu_blocks.py (imported only where Numba is installed; compiled on first use
and cached on disk).

Every block type is read the same way: a weight row's blocks are unpacked into int8 codes with a float scale and a
float offset per 16 values (value = scale * code + offset), in a scratch row that stays in L1, and that row is
multiplied with each activation row, rounded to int8 with a scale per 32 values (llama.cpp's q8_0 rounding). The
integer sums per 16 are what LLVM vectorizes; the scales are applied once per 16 values. One unpack function per
block type holds all that differs between the types (ggml's block layouts). The file ends with the attention of a
decode step's few rows (attend_rows, engine/kernels/cpu_attention.py)."""

import gguf.quants as gq
import numba as nb
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

ROWS_PER_TASK = 16  # weight rows per parallel task
# a batched step's rows are rounded to 8 bits in a parallel loop from this many on (fewer: on one thread, as a
# parallel region's start and end cost about what rounding 2-3 rows does)
PARALLEL_ROWS = 4
PREFETCH = 1024  # bytes ahead of the block being read

# codes of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl) and of MXFP4 (e2m1 values times 2)
IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _grid(cls) -> np.ndarray:
    """An IQ type's grid of magnitudes from the gguf package (its values are small whole numbers) as int8 rows."""
    cls.init_grid()
    g = cls.grid.reshape(-1, cls.grid.shape[-1])
    return g.astype(np.int8)


GRID_IQ2XXS = _grid(gq.IQ2_XXS)  # [256, 8]
GRID_IQ3XXS = _grid(gq.IQ3_XXS)  # [256, 4]
GRID_IQ2XS = _grid(gq.IQ2_XS)  # [512, 8]
GRID_IQ2S = _grid(gq.IQ2_S)  # [1024, 8]
GRID_IQ3S = _grid(gq.IQ3_S)  # [512, 4]
GRID_IQ1S = _grid(gq.IQ1_S)  # [2048, 8] of -1, 0, 1 (IQ1_M shares it)


def _signed_fours(grid: np.ndarray) -> np.ndarray:
    """Every four values of a grid row with every choice of their 4 signs: [rows * (width / 4) * 16, 4] int8, row
    16 * (width / 4 * index + quarter) + sign bits (bit i negates value i), so that unpacking 4 values is one
    lookup instead of 4 grid reads and sign tests."""
    signs = np.array([[-1 if (s >> i) & 1 else 1 for i in range(4)] for s in range(16)], np.int8)
    fours = grid.reshape(-1, 4)
    return (fours[:, None, :] * signs[None, :, :]).reshape(-1, 4).astype(np.int8)


SIGNED_IQ3S = _signed_fours(GRID_IQ3S)  # [512 * 16, 4]
SIGNED_IQ3XXS = _signed_fours(GRID_IQ3XXS)  # [256 * 16, 4]
SIGNED_IQ2XXS = _signed_fours(GRID_IQ2XXS)  # [256 * 2 * 16, 4]: each 8-value row as two fours
KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()  # 7-bit index -> 8 sign bits (even parity)
F16 = (
    np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
)  # every half's value
E8M0_HALF = np.array(
    [2.0 ** (e - 128) for e in range(256)], np.float32
)  # MXFP4's scale byte, halved (codes x2)

# block types by ggml id, as the kernels know them
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4_ID = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 39  # fmt: skip
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M = 16, 17, 18, 19, 21, 22, 29


i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
v32i8, v16i16, v8i32, v4i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8), ir.VectorType(i32, 4)  # fmt: skip


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _data(context, builder, ty, value):
    return cgutils.create_struct_proxy(ty)(context, builder, value=value).data


def _load(builder, base, off, ty=v32i8):
    return builder.load(builder.bitcast(builder.gep(base, [off]), ty.as_pointer()), align=1)


def _broadcast(b, value, ty):
    """A vector of type ty with every lane the IR value `value` (of ty's element type)."""
    one = ir.VectorType(ty.element, 1)
    vec = b.insert_element(ir.Constant(one, ir.Undefined), value, ir.Constant(i32, 0))
    return b.shuffle_vector(
        vec, ir.Constant(one, ir.Undefined), ir.Constant(ir.VectorType(i32, ty.count), [0] * ty.count)
    )


def _field(b, wp, p, shift, mask):
    """(32 bytes at p >> shift) & mask, per byte; shift an i64 (the same for all 32)."""
    return b.and_(b.lshr(_load(b, wp, p), _broadcast(b, b.trunc(shift, i8), v32i8)), _splat(v32i8, mask))


def _splat(ty, v):
    return ir.Constant(ty, [v] * ty.count)


def _target_features() -> dict[str, bool]:
    """The instruction sets Numba compiles for: the host's, or those NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name (a
    cache made for another CPU). Numba's cache keys its code by them, so code built here with an instruction the
    host has is not loaded on a CPU without it."""
    if nb.config.CPU_FEATURES:
        return {f[1:]: f[0] == "+" for f in str(nb.config.CPU_FEATURES).split(",") if f[:1] in "+-" and f[1:]}
    if nb.config.CPU_NAME and nb.config.CPU_NAME != "host":
        return {}  # a named CPU without features: the AVX2 code every supported CPU runs
    return dict(llvm.get_host_cpu_features())


_F = _target_features()
# vpdpbusd (AVX-VNNI, or AVX512-VNNI on 256-bit vectors): pmaddubsw and pmaddwd's work in one instruction
VNNI = bool(_F.get("avxvnni") or (_F.get("avx512vnni") and _F.get("avx512vl")))
# AVX512BW's mask registers on 256-bit vectors: 32 bits of a word spread to 32 bytes by one kmovd and a masked move
MASKS = bool(_F.get("avx512bw") and _F.get("avx512vl"))


def _lanes(builder, codes, x, signed, acc=None):
    """codes . x (both <32 x i8>) as 8 int32 lanes, each the sum of 4 neighbouring products. Unsigned codes go
    straight into pmaddubsw; signed ones as |codes| times x with the codes' signs (psignb). With VNNI one vpdpbusd
    does pmaddubsw's and pmaddwd's work: the same lanes (no code here makes pmaddubsw's 16-bit pair sums
    saturate: |code| <= 128 and |x| <= 127), one instruction a block fewer: Q5_0 products 5% faster on an AMD
    Zen 4. `acc` (<8 x i32>, unsigned codes only): lanes to add (vpdpbusd's own accumulator)."""
    if signed:
        sign = _fn(builder, "llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8])
        codes, x = builder.call(sign, [codes, codes]), builder.call(sign, [x, codes])
    if VNNI:
        dot = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", v8i32, [v8i32, v8i32, v8i32])
        start = _splat(v8i32, 0) if acc is None else acc
        return builder.call(dot, [start, builder.bitcast(codes, v8i32), builder.bitcast(x, v8i32)])
    maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
    maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
    lanes = builder.call(maddwd, [builder.call(maddubs, [codes, x]), _splat(v16i16, 1)])
    return lanes if acc is None else builder.add(lanes, acc)


def _pair_sums(builder, codes, x, signed):
    """codes . x as the sums of the first and the second 16 values, packed into an i64 (first low)."""
    lanes = _lanes(builder, codes, x, signed)
    reduce4 = _fn(builder, "llvm.vector.reduce.add.v4i32", i32, [v4i32])
    half = [builder.call(reduce4, [builder.shuffle_vector(lanes, lanes, ir.Constant(v4i32, list(range(h, h + 4))))])
            for h in (0, 4)]  # fmt: skip
    return builder.or_(
        builder.zext(half[0], i64), builder.shl(builder.zext(half[1], i64), ir.Constant(i64, 32))
    )


def _pshufb(builder, table, idx):
    """table[idx] for 32 indices 0-15 (the 16-entry table in both 128-bit halves)."""
    f = _fn(builder, "llvm.x86.avx2.pshuf.b", v32i8, [v32i8, v32i8])
    return builder.call(f, [ir.Constant(v32i8, [int(v) for v in table] * 2), idx])


def _nibbles16(builder, wp, p):
    """16 bytes at p -> <32 x i8>: the low nibbles (values 0-15 of a block), then the high ones (16-31)."""
    b = _load(builder, wp, p, ir.VectorType(i8, 16))
    lo = builder.and_(b, _splat(b.type, 15))
    hi = builder.lshr(b, _splat(b.type, 4))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 32), list(range(32))))


def _dot_intrinsic(make_codes, signed):
    """An intrinsic (w, p, x, xo) -> the products of a 32-value run of codes (made by make_codes(builder, w
    pointer, p)) with the int8 inputs x[xo:xo+32]: the sums of the first and the second 16 packed into an int64
    (first low)."""

    def typer(typingctx, w, p, x, xo):
        def codegen(context, builder, signature, args):
            wp = _data(context, builder, signature.args[0], args[0])
            xp = _data(context, builder, signature.args[2], args[2])
            return _pair_sums(builder, make_codes(builder, wp, args[1]), _load(builder, xp, args[3]), signed)

        return types.int64(w, p, x, xo), codegen

    return intrinsic(typer)


def _prefetch(b, wp, at):
    """Ask for the cache line at byte `at` of w (read soon, kept in every cache level)."""
    pf = _fn(b, "llvm.prefetch.p0", ir.VoidType(), [ir.PointerType(i8), i32, i32, i32])
    b.call(pf, [b.gep(wp, [at]), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _row32_loop(b, wp, xs, o, n, spec):
    """The IR of one row of 32-value blocks (bytes at o) . each quantized input row of xs (a list of (codes,
    scales per 32, sums per 16) pointers), in one loop that keeps the block products in float vectors (one
    horizontal sum per row and input, as ggml's vec_dot bodies do) -> a float per input. A block's codes and scale
    are made once for all the inputs: a step of several decode rows reads and unpacks each weight block once. spec:
    (block bytes, codes_at(builder, w pointer, block offset) -> its 32 codes, signed codes?, what the block holds
    besides: "d" a half scale (Q8_0, Q4_0, Q5_0, IQ4_NL), "e8m0" MXFP4's scale byte, "dm" d * code + m (Q4_1,
    Q5_1))."""
    block_bytes, codes_at, signed, kind = spec
    offset = None
    if len(xs[0]) > 3 and spec in OFFSET:  # unsigned codes, the offset's products from the inputs' quad sums
        codes_at, offset = OFFSET[spec]
        signed = False
    f32, v8f32, half = ir.FloatType(), ir.VectorType(ir.FloatType(), 8), ir.HalfType()
    # two sums an input (the next block's work need not wait for the last one's add), for every input alike: a row
    # gives the same sums, to the bit, alone and in a step of several
    accs = [[cgutils.alloca_once_value(b, ir.Constant(v8f32, None)) for _ in range(2)] for _ in xs]
    sides = [cgutils.alloca_once_value(b, ir.Constant(f32, 0.0)) for _ in xs]
    fma = _fn(b, "llvm.fma.v8f32", v8f32, [v8f32, v8f32, v8f32])

    def lanes_of(codes, r, i):  # block i's codes . input r's 32 values of it, as 8 float lanes
        acc = None
        if offset is not None:  # -16 x (or -8 x) each quad's sum: the lanes of (code - offset) . x, exactly
            acc = _load(b, xs[r][3], b.mul(i, ir.Constant(i64, 8)), v8i32)
            if offset == 8:
                acc = b.ashr(acc, _splat(v8i32, 1))
        x = _load(b, xs[r][0], b.mul(i, ir.Constant(i64, 32)))
        return b.sitofp(_lanes(b, codes, x, signed, acc), v8f32)

    def block(i, slot):
        p = b.add(o, b.mul(i, ir.Constant(i64, block_bytes)))
        # the blocks some rows ahead: the hardware prefetcher alone left this loop waiting on RAM
        _prefetch(b, wp, b.add(p, ir.Constant(i64, PREFETCH)))
        codes = codes_at(b, wp, p)
        if kind == "e8m0":
            e = b.zext(b.load(b.gep(wp, [p])), i32)  # 2^(e - 128) as float bits: (e - 1) << 23
            d = b.bitcast(b.shl(b.sub(e, ir.Constant(i32, 1)), ir.Constant(i32, 23)), f32)
        else:
            d = b.fpext(b.load(b.bitcast(b.gep(wp, [p]), half.as_pointer()), align=1), f32)
        if kind == "dm":
            m = b.fpext(b.load(b.bitcast(b.gep(wp, [b.add(p, ir.Constant(i64, 2))]), half.as_pointer()), align=1), f32)  # fmt: skip
        for r, (_, xdp, xsp, *_) in enumerate(xs):
            xd_i = b.load(b.gep(xdp, [i]))
            acc = accs[r][slot]
            scale = _broadcast(b, b.fmul(d, xd_i), v8f32)
            b.store(b.call(fma, [lanes_of(codes, r, i), scale, b.load(acc)]), acc)
            if kind == "dm":  # m times the input's sum
                two = b.mul(i, ir.Constant(i64, 2))
                xsum = b.add(b.load(b.gep(xsp, [two])), b.load(b.gep(xsp, [b.add(two, ir.Constant(i64, 1))])))
                b.store(b.fadd(b.load(sides[r]), b.fmul(b.fmul(m, xd_i), b.sitofp(xsum, f32))), sides[r])

    def group(g):
        """Eight blocks from block 8g: their half scales widened in one conversion and multiplied by each input's
        eight scales in one product (per block that was a load, a conversion, a product and a broadcast)."""
        i0 = b.mul(g, ir.Constant(i64, 8))
        p0 = b.add(o, b.mul(i0, ir.Constant(i64, block_bytes)))
        for ahead in range(0, 8 * block_bytes, 64):
            _prefetch(b, wp, b.add(p0, ir.Constant(i64, PREFETCH + ahead)))
        bits = ir.Constant(ir.VectorType(i16, 8), ir.Undefined)
        for j in range(8):
            at = b.bitcast(b.gep(wp, [b.add(p0, ir.Constant(i64, j * block_bytes))]), i16.as_pointer())
            bits = b.insert_element(bits, b.load(at, align=1), ir.Constant(i32, j))
        d8 = b.fpext(b.bitcast(bits, ir.VectorType(half, 8)), v8f32)
        xd8s = [b.load(b.bitcast(b.gep(xdp, [i0]), v8f32.as_pointer()), align=4) for _, xdp, *_ in xs]
        scales = [b.fmul(d8, xd8) for xd8 in xd8s]
        for j in range(8):
            codes = codes_at(b, wp, b.add(p0, ir.Constant(i64, j * block_bytes)))
            for r in range(len(xs)):
                lanes = lanes_of(codes, r, b.add(i0, ir.Constant(i64, j)))
                acc = accs[r][j % 2]
                b.store(b.call(fma, [lanes, _lane(b, scales[r], j), b.load(acc)]), acc)

    first = ir.Constant(i64, 0)
    if kind == "d":  # whole groups of eight blocks, then the rest one by one
        with cgutils.for_range(b, b.udiv(n, ir.Constant(i64, 8))) as loop:
            group(loop.index)
        first = b.mul(b.udiv(n, ir.Constant(i64, 8)), ir.Constant(i64, 8))
    pairs = b.udiv(b.sub(n, first), ir.Constant(i64, 2))
    with cgutils.for_range(b, pairs) as loop:
        two = b.add(first, b.mul(loop.index, ir.Constant(i64, 2)))
        block(two, 0)
        block(b.add(two, ir.Constant(i64, 1)), 1)
    with b.if_then(b.icmp_unsigned("!=", b.urem(b.sub(n, first), ir.Constant(i64, 2)), ir.Constant(i64, 0))):
        block(b.sub(n, ir.Constant(i64, 1)), 0)
    red = _fn(b, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f32])
    out = []
    for r in range(len(xs)):
        total = b.fadd(b.load(accs[r][0]), b.load(accs[r][1]))
        out.append(b.fadd(b.call(red, [ir.Constant(f32, 0.0), total]), b.load(sides[r])))
    return out


def _lane(b, vec, j, n=8):
    """Lane j of vec spread over n lanes."""
    return b.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, n), [j] * n))


def _k4_scales(b, wp, p):
    """Q4_K/Q5_K's 8 six-bit scales and 8 minimums (the 12 bytes at p) as two <8 x float>: the 32-bit moves of
    ggml's own unpacking, then one widening each."""
    u = [b.load(b.bitcast(b.gep(wp, [b.add(p, ir.Constant(i64, 4 * i))]), i32.as_pointer()), align=1) for i in range(3)]  # fmt: skip
    k1, k2, k3 = (ir.Constant(i32, c) for c in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))
    c4, c6 = ir.Constant(i32, 4), ir.Constant(i32, 6)
    sc_lo = b.and_(u[0], k1)
    sc_hi = b.or_(b.and_(u[2], k2), b.shl(b.and_(b.lshr(u[0], c6), k3), c4))
    mn_lo = b.and_(u[1], k1)
    mn_hi = b.or_(b.and_(b.lshr(u[2], c4), k2), b.shl(b.and_(b.lshr(u[1], c6), k3), c4))
    v4 = ir.VectorType(i32, 4)
    vec = ir.Constant(v4, ir.Undefined)
    for i, part in enumerate((sc_lo, sc_hi, mn_lo, mn_hi)):
        vec = b.insert_element(vec, part, ir.Constant(i32, i))
    by = b.bitcast(vec, ir.VectorType(i8, 16))
    v8f32 = ir.VectorType(ir.FloatType(), 8)

    def half(first):
        bytes8 = b.shuffle_vector(by, by, ir.Constant(ir.VectorType(i32, 8), list(range(first, first + 8))))
        return b.uitofp(bytes8, v8f32)

    return half(0), half(8)


def _rowk_loop(b, wp, xs, o, nblocks, kind):
    """The IR of one row of Q4_K, Q5_K or Q6_K super-blocks (bytes at o; nblocks 32-value runs) . each quantized
    input row of xs (as _row32_loop takes them) -> a float per input. A super-block's scales (and minimums) are
    widened once into vectors, with each input's scales per 32 multiplied in; each of its 8 runs of 32 is made into
    codes once and is one integer product per input (Q6_K's two scales of 16 applied inside it, pmaddwd) and one
    multiply-add into that input's float sums; the offsets (minimums, Q6_K's 32) go into a vector per input from
    its sums per 16."""
    f32 = ir.FloatType()
    v8f32, v16f32 = ir.VectorType(f32, 8), ir.VectorType(f32, 16)
    half = ir.HalfType()
    # as in _row32_loop
    accs = [[cgutils.alloca_once_value(b, ir.Constant(v8f32, None)) for _ in range(2)] for _ in xs]
    sides = [cgutils.alloca_once_value(b, ir.Constant(v16f32 if kind == Q6_K else v8f32, None)) for _ in xs]
    fma8 = _fn(b, "llvm.fma.v8f32", v8f32, [v8f32, v8f32, v8f32])
    maddubs = _fn(b, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
    maddwd = _fn(b, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[kind]

    def f16_at(p, off):
        ptr = b.bitcast(b.gep(wp, [b.add(p, ir.Constant(i64, off))]), half.as_pointer())
        return b.fpext(b.load(ptr, align=1), f32)

    def at(p, off):
        return b.add(p, ir.Constant(i64, off))

    with cgutils.for_range(b, b.udiv(nblocks, ir.Constant(i64, 8))) as loop:
        sb = loop.index
        p = b.add(o, b.mul(sb, ir.Constant(i64, size)))
        for ahead in range(0, size, 64):  # the next blocks' lines, as _row32_loop does
            _prefetch(b, wp, at(p, PREFETCH + ahead))
        x0 = b.mul(sb, ir.Constant(i64, 256))
        run_scales = []
        if kind == Q6_K:
            d = f16_at(p, 208)
            sc16 = b.sext(_load(b, wp, at(p, 192), ir.VectorType(i8, 16)), ir.VectorType(i16, 16))
            # offsets: 32 * d * xd * sc * (sum of 16 inputs), per 16
            wsc16 = b.fmul(b.sitofp(sc16, v16f32), _broadcast(b, b.fmul(d, ir.Constant(f32, 32.0)), v16f32))
        else:
            sc8, mn8 = _k4_scales(b, wp, at(p, 4))
            # the block's own products first, then each input's: the same operations whatever the inputs (under
            # fastmath LLVM reorders a product it can share between inputs, and a row's sums then differ by an
            # ulp alone and in a step of several)
            wsc8 = b.fmul(sc8, _broadcast(b, f16_at(p, 0), v8f32))
            wmn8 = b.fmul(mn8, _broadcast(b, f16_at(p, 2), v8f32))
        for r, (_, xdp, xsp, *_) in enumerate(xs):
            xd8 = b.load(b.bitcast(b.gep(xdp, [b.mul(sb, ir.Constant(i64, 8))]), v8f32.as_pointer()), align=4)
            xs16 = b.load(b.bitcast(b.gep(xsp, [b.mul(sb, ir.Constant(i64, 16))]), ir.VectorType(i32, 16).as_pointer()), align=4)  # fmt: skip
            if kind == Q6_K:
                run_scales.append(b.fmul(xd8, _broadcast(b, d, v8f32)))
                xd16 = b.shuffle_vector(
                    xd8, xd8, ir.Constant(ir.VectorType(i32, 16), [i // 2 for i in range(16)])
                )
                w16 = b.fmul(wsc16, xd16)
                b.store(b.fadd(b.load(sides[r]), b.fmul(w16, b.sitofp(xs16, v16f32))), sides[r])
            else:
                run_scales.append(b.fmul(wsc8, xd8))
                pairs = b.add(
                    b.shuffle_vector(xs16, xs16, ir.Constant(ir.VectorType(i32, 8), list(range(0, 16, 2)))),
                    b.shuffle_vector(xs16, xs16, ir.Constant(ir.VectorType(i32, 8), list(range(1, 16, 2)))),
                )
                b.store(b.call(fma8, [b.fmul(wmn8, xd8), b.sitofp(pairs, v8f32), b.load(sides[r])]), sides[r])
        for j in range(8):
            jc = ir.Constant(i64, j)  # constant: the codes' offsets and shifts fold
            if kind == Q6_K:
                codes = _q6k(b, wp, p, jc)
                # the run's two scales of 16 values, one a 128-bit half
                pair = b.shuffle_vector(sc16, sc16, ir.Constant(ir.VectorType(i32, 16), [2 * j] * 8 + [2 * j + 1] * 8))  # fmt: skip
            elif kind == Q5_K:
                codes = _q5k(b, wp, p, jc)
            else:
                codes = _nibbles32(b, wp, at(p, 16 + 32 * (j // 2)), ir.Constant(i64, 4 * (j % 2)))
            for r, (xp, *_) in enumerate(xs):
                prods = b.call(maddubs, [codes, _load(b, xp, b.add(x0, ir.Constant(i64, 32 * j)))])
                lanes = b.call(maddwd, [prods, pair if kind == Q6_K else _splat(v16i16, 1)])
                acc = accs[r][j % 2]
                b.store(b.call(fma8, [b.sitofp(lanes, v8f32), _lane(b, run_scales[r], j), b.load(acc)]), acc)
    red8 = _fn(b, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f32])
    red16 = _fn(b, "llvm.vector.reduce.fadd.v16f32", f32, [f32, v16f32])
    out = []
    for r in range(len(xs)):
        total = b.call(red8, [ir.Constant(f32, 0.0), b.fadd(b.load(accs[r][0]), b.load(accs[r][1]))])
        red = red16 if kind == Q6_K else red8
        out.append(b.fsub(total, b.call(red, [ir.Constant(f32, 0.0), b.load(sides[r])])))
    return out


def _iq4xs_runs(b, wp, p):
    """An IQ4_XS super-block's (bytes at p) eight run scales d * (ls - 32) as <8 x float>: ls is a run's low four
    bits from scales_l (byte j/2, nibble j%2) and two high bits from scales_h (bits 2j, 2j+1)."""
    f32 = ir.FloatType()
    sh = b.zext(b.load(b.bitcast(b.gep(wp, [b.add(p, ir.Constant(i64, 2))]), i16.as_pointer()), align=1), i32)
    sl = b.load(b.bitcast(b.gep(wp, [b.add(p, ir.Constant(i64, 4))]), i32.as_pointer()), align=1)
    vec = ir.Constant(ir.VectorType(i32, 8), ir.Undefined)
    for j in range(8):
        lo = b.and_(b.lshr(sl, ir.Constant(i32, 4 * j)), ir.Constant(i32, 15))  # byte j/2's nibble j%2
        hi = b.and_(b.lshr(sh, ir.Constant(i32, 2 * j)), ir.Constant(i32, 3))
        vec = b.insert_element(vec, b.or_(lo, b.shl(hi, ir.Constant(i32, 4))), ir.Constant(i32, j))
    ls = b.sitofp(b.sub(vec, _splat(vec.type, 32)), ir.VectorType(f32, 8))
    d = b.fpext(b.load(b.bitcast(b.gep(wp, [p]), ir.HalfType().as_pointer()), align=1), f32)
    return b.fmul(ls, _broadcast(b, d, ir.VectorType(f32, 8)))


def _rowxs_loop(b, wp, xs, o, nblocks):
    """The IR of one row of IQ4_XS super-blocks (136 bytes: d, scales_h, scales_l, 128 bytes of IQ4_NL nibbles;
    nblocks 32-value runs) . each quantized input row of xs (as _row32_loop takes them) -> a float per input: a
    super-block's eight run scales are made once into a vector and multiplied by each input's eight scales; each
    run's codes (the IQ4 table through pshufb) are one integer product per input and one multiply-add into its
    sums, which alternate as _row32_loop's do. It replaced a dot call per run (bench/cpu_mix_experts.py)."""
    f32 = ir.FloatType()
    v8f32 = ir.VectorType(f32, 8)
    accs = [[cgutils.alloca_once_value(b, ir.Constant(v8f32, None)) for _ in range(2)] for _ in xs]
    fma = _fn(b, "llvm.fma.v8f32", v8f32, [v8f32, v8f32, v8f32])
    with cgutils.for_range(b, b.udiv(nblocks, ir.Constant(i64, 8))) as loop:
        sb = loop.index
        p = b.add(o, b.mul(sb, ir.Constant(i64, 136)))
        for ahead in range(0, 136, 64):
            _prefetch(b, wp, b.add(p, ir.Constant(i64, PREFETCH + ahead)))
        runs = _iq4xs_runs(b, wp, p)
        i0 = b.mul(sb, ir.Constant(i64, 8))
        scales = [
            b.fmul(runs, b.load(b.bitcast(b.gep(xdp, [i0]), v8f32.as_pointer()), align=4))
            for _, xdp, *_ in xs
        ]
        for j in range(8):
            codes = _pshufb(b, IQ4, _nibbles16(b, wp, b.add(p, ir.Constant(i64, 8 + 16 * j))))
            at = b.mul(b.add(i0, ir.Constant(i64, j)), ir.Constant(i64, 32))
            for r, (xp, *_) in enumerate(xs):
                lanes = b.sitofp(_lanes(b, codes, _load(b, xp, at), True), v8f32)
                acc = accs[r][j % 2]
                b.store(b.call(fma, [lanes, _lane(b, scales[r], j), b.load(acc)]), acc)
    red = _fn(b, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f32])
    return [b.call(red, [ir.Constant(f32, 0.0), b.fadd(b.load(a[0]), b.load(a[1]))]) for a in accs]


def _row_loop(b, wp, xs, o, nblocks, kid):
    """_row32_loop, _rowk_loop or _rowxs_loop for the kind `kid` -> a float per input row of xs."""
    if kid in ROWK:
        return _rowk_loop(b, wp, xs, o, nblocks, kid)
    if kid == IQ4_XS:
        return _rowxs_loop(b, wp, xs, o, nblocks)
    return _row32_loop(b, wp, xs, o, nblocks, ROW32[kid])


ROWK = (Q4_K, Q5_K, Q6_K)  # super-block types read by row32/rows32 through _rowk_loop


@intrinsic
def row32(typingctx, w, o, nblocks, x, xd, xs, kind):
    """A row of 32-value blocks of type `kind` (one of ROW32's) . the quantized input (x int8, xd float32 scales
    per 32, xs int32 sums per 16) -> float32; one loop per type in the IR, chosen by `kind`."""
    sig = types.float32(w, o, nblocks, x, xd, xs, kind)

    def codegen(context, builder, signature, args):
        b = builder
        wp, xp, xdp, xsp = (_data(context, b, signature.args[i], args[i]) for i in (0, 3, 4, 5))
        out = cgutils.alloca_once_value(b, ir.Constant(ir.FloatType(), 0.0))
        for kid in (*ROW32, *ROWK, IQ4_XS):
            with b.if_then(b.icmp_signed("==", args[6], ir.Constant(args[6].type, kid))):
                (dot,) = _row_loop(b, wp, [(xp, xdp, xsp)], args[1], args[2], kid)
                b.store(dot, out)
        return b.load(out)

    return sig, codegen


# quantized input rows rows32 takes at once (a decode step of several slots: 4 at a time)
INPUTS = (1, 2, 3, 4)


@intrinsic(prefer_literal=True)
def rows32(typingctx, w, o, row_bytes, nrows, nblocks, x, xd, xs, xc, nx, kind, out, ostride, oo):
    """row32 for `nrows` consecutive weight rows (the first at byte o, row_bytes apart) and `nx` (one of INPUTS)
    quantized input rows (x int8 [>= nx, k], xd [>= nx, k/32], xs [>= nx, k/16], xc [>= nx, k/4] (quad_sums), each
    C-contiguous): input j's products go to out's flat data from element oo + j * ostride. The rows' loop is in
    the IR, so that a short row (a 640-wide head's 20 blocks) does not pay a call, the type's dispatch and its
    setup each (they had cost ~40 ns a row, 40% of such a product), and each weight block is read and made into
    codes once for all the inputs (a step of 4 rows of Qwen2.5-0.5B: its products 87.8 -> 43.8 ms on 2 cores).
    A literal `nx` (a constant at the call site) builds that count's loops alone: each call site compiles every
    block type's loops for each count it may take, and the first compile is paid on every new install."""
    if isinstance(nx, types.IntegerLiteral):
        if nx.literal_value not in INPUTS:
            raise ValueError(f"rows32 takes {INPUTS} inputs at once, not {nx.literal_value}")
        counts = (nx.literal_value,)
    else:
        counts = INPUTS
    sig = types.none(w, o, row_bytes, nrows, nblocks, x, xd, xs, xc, nx, kind, out, ostride, oo)

    def codegen(context, builder, signature, args):
        b = builder
        wp, xp, xdp, xsp, xcp, op = (
            _data(context, b, signature.args[i], args[i]) for i in (0, 5, 6, 7, 8, 11)
        )
        nb_ = args[4]
        k = b.mul(nb_, ir.Constant(i64, 32))
        inputs = [(b.gep(xp, [b.mul(k, ir.Constant(i64, j))]), b.gep(xdp, [b.mul(nb_, ir.Constant(i64, j))]),
                   b.gep(xsp, [b.mul(nb_, ir.Constant(i64, 2 * j))]), b.gep(xcp, [b.mul(nb_, ir.Constant(i64, 8 * j))]))
                  for j in range(max(counts))]  # fmt: skip
        for kid in (*ROW32, *ROWK, IQ4_XS):
            with b.if_then(b.icmp_signed("==", args[10], ir.Constant(args[10].type, kid))):
                for n_in in counts:
                    with b.if_then(b.icmp_signed("==", args[9], ir.Constant(args[9].type, n_in))):
                        with cgutils.for_range(b, args[3]) as loop:
                            r = loop.index
                            dots = _row_loop(
                                b, wp, inputs[:n_in], b.add(args[1], b.mul(r, args[2])), nb_, kid
                            )
                            for j, dot in enumerate(dots):
                                at = b.add(b.add(args[13], b.mul(args[12], ir.Constant(i64, j))), r)
                                b.store(dot, b.gep(op, [at]))
        return context.get_dummy_value()

    return sig, codegen


def _scale(b, wp, p, kind):
    """A 32-value block's scale as float: MXFP4's e8m0 byte, else the half at the block's start."""
    if kind == "e8m0":
        e = b.zext(b.load(b.gep(wp, [p])), i32)  # 2^(e - 128) as float bits: (e - 1) << 23
        return b.bitcast(b.shl(b.sub(e, ir.Constant(i32, 1)), ir.Constant(i32, 23)), ir.FloatType())
    return b.fpext(b.load(b.bitcast(b.gep(wp, [p]), ir.HalfType().as_pointer()), align=1), ir.FloatType())


@intrinsic
def deq32(typingctx, w, o, nblocks, out, oo, kind):
    """A row of 32-value blocks of type `kind` (one of ROW32's), bytes from o, as float32 values into out's flat
    data from element oo: per block 32 codes converted and scaled in one vector (the generic unpacking wrote one
    value at a time: prompt chunks spent as long dequantizing as in the GEMM)."""
    sig = types.none(w, o, nblocks, out, oo, kind)

    def codegen(context, builder, signature, args):
        b = builder
        wp = _data(context, b, signature.args[0], args[0])
        op = _data(context, b, signature.args[3], args[3])
        v32f = ir.VectorType(ir.FloatType(), 32)
        for kid, (block_bytes, codes_at, signed, what) in ROW32.items():
            with b.if_then(b.icmp_signed("==", args[5], ir.Constant(args[5].type, kid))):
                with cgutils.for_range(b, args[2]) as loop:
                    i = loop.index
                    p = b.add(args[1], b.mul(i, ir.Constant(i64, block_bytes)))
                    codes = codes_at(b, wp, p)
                    vals = b.sitofp(codes, v32f) if signed else b.uitofp(codes, v32f)
                    d = _broadcast(b, _scale(b, wp, p, what), v32f)
                    if what == "dm":  # d * code + m, m the half after d
                        m = _broadcast(b, _scale(b, wp, b.add(p, ir.Constant(i64, 2)), "m"), v32f)
                        vals = b.fadd(b.fmul(vals, d), m)
                    else:
                        vals = b.fmul(vals, d)
                    at = b.gep(op, [b.add(args[4], b.mul(i, ir.Constant(i64, 32)))])
                    b.store(vals, b.bitcast(at, v32f.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _at(off, make):
    return lambda b, wp, p: make(b, wp, b.add(p, ir.Constant(i64, off)))


def _q5_codes(b, wp, p):  # p: the 4 bytes of high bits, then 16 bytes of nibbles
    return b.or_(_nibbles16(b, wp, b.add(p, ir.Constant(i64, 4))), _bits(b, wp, p, None, 4))


# Q4_0 and Q5_0 as signed codes, their offsets inside (code - 8, code - 16), as ggml reads them: the products
# then need no per-block correction by the input's sums (seven scalar operations a block, ~40% of Q5_0's time)
def _q4_signed(b, wp, p):
    return b.sub(_nibbles16(b, wp, p), _splat(v32i8, 8))


def _q5_signed(b, wp, p):  # a clear high bit: the nibble's top bits all set (nibble - 16 as int8)
    return b.or_(_nibbles16(b, wp, b.add(p, ir.Constant(i64, 4))), _bits(b, wp, p, None, 4, on=0, off=-16))


ROW32 = {  # the 32-value block types read by row32: (block bytes, codes, signed codes, what else the block holds)
    Q8_0: (34, _at(2, lambda b, wp, p: _load(b, wp, p)), True, "d"),
    Q4_0: (18, _at(2, _q4_signed), True, "d"),
    Q4_1: (20, _at(4, _nibbles16), False, "dm"),
    Q5_0: (22, _at(2, _q5_signed), True, "d"),
    Q5_1: (24, _at(4, _q5_codes), False, "dm"),
    IQ4_NL: (18, _at(2, lambda b, wp, p: _pshufb(b, IQ4, _nibbles16(b, wp, p))), True, "d"),
    MXFP4_ID: (17, _at(1, lambda b, wp, p: _pshufb(b, MXFP4, _nibbles16(b, wp, p))), True, "e8m0"),
}
# Q5_0 and Q4_0 read as unsigned codes (0-31, 0-15) where the inputs come with their quads' sums times -16
# (quad_sums): a block's lanes then start from those (times -8 for Q4_0), the same integers as the signed codes'
# products, without the two sign instructions a block (rows32, the decode steps' products)
UNSIGNED = {Q5_0: (_at(2, _q5_codes), 16), Q4_0: (_at(2, _nibbles16), 8)}  # kind -> (codes, offset)
OFFSET = {ROW32[kind]: read for kind, read in UNSIGNED.items()}
OFFSET_KINDS = tuple(UNSIGNED)  # what _offset tests, in the jitted code


def _nibbles32(b, wp, p, shift):
    """32 bytes at p, each shifted right by `shift` (an i64: 0 or 4), low 4 bits (a Q4_K/Q5_K sub-block)."""
    return _field(b, wp, p, shift, 15)


def _bits(b, wp, p, bit, n_bytes, on=16, off=0):
    """Bit `bit` (an i64) of each of 32 bytes at p (n_bytes 32), or of the 32 bits of the 4 bytes at p
    (n_bytes 4: bit i of the little-endian word is value i; bit is then ignored), as <32 x i8> of 0 or 16 (of
    `on` where set and `off` where clear for n_bytes 4)."""
    if n_bytes == 4 and MASKS:  # the word as a mask register (kmovd), one masked move
        word = b.load(b.bitcast(b.gep(wp, [p]), i32.as_pointer()), align=1)
        return b.select(
            b.bitcast(word, ir.VectorType(ir.IntType(1), 32)), _splat(v32i8, on), _splat(v32i8, off)
        )
    if n_bytes == 4:  # byte i // 8 of the word into byte i, then its bit i % 8 tested (no 32-bit lanes)
        word = b.load(b.bitcast(b.gep(wp, [p]), ir.VectorType(i8, 4).as_pointer()), align=1)
        spread = b.shuffle_vector(
            word, word, ir.Constant(ir.VectorType(i32, 32), [i // 8 for i in range(32)])
        )
        bit_of = ir.Constant(v32i8, [1 << (i % 8) for i in range(32)])
        set_ = b.icmp_unsigned("==", b.and_(spread, bit_of), bit_of)
        return b.select(set_, _splat(v32i8, on), _splat(v32i8, off))
    return b.shl(_field(b, wp, p, bit, 1), _splat(v32i8, 4))


def _q5k(b, wp, p, sub):
    """Q5_K sub-block `sub` (0-7) of the block at p: nibbles of qs[32 * (sub // 2)] (low for even sub) and bit
    `sub` of the 32 high-bit bytes."""
    c = b.udiv(sub, ir.Constant(i64, 2))
    shift = b.mul(b.urem(sub, ir.Constant(i64, 2)), ir.Constant(i64, 4))
    qs = b.add(p, b.add(ir.Constant(i64, 48), b.mul(c, ir.Constant(i64, 32))))
    return b.or_(_nibbles32(b, wp, qs, shift), _bits(b, wp, b.add(p, ir.Constant(i64, 16)), sub, 32))


def _q6k(b, wp, p, k):
    """Q6_K's 32 codes (0-63) number k (0-7) of the block at p: half n = k // 4, part j = k % 4: low bits from
    ql[64n + 32 (j % 2)] (low nibbles for j < 2), high bits from qh[32n] shifted by 2j."""
    n = b.udiv(k, ir.Constant(i64, 4))
    j = b.urem(k, ir.Constant(i64, 4))
    ql = b.add(
        p, b.add(b.mul(n, ir.Constant(i64, 64)), b.mul(b.urem(j, ir.Constant(i64, 2)), ir.Constant(i64, 32)))
    )
    lo = _nibbles32(b, wp, ql, b.mul(b.udiv(j, ir.Constant(i64, 2)), ir.Constant(i64, 4)))
    qh = b.add(p, b.add(ir.Constant(i64, 128), b.mul(n, ir.Constant(i64, 32))))
    hi = b.shl(_field(b, wp, qh, b.mul(j, ir.Constant(i64, 2)), 3), _splat(v32i8, 4))
    return b.or_(lo, hi)


def _deq_intrinsic(make_codes, off):
    """An intrinsic (w, p, e, s0, m0, s1, m1, out, oo) writing a K-quant sub-block's 32 values, its codes made by
    make_codes(builder, w pointer, p, e), as float32 into out's flat data from element oo: code * s + m (the
    first 16 with s0, m0, the second with s1, m1), or with `off` (code - off) * s, as gguf computes them."""

    def typer(typingctx, w, p, e, s0, m0, s1, m1, out, oo):
        sig = types.none(w, p, e, s0, m0, s1, m1, out, oo)

        def codegen(context, builder, signature, args):
            b = builder
            wp = _data(context, b, signature.args[0], args[0])
            op = _data(context, b, signature.args[7], args[7])
            v32f, v16f = ir.VectorType(ir.FloatType(), 32), ir.VectorType(ir.FloatType(), 16)
            halves = ir.Constant(ir.VectorType(i32, 32), list(range(32)))

            def pair(lo, hi):  # 16 lanes of lo, then 16 of hi
                return b.shuffle_vector(_broadcast(b, lo, v16f), _broadcast(b, hi, v16f), halves)

            vals = b.uitofp(make_codes(b, wp, args[1], args[2]), v32f)
            if off:
                vals = b.fmul(b.fsub(vals, _splat(v32f, float(off))), pair(args[3], args[5]))
            else:
                vals = b.fadd(b.fmul(vals, pair(args[3], args[5])), pair(args[4], args[6]))
            b.store(vals, b.bitcast(b.gep(op, [args[8]]), v32f.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


deq_k4 = _deq_intrinsic(lambda b, wp, p, shift: _nibbles32(b, wp, p, shift), 0)
deq_q5k = _deq_intrinsic(_q5k, 0)
deq_q6k = _deq_intrinsic(_q6k, 32)
dot_codes = _dot_intrinsic(
    lambda b, wp, p: _load(b, wp, p), signed=True
)  # unpacked int8 codes (the other types)


@nb.njit(inline="always")
def _lo(v):
    return (
        np.int32(np.int64(v) & 0xFFFFFFFF)
        if (v & 0x80000000) == 0
        else np.int32((np.int64(v) & 0xFFFFFFFF) - (1 << 32))
    )


@nb.njit(inline="always")
def _hi(v):
    return np.int32(v >> 32)


@nb.njit(inline="always")
def _h(w, o, f16):
    return f16[np.int64(w[o]) | (np.int64(w[o + 1]) << 8)]


@nb.njit(inline="always")
def _i8(b):
    v = np.int32(b)
    return v - 256 if v > 127 else v


@nb.njit(inline="always")
def _scale_min_k4(w, s, j):
    """Q4_K/Q5_K's 6-bit scale and minimum of sub-block j from the 12 bytes at s."""
    if j < 4:
        return np.int32(w[s + j] & 63), np.int32(w[s + j + 4] & 63)
    sc = np.int32(w[s + j + 4] & 15) | (np.int32(w[s + j - 4] >> 6) << 4)
    mn = np.int32(w[s + j + 4] >> 4) | (np.int32(w[s + j] >> 6) << 4)
    return sc, mn


@nb.njit(inline="always")
def _k_sub(w, p, j, f16):
    """Q4_K/Q5_K sub-block j of the block at p: (its scale d * sc, its minimum dmin * m) as floats."""
    sc, m = _scale_min_k4(w, p + 4, j)
    return _h(w, p, f16) * np.float32(sc), _h(w, p + 2, f16) * np.float32(m)


@nb.njit(inline="always")
def _iq4xs_scale(w, p, j, f16):
    """IQ4_XS sub-block j's scale: d * (a 6-bit value - 32), its low 4 bits in scales_l, its high 2 in scales_h."""
    sh = np.int32(w[p + 2]) | (np.int32(w[p + 3]) << 8)
    ls = ((np.int32(w[p + 4 + j // 2]) >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
    return _h(w, p, f16) * np.float32(ls - 32)


@nb.njit(inline="always")
def _same(sc, mn, g, n, d, m):
    for i in range(n):
        sc[g + i] = d
        mn[g + i] = m


@nb.njit(fastmath=True)
def unpack_row(w, kind, o, k, q, sc, mn, f16):
    """The weight row whose blocks start at byte o, k values, into codes q[k] (int8) and per 16 values the scale
    sc and offset mn (float32): value = sc * q + mn."""
    if kind == Q8_0:
        for b in range(k // 32):
            p = o + b * 34
            _same(sc, mn, 2 * b, 2, _h(w, p, f16), np.float32(0.0))
            for i in range(32):
                q[32 * b + i] = _i8(w[p + 2 + i])
    elif kind == Q4_0 or kind == Q4_1 or kind == IQ4_NL or kind == MXFP4_ID:
        size = 20 if kind == Q4_1 else (17 if kind == MXFP4_ID else 18)
        for b in range(k // 32):
            p = o + b * size
            if kind == MXFP4_ID:
                d, m, c = E8M0_HALF[w[p]], np.float32(0.0), p + 1
            elif kind == Q4_1:
                d, m, c = _h(w, p, f16), _h(w, p + 2, f16), p + 4
            else:
                d, m, c = _h(w, p, f16), np.float32(0.0), p + 2
            _same(sc, mn, 2 * b, 2, d, m)
            for i in range(16):
                lo, hi = np.int32(w[c + i] & 15), np.int32(w[c + i] >> 4)
                if kind == Q4_0:
                    lo, hi = lo - 8, hi - 8
                elif kind == IQ4_NL:
                    lo, hi = np.int32(IQ4[lo]), np.int32(IQ4[hi])
                elif kind == MXFP4_ID:
                    lo, hi = np.int32(MXFP4[lo]), np.int32(MXFP4[hi])
                q[32 * b + i] = lo
                q[32 * b + 16 + i] = hi
    elif kind == Q5_0 or kind == Q5_1:
        size = 22 if kind == Q5_0 else 24
        for b in range(k // 32):
            p = o + b * size
            if kind == Q5_0:
                d, m, hp, off = _h(w, p, f16), np.float32(0.0), p + 2, 16
            else:
                d, m, hp, off = _h(w, p, f16), _h(w, p + 2, f16), p + 4, 0
            _same(sc, mn, 2 * b, 2, d, m)
            qh = np.uint32(w[hp]) | (np.uint32(w[hp + 1]) << 8) | (np.uint32(w[hp + 2]) << 16) | (np.uint32(w[hp + 3]) << 24)  # fmt: skip
            for i in range(16):
                x = w[hp + 4 + i]
                q[32 * b + i] = (np.int32(x & 15) | (np.int32((qh >> i) & 1) << 4)) - off
                q[32 * b + 16 + i] = (np.int32(x >> 4) | (np.int32((qh >> (i + 16)) & 1) << 4)) - off
    elif kind == Q4_K or kind == Q5_K:
        size = 144 if kind == Q4_K else 176
        for b in range(k // 256):
            p = o + b * size
            for j in range(8):
                s, m = _k_sub(w, p, j, f16)
                _same(sc, mn, 16 * b + 2 * j, 2, s, -m)
            qs = p + (16 if kind == Q4_K else 48)
            for c in range(4):
                for i in range(32):
                    x = w[qs + 32 * c + i]
                    lo, hi = np.int32(x & 15), np.int32(x >> 4)
                    if kind == Q5_K:
                        h = np.int32(w[p + 16 + i])
                        lo |= ((h >> (2 * c)) & 1) << 4
                        hi |= ((h >> (2 * c + 1)) & 1) << 4
                    q[256 * b + 64 * c + i] = lo
                    q[256 * b + 64 * c + 32 + i] = hi
    elif kind == Q6_K:
        for b in range(k // 256):
            p = o + b * 210
            d = _h(w, p + 208, f16)
            for g in range(16):
                sc[16 * b + g] = d * np.float32(_i8(w[p + 192 + g]))
                mn[16 * b + g] = np.float32(0.0)
            for n in range(2):
                for i in range(32):
                    a, a2, h = np.int32(w[p + 64 * n + i]), np.int32(w[p + 64 * n + 32 + i]), np.int32(w[p + 128 + 32 * n + i])  # fmt: skip
                    e = 256 * b + 128 * n + i
                    q[e] = ((a & 15) | ((h & 3) << 4)) - 32
                    q[e + 32] = ((a2 & 15) | (((h >> 2) & 3) << 4)) - 32
                    q[e + 64] = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                    q[e + 96] = ((a2 >> 4) | (((h >> 6) & 3) << 4)) - 32
    elif kind == Q2_K:
        for b in range(k // 256):
            p = o + b * 84
            d, dmin = _h(w, p + 80, f16), _h(w, p + 82, f16)
            for g in range(16):
                s = np.int32(w[p + g])
                sc[16 * b + g] = d * np.float32(s & 15)
                mn[16 * b + g] = -dmin * np.float32(s >> 4)
            for n in range(2):
                for j in range(4):
                    for i in range(32):
                        q[256 * b + 128 * n + 32 * j + i] = (np.int32(w[p + 16 + 32 * n + i]) >> (2 * j)) & 3
    elif kind == Q3_K:
        for b in range(k // 256):
            p = o + b * 110
            d = _h(w, p + 108, f16)
            for g in range(16):
                lo = (np.int32(w[p + 96 + g % 8]) >> (4 * (g // 8))) & 15
                hi = (np.int32(w[p + 104 + g % 4]) >> (2 * (g // 4))) & 3
                sc[16 * b + g] = d * np.float32((lo | (hi << 4)) - 32)
                mn[16 * b + g] = np.float32(0.0)
            for n in range(2):
                for j in range(4):
                    for i in range(32):
                        c = (np.int32(w[p + 32 + 32 * n + i]) >> (2 * j)) & 3
                        if (np.int32(w[p + i]) >> (4 * n + j)) & 1 == 0:
                            c -= 4
                        q[256 * b + 128 * n + 32 * j + i] = c
    elif kind == IQ4_XS:
        for b in range(k // 256):
            p = o + b * 136
            for j in range(8):
                _same(sc, mn, 16 * b + 2 * j, 2, _iq4xs_scale(w, p, j, f16), np.float32(0.0))
                for i in range(16):
                    x = w[p + 8 + 16 * j + i]
                    q[256 * b + 32 * j + i] = IQ4[x & 15]
                    q[256 * b + 32 * j + 16 + i] = IQ4[x >> 4]
    elif kind == IQ2_XXS or kind == IQ3_XXS:
        # per 32 values: a 4-bit scale and four 7-bit sign indices in one uint32, magnitudes from the grid
        size = 66 if kind == IQ2_XXS else 98
        for b in range(k // 256):
            p = o + b * size
            d = _h(w, p, f16)
            for g in range(8):
                u = p + 2 + 8 * g + 4 if kind == IQ2_XXS else p + 66 + 4 * g
                aux = np.uint32(w[u]) | (np.uint32(w[u + 1]) << 8) | (np.uint32(w[u + 2]) << 16) | (np.uint32(w[u + 3]) << 24)  # fmt: skip
                half = np.float32(0.25) if kind == IQ2_XXS else np.float32(0.5)
                db = d * (np.float32(0.5) + np.float32(aux >> 28)) * half
                _same(sc, mn, 16 * b + 2 * g, 2, db, np.float32(0.0))
                for sub in range(4):
                    signs = np.int64(KSIGNS[(aux >> (7 * sub)) & 127])
                    if kind == IQ2_XXS:  # one 8-value grid row: its two fours
                        r0 = 16 * (2 * np.int64(w[p + 2 + 8 * g + sub])) + (signs & 15)
                        r1 = r0 + 16 - (signs & 15) + (signs >> 4)
                        tab = SIGNED_IQ2XXS
                    else:  # two 4-value grid rows
                        r0 = 16 * np.int64(w[p + 2 + 8 * g + 2 * sub]) + (signs & 15)
                        r1 = 16 * np.int64(w[p + 3 + 8 * g + 2 * sub]) + (signs >> 4)
                        tab = SIGNED_IQ3XXS
                    v = 256 * b + 32 * g + 8 * sub
                    for i in range(4):
                        q[v + i] = tab[r0, i]
                        q[v + 4 + i] = tab[r1, i]
    elif kind == IQ2_XS or kind == IQ2_S:
        # a 4-bit scale per 16 values; per 8 values a grid index and a sign byte: IQ2_XS one uint16 (9-bit index,
        # 7-bit sign index), IQ2_S a 10-bit index (8 bits in qs, 2 in qh) and the sign byte itself
        size, at_scales = (74, 66) if kind == IQ2_XS else (82, 74)
        for b in range(k // 256):
            p = o + b * size
            d = _h(w, p, f16)
            for s in range(16):
                ls = np.float32((w[p + at_scales + s // 2] >> (4 * (s % 2))) & 15)
                _same(sc, mn, 16 * b + s, 1, d * (np.float32(0.5) + ls) * np.float32(0.25), np.float32(0.0))
                for h in range(2):
                    j = 2 * s + h
                    if kind == IQ2_XS:
                        v = np.int64(w[p + 2 + 2 * j]) | (np.int64(w[p + 3 + 2 * j]) << 8)
                        idx, signs = v & 511, KSIGNS[v >> 9]
                    else:
                        idx = np.int64(w[p + 2 + j]) | (
                            np.int64((w[p + 66 + j // 4] >> (2 * (j % 4))) & 3) << 8
                        )
                        signs = w[p + 34 + j]
                    for i in range(8):
                        m = GRID_IQ2XS[idx, i] if kind == IQ2_XS else GRID_IQ2S[idx, i]
                        q[256 * b + 8 * j + i] = -m if (signs >> i) & 1 else m
    elif kind == IQ3_S:
        # per 4 values a 9-bit grid index (8 bits in qs, 1 in qh), a sign bit per value; a scale per 32 values
        for b in range(k // 256):
            p = o + b * 110
            d = _h(w, p, f16)
            for g in range(8):
                ls = (w[p + 106 + g // 2] >> (4 * (g % 2))) & 15
                _same(sc, mn, 16 * b + 2 * g, 2, d * np.float32(1 + 2 * np.int32(ls)), np.float32(0.0))
                qh = np.int64(w[p + 66 + g])  # the grid indices' ninth bits of the group's 8 fours
                for m4 in range(8):
                    j = 8 * g + m4
                    idx = np.int64(w[p + 2 + j]) | (((qh >> m4) & 1) << 8)
                    sgn = (
                        np.int64(w[p + 74 + 4 * g + m4 // 2]) >> (4 * (m4 % 2))
                    ) & 15  # the four's sign bits
                    row = 16 * idx + sgn
                    v = 256 * b + 32 * g + 4 * m4
                    for i in range(4):
                        q[v + i] = SIGNED_IQ3S[row, i]
    elif kind == IQ1_S or kind == IQ1_M:
        # value = dl * (grid + delta), delta = +-1/8: codes 8 * grid +- 1 with the scale dl / 8 (exact: a power of two)
        size = 50 if kind == IQ1_S else 56
        for b in range(k // 256):
            p = o + b * size
            if kind == IQ1_M:  # the half scale is the top nibbles of the four scale words
                sw = p + 48
                bits = (
                    (w[sw + 1] >> 4)
                    | (w[sw + 3] & 0xF0)
                    | (np.int64(w[sw + 5] >> 4) << 8)
                    | (np.int64(w[sw + 7] & 0xF0) << 8)
                )
                d = f16[bits]
            else:
                d = _h(w, p, f16)
            for g in range(8):
                for half in range(2):
                    if kind == IQ1_S:
                        qh = np.int64(w[p + 34 + 2 * g]) | (np.int64(w[p + 35 + 2 * g]) << 8)
                        ls = (qh >> 12) & 7
                    else:
                        t = 2 * g + half  # scale t: word t // 4, field t % 4
                        word = np.int64(w[p + 48 + 2 * (t // 4)]) | (np.int64(w[p + 49 + 2 * (t // 4)]) << 8)
                        ls = (word >> (3 * (t % 4))) & 7
                    _same(
                        sc,
                        mn,
                        16 * b + 2 * g + half,
                        1,
                        d * np.float32(2 * ls + 1) / np.float32(8.0),
                        np.float32(0.0),
                    )
                    for s2 in range(2):
                        j = 4 * g + 2 * half + s2
                        if kind == IQ1_S:
                            idx = np.int64(w[p + 2 + j]) | (((qh >> (3 * (j % 4))) & 7) << 8)
                            neg = (qh & 0x8000) != 0
                        else:
                            nib = (w[p + 32 + j // 2] >> (4 * (j % 2))) & 15
                            idx = np.int64(w[p + j]) | (np.int64(nib & 7) << 8)
                            neg = (nib & 8) != 0
                        for i in range(8):
                            q[256 * b + 8 * j + i] = 8 * GRID_IQ1S[idx, i] + (-1 if neg else 1)


@nb.njit(fastmath=True, nogil=True, cache=True)
def quantize(x, xq, xd, xs):
    """x float32 [T, K] -> xq int8 (round(x / d), d = max|x| / 127 per 32 values, in xd [T, K/32]) and xs, the sums
    of xq per 16 (int32 [T, K/16]: they carry the offsets)."""
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax = np.float32(0.0)
            for i in range(32):
                amax = max(amax, abs(x[r, 32 * b + i]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if amax > 0 else np.float32(0.0)
            xd[r, b] = d
            for h in range(2):
                t = np.int32(0)
                for i in range(16):
                    v = np.int32(np.rint(x[r, 32 * b + 16 * h + i] * inv))
                    xq[r, 32 * b + 16 * h + i] = v
                    t += v
                xs[r, 2 * b + h] = t


@nb.njit(fastmath=True, nogil=True, cache=True)
def quad_sums(xq, xc):
    """xq int8 [T, K] -> xc int32 [T, K/4]: each 4 values' sum times -16, the lanes Q5_0's unsigned codes start
    from (OFFSET): (code - 16) . x = code . x - 16 x per quad, in the integers."""
    for r in range(xc.shape[0]):  # none where no weight of the call takes them
        for j in range(xq.shape[1] // 4):
            t = np.int32(0)
            for i in range(4):
                t += np.int32(xq[r, 4 * j + i])
            xc[r, j] = -16 * t


@nb.njit(inline="always")
def _unpacked(kind):
    """Whether rows of `kind` are unpacked into codes once per product (cpu_blocks.UNPACKED), not read in place."""
    return (
        kind == Q2_K
        or kind == Q3_K
        or kind == IQ2_XXS
        or kind == IQ2_XS
        or kind == IQ3_XXS
        or kind == IQ2_S
        or kind == IQ3_S
        or kind == IQ1_S
        or kind == IQ1_M
    )


@nb.njit(inline="always")
def _offset(kind):
    """Whether rows32 reads `kind` as unsigned codes from the inputs' quad sums (OFFSET)."""
    return kind in OFFSET_KINDS


@nb.njit(inline="always")
def _in_ir(kind):
    """Whether row32/rows32 read `kind` (ROW32's and ROWK's types, and IQ4_XS)."""
    return _is_row32(kind) or kind == Q4_K or kind == Q5_K or kind == Q6_K or kind == IQ4_XS


@nb.njit(inline="always")
def _is_row32(kind):
    """Whether `kind` is one of ROW32's 32-value block types (row32, deq32)."""
    return (
        kind == Q8_0
        or kind == Q4_0
        or kind == Q4_1
        or kind == Q5_0
        or kind == Q5_1
        or kind == IQ4_NL
        or kind == MXFP4_ID
    )


@nb.njit(fastmath=True)
def row_dot(w, kind, o, k, x, xd, xs):
    """One weight row (blocks at byte o) . one quantized input row (x int8 [k], xd its scales per 32, xs its sums
    per 16), for the types read in place; one vec-dot body per block type, as ggml has."""
    acc = np.float32(0.0)
    if _in_ir(kind):
        acc = row32(w, o, np.int64(k // 32), x, xd, xs, np.int64(kind))
    return acc


@nb.njit(fastmath={"nnan", "ninf", "nsz", "arcp", "afn"})
def codes_dot(q, sc, mn, k, x, xd, xs):
    """A row unpacked into codes (q int8 [k], a scale and a minimum per 16: unpack_row) . one quantized input row,
    for the types not read in place (Q2_K, Q3_K, the IQ1-IQ3 grids)."""
    acc = np.float32(0.0)
    off = np.float32(0.0)
    for b in range(k // 32):
        v = dot_codes(q, np.int64(32 * b), x, np.int64(32 * b))
        acc += xd[b] * (sc[2 * b] * np.float32(_lo(v)) + sc[2 * b + 1] * np.float32(_hi(v)))
    for g in range(k // 16):
        off += mn[g] * xd[g >> 1] * np.float32(xs[g])
    return acc + off


# No reassociation or contraction: with them LLVM shares a product between the inputs of rows32 and a row's sums
# then differ by an ulp alone and in a step of several.
@nb.njit(parallel=True, fastmath={"nnan", "ninf", "nsz", "arcp", "afn"}, nogil=True, cache=True)
def matmul(w0, w1, w2, kind0, kind1, kind2, n0, n1, n2, rb0, rb1, rb2, k, x, o0, o1, o2, f16):
    """o_j[T, n_j] = x @ W_j.T for x float32 [T, k] and up to three weights W_j of the same input width (n_j = 0:
    none; q, k and v, or gate and up, in one parallel region): W_j's rows of `rb_j` bytes of `kind_j` blocks in w_j
    (uint8, flat); x is quantized once, first (one call: the per-call cost counts at decode; a weight's sums are
    the same bits alone and beside others). Most types are read in place: up to 8 rows (decode steps) by the IR
    loops, a task's weight rows at once for up to 4 inputs at once (rows32), more (bench/cpu_block_types.py, 2
    cores, 64 rows of 896 x 4864: Q4_K 9.5 ms in place against 13.9 unpacked, Q6_K 12.4 against 13.4) by row_dot
    for each row; the other IQ types, Q2_K and Q3_K are unpacked into codes once for all T rows."""
    t_rows = x.shape[0]
    xq = np.empty((t_rows, k), np.int8)
    xd = np.empty((t_rows, k // 32), np.float32)
    xs = np.empty((t_rows, k // 16), np.int32)
    quantize(x, xq, xd, xs)
    xc = np.empty((t_rows if _offset(kind0) or _offset(kind1) or _offset(kind2) else 0, k // 4), np.int32)
    quad_sums(xq, xc)
    groups = k // 16
    t0 = (n0 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    t1 = (n1 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    t2 = (n2 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for t in nb.prange(t0 + t1 + t2):
        if t < t0:
            w, kind, n_out, row_bytes, out, first = w0, kind0, n0, rb0, o0, t * ROWS_PER_TASK
        elif t < t0 + t1:
            w, kind, n_out, row_bytes, out, first = w1, kind1, n1, rb1, o1, (t - t0) * ROWS_PER_TASK
        else:
            w, kind, n_out, row_bytes, out, first = w2, kind2, n2, rb2, o2, (t - t0 - t1) * ROWS_PER_TASK
        in_place = not _unpacked(kind)
        q = np.empty(k if not in_place else 32, np.int8)
        sc = np.empty(groups, np.float32)
        mn = np.empty(groups, np.float32)
        # a decode step's product: the task's rows in one call, each weight block read once for up to 4 inputs
        if in_place and t_rows <= 8 and _in_ir(kind):
            n_rows = min(n_out, first + ROWS_PER_TASK) - first
            for r0 in range(0, t_rows, 4):
                rows32(w, np.int64(first) * row_bytes, np.int64(row_bytes), np.int64(n_rows), np.int64(k // 32),
                       xq[r0:], xd[r0:], xs[r0:], xc[r0:], np.int64(min(4, t_rows - r0)), np.int64(kind), out,
                       np.int64(n_out), np.int64(r0 * n_out + first))  # fmt: skip
            continue
        for n in range(first, min(n_out, first + ROWS_PER_TASK)):
            o = np.int64(n) * row_bytes
            if in_place:
                for r in range(t_rows):
                    out[r, n] = row_dot(w, kind, o, k, xq[r], xd[r], xs[r])
                continue
            unpack_row(w, kind, o, k, q, sc, mn, f16)
            for r in range(t_rows):
                out[r, n] = codes_dot(q, sc, mn, k, xq[r], xd[r], xs[r])


@nb.njit(fastmath=True)
def deq_k_row(w, kind, o, k, out, oo, f16):
    """A Q4_K, Q5_K or Q6_K row (blocks at byte o) as float32 values into out's flat data from element oo: a vector
    store per 32 values."""
    if kind == Q6_K:
        for b in range(k // 256):
            p = o + b * 210
            d = _h(w, p + 208, f16)
            for j in range(8):
                s0, s1 = d * np.float32(_i8(w[p + 192 + 2 * j])), d * np.float32(_i8(w[p + 193 + 2 * j]))
                deq_q6k(w, p, np.int64(j), s0, s0, s1, s1, out, oo + 256 * b + 32 * j)
        return
    size = 144 if kind == Q4_K else 176
    for b in range(k // 256):
        p = o + b * size
        for j in range(8):
            sc, m = _k_sub(w, p, j, f16)
            at = oo + 256 * b + 32 * j
            if kind == Q4_K:
                deq_k4(w, p + 16 + 32 * (j // 2), np.int64(4 * (j % 2)), sc, -m, sc, -m, out, at)
            else:
                deq_q5k(w, p, np.int64(j), sc, -m, sc, -m, out, at)


@nb.njit(fastmath=True)
def _deq_row(w, kind, o, k, out, r, q, sc, mn, f16):
    """Row r of out [*, k] (float32): the values of the weight row whose blocks start at byte o."""
    if _is_row32(kind):
        deq32(w, o, np.int64(k // 32), out, np.int64(r) * k, np.int64(kind))
    elif kind == Q4_K or kind == Q5_K or kind == Q6_K:
        deq_k_row(w, kind, o, k, out, np.int64(r) * k, f16)
    else:
        unpack_row(w, kind, o, k, q, sc, mn, f16)
        for g in range(k // 16):
            for i in range(16):
                out[r, 16 * g + i] = sc[g] * np.float32(q[16 * g + i]) + mn[g]


@nb.njit(parallel=True, fastmath=True, nogil=True, cache=True)
def dequantize(w, kind, n_out, k, row_bytes, out, bits, f16):
    """out[n_out, k] float32: the rows' values (the same unpacking; for prompt chunks through a float GEMM). Or, with
    bits [n_out, k] (uint16; out then [0, k]), their bfloat16 bits, rounded to nearest even: each row is made
    float32 in a row of scratch that stays in cache, so no float32 tile is written to memory and read back."""
    groups = k // 16
    tasks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    half = bits.shape[0] > 0
    for t in nb.prange(tasks):
        q = np.empty(k, np.int8)
        sc = np.empty(groups, np.float32)
        mn = np.empty(groups, np.float32)
        row = np.empty((1, k), np.float32)
        b32 = row.reshape(k).view(np.uint32)
        for n in range(t * ROWS_PER_TASK, min(n_out, t * ROWS_PER_TASK + ROWS_PER_TASK)):
            o = np.int64(n) * row_bytes
            if not half:
                _deq_row(w, kind, o, k, out, n, q, sc, mn, f16)
                continue
            _deq_row(w, kind, o, k, row, 0, q, sc, mn, f16)
            for i in range(k):
                b = b32[i]
                bits[n, i] = np.uint16(
                    (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                )


@nb.njit(parallel=True, fastmath={"nnan", "ninf", "nsz", "arcp", "afn"}, nogil=True, cache=True)  # as matmul
def mix(gate, up, down, kinds, gate_row_bytes, down_row_bytes, f, d, box, boxf, at_ids, at_take, at_w, n_box, k,
        ids, tok, ws, x, out, f16):  # fmt: skip
    """out[t] = sum over the pairs j of token t of ws[j] * down_j(silu(gate_j x[t]) * up_j x[t]) for the (expert,
    token) pairs j (ids[j], tok[j]) in any order (grouped here by expert: each weight row read once for its
    group), or, where n_box >= 0, the pairs a mailbox row hands over (box_pairs), each expert read in place from
    the flat blocks of gate and up [E, f, d] and down [E, d, f] (block types kinds[0..2]); x float32 [T, d], out
    float32 [T, d] (written, zeros where a token has no pair). The input and the hidden rows are rounded to 8 bits
    per 32 values, as in matmul. -> 0, or group_pairs' error code (nothing written). The grouping is inside this
    parallel function for the reason engine/experts/cpu_q4k_jit.py's mix gives."""
    if n_box >= 0:
        ids, tok, ws = box_pairs(box, boxf, at_ids, at_take, at_w, n_box, k)
    ids, tok, ws, starts, bad = group_pairs(ids, tok, ws, gate.shape[0] // (f * gate_row_bytes), x.shape[0])
    if bad:
        return bad
    nt, n_tok, n_grp = ids.shape[0], x.shape[0], starts.shape[0] - 1
    xq = np.empty((n_tok, d), np.int8)
    xd = np.empty((n_tok, d // 32), np.float32)
    xs = np.empty((n_tok, d // 16), np.int32)
    if n_tok >= PARALLEL_ROWS:  # a batched step's rows side by side
        for r in nb.prange(n_tok):
            quantize(x[r : r + 1], xq[r : r + 1], xd[r : r + 1], xs[r : r + 1])
    else:
        quantize(x, xq, xd, xs)
    xc = np.empty((n_tok if _offset(kinds[0]) or _offset(kinds[1]) else 0, d // 4), np.int32)
    quad_sums(xq, xc)
    in_ir = _in_ir(kinds[0]) and _in_ir(kinds[1]) and _in_ir(kinds[2])
    h = np.empty((nt, f), np.float32)
    hu = np.empty((nt, f) if in_ir else (0, 0), np.float32)
    tasks = (f + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for t in nb.prange(n_grp * tasks):
        g = t // tasks
        n0 = (t - g * tasks) * ROWS_PER_TASK
        e = np.int64(ids[starts[g]])
        if in_ir:  # the task's rows in one IR loop per token (a dot call per row and token: ~40 ns each)
            n_rows = np.int64(min(f, n0 + ROWS_PER_TASK) - n0)
            o = (e * f + n0) * gate_row_bytes
            for j in range(starts[g], starts[g + 1]):
                i = tok[j]
                at = np.int64(j * f + n0)
                rows32(gate, o, np.int64(gate_row_bytes), n_rows, np.int64(d // 32), xq[i:], xd[i:], xs[i:],
                       xc[i:], 1, np.int64(kinds[0]), h, np.int64(f), at)  # fmt: skip
                rows32(up, o, np.int64(gate_row_bytes), n_rows, np.int64(d // 32), xq[i:], xd[i:], xs[i:],
                       xc[i:], 1, np.int64(kinds[1]), hu, np.int64(f), at)  # fmt: skip
                for n in range(n0, n0 + n_rows):
                    a = h[j, n]
                    h[j, n] = a / (np.float32(1.0) + np.exp(-a)) * hu[j, n]
            continue
        # types not read in place: each row unpacked into codes once for the group's tokens (as matmul does)
        ug, uu = _unpacked(kinds[0]), _unpacked(kinds[1])
        qg, qu = np.empty(d if ug else 0, np.int8), np.empty(d if uu else 0, np.int8)
        sg, su = np.empty(d // 16, np.float32), np.empty(d // 16, np.float32)
        mg, mu = np.empty(d // 16, np.float32), np.empty(d // 16, np.float32)
        for n in range(n0, min(f, n0 + ROWS_PER_TASK)):
            r = (e * f + n) * gate_row_bytes
            if ug:
                unpack_row(gate, kinds[0], r, d, qg, sg, mg, f16)
            if uu:
                unpack_row(up, kinds[1], r, d, qu, su, mu, f16)
            for j in range(starts[g], starts[g + 1]):
                i = tok[j]
                if ug:
                    a = codes_dot(qg, sg, mg, d, xq[i], xd[i], xs[i])
                else:
                    a = row_dot(gate, kinds[0], r, d, xq[i], xd[i], xs[i])
                if uu:
                    b = codes_dot(qu, su, mu, d, xq[i], xd[i], xs[i])
                else:
                    b = row_dot(up, kinds[1], r, d, xq[i], xd[i], xs[i])
                h[j, n] = a / (np.float32(1.0) + np.exp(-a)) * b
    hq = np.empty((nt, f), np.int8)
    hd = np.empty((nt, f // 32), np.float32)
    hs = np.empty((nt, f // 16), np.int32)
    if nt >= 2 * PARALLEL_ROWS:
        for r in nb.prange(nt):
            quantize(h[r : r + 1], hq[r : r + 1], hd[r : r + 1], hs[r : r + 1])
    else:
        quantize(h, hq, hd, hs)
    hc = np.empty((nt if _offset(kinds[2]) else 0, f // 4), np.int32)
    quad_sums(hq, hc)
    for t in nb.prange((d + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        if in_ir:  # each pair's rows of the task in one IR loop; the pairs added in the same order as below
            n0 = t * ROWS_PER_TASK
            n_rows = min(d, n0 + ROWS_PER_TASK) - n0
            dots = np.empty(ROWS_PER_TASK, np.float32)
            for i in range(n_tok):
                for n in range(n0, n0 + n_rows):
                    out[i, n] = np.float32(0.0)
            for j in range(nt):
                rows32(down, (np.int64(ids[j]) * d + n0) * down_row_bytes, np.int64(down_row_bytes),
                       np.int64(n_rows), np.int64(f // 32), hq[j:], hd[j:], hs[j:], hc[j:], 1, np.int64(kinds[2]),
                       dots, np.int64(0), np.int64(0))  # fmt: skip
                for n in range(n0, n0 + n_rows):
                    out[tok[j], n] += ws[j] * dots[n - n0]
            continue
        ud = _unpacked(kinds[2])
        qd = np.empty(f if ud else 0, np.int8)
        sd, md = np.empty(f // 16, np.float32), np.empty(f // 16, np.float32)
        for n in range(t * ROWS_PER_TASK, min(d, t * ROWS_PER_TASK + ROWS_PER_TASK)):
            for i in range(n_tok):
                out[i, n] = np.float32(0.0)
            for j in range(nt):
                r = (np.int64(ids[j]) * d + n) * down_row_bytes
                # the pairs come grouped by expert: a row is unpacked again only when the expert changes
                if ud:
                    if j == 0 or ids[j] != ids[j - 1]:
                        unpack_row(down, kinds[2], r, f, qd, sd, md, f16)
                    v = codes_dot(qd, sd, md, f, hq[j], hd[j], hs[j])
                else:
                    v = row_dot(down, kinds[2], r, f, hq[j], hd[j], hs[j])
                out[tok[j], n] += ws[j] * v
    return 0


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


@nb.njit(fastmath=True, nogil=True, cache=True)
def attend_rows(q, k, v, pos, window, scale, softcap, out):
    """engine/kernels/cpu_attention.py's kernel (here to be compiled and cached with the block kernels): q [T, H,
    D], k [S, Hkv, D], v [S, Hkv, Dv], pos [T] -> out [T, H, Dv] (float32), row t's query heads of key head hk
    against the keys of positions lo..pos[t] of that head (lo: the window's first, else 0); each key and value
    row is read once for the group's query heads."""
    t_rows, n_head, d = q.shape
    n_kv = k.shape[1]
    g = n_head // n_kv
    dv = v.shape[2]
    for task in range(t_rows * n_kv):
        t = task // n_kv
        hk = task - t * n_kv
        p = pos[t]
        lo = max(0, p - window + 1) if window > 0 else 0
        n = p + 1 - lo
        s = np.empty((g, n), np.float32)
        qg = q[t, hk * g : (hk + 1) * g]  # [G, D]
        for j in range(n):
            kr = k[lo + j, hk]
            for a in range(g):
                acc = np.float32(0.0)
                for i in range(d):
                    acc += qg[a, i] * kr[i]
                acc *= scale
                if softcap > 0:
                    acc = softcap * np.tanh(acc / softcap)
                s[a, j] = acc
        total = np.empty(g, np.float32)
        for a in range(g):
            top = np.float32(-np.inf)
            for j in range(n):
                top = max(top, s[a, j])
            tot = np.float32(0.0)
            for j in range(n):
                s[a, j] = np.exp(s[a, j] - top)
                tot += s[a, j]
            total[a] = tot
        acc_v = np.zeros((g, dv), np.float32)
        for j in range(n):
            vr = v[lo + j, hk]
            for a in range(g):
                w = s[a, j]
                for i in range(dv):
                    acc_v[a, i] += w * vr[i]
        for a in range(g):
            for i in range(dv):
                out[t, hk * g + a, i] = acc_v[a, i] / total[a]


@nb.njit(nogil=True, cache=True)
def rms_norm(x, w, eps, out):
    """Rows of x [R, D] (float32) over their root mean square into out, times w [D] (float32; none where w is
    empty): the squares summed in float64, then torch's two roundings (x * rsqrt(mean + eps), then * w)."""
    rows, d = x.shape
    for r in range(rows):
        acc = 0.0
        for i in range(d):
            v = np.float64(x[r, i])
            acc += v * v
        inv = np.float32(1.0 / np.sqrt(np.float32(acc / d) + np.float32(eps)))
        if w.shape[0] == 0:
            for i in range(d):
                out[r, i] = x[r, i] * inv
        else:
            for i in range(d):
                out[r, i] = (x[r, i] * inv) * w[i]


@nb.njit(nogil=True, cache=True)
def rotate(x, cos, sin, dim, neox, out):
    """RoPE of x [T, H, D] (float32) into out: the first `dim` features of each head rotated by cos, sin [T,
    dim/2] (its halves with neox, adjacent pairs without), the rest copied. The same float32 products and sums,
    one rounding each, as the torch form in engine/layers/rope.py: the two give the same bits."""
    t_rows, n_head, d = x.shape
    half = dim // 2
    for t in range(t_rows):
        for h in range(n_head):
            for i in range(half):
                c = cos[t, i]
                s = sin[t, i]
                if neox:
                    j0, j1 = i, i + half
                else:
                    j0, j1 = 2 * i, 2 * i + 1
                a = x[t, h, j0]
                b = x[t, h, j1]
                out[t, h, j0] = a * c - b * s
                out[t, h, j1] = b * c + a * s
            for i in range(dim, d):
                out[t, h, i] = x[t, h, i]


@nb.njit(nogil=True, cache=True)
def attend_step(
    q, k, v, qb, kb, vb, qn, kn, eps, cos, sin, dim, neox, kc, vc, pos, window, scale, softcap, out
):
    """A CPU decode step's attention from its projections, in one call where it took ~15 torch operations and
    kernel calls a layer (~90 us on 2 cores): q [T, H*Dk], k [T, Hkv*Dk], v [T, Hkv*Dv] (float32, written) get
    their biases (qb, kb, vb; none where empty), the per-head RMS norms (qn, kn) and RoPE (cos, sin [T, dim/2]);
    k and v are stored at positions pos [T] of the layer's float32 cache kc [S, Hkv, Dk], vc [S, Hkv, Dv]; the
    rows attend as attend_rows does -> out [T, H, Dv]. The same kernels and float32 operations as that path
    (rms_norm, rotate, attend_rows, the biases' adds), so the same bits."""
    t_rows = q.shape[0]
    n_kv, dk, dv = kc.shape[1], kc.shape[2], vc.shape[2]
    n_head = q.shape[1] // dk
    for x, b in ((q, qb), (k, kb), (v, vb)):
        if b.shape[0] > 0:
            for t in range(t_rows):
                for j in range(x.shape[1]):
                    x[t, j] += b[j]
    q3 = q.reshape((t_rows, n_head, dk))
    k3 = k.reshape((t_rows, n_kv, dk))
    if qn.shape[0] > 0:
        qx = np.empty((t_rows * n_head, dk), np.float32)
        rms_norm(q.reshape((t_rows * n_head, dk)), qn, eps, qx)
        q3 = qx.reshape((t_rows, n_head, dk))
    if kn.shape[0] > 0:
        kx = np.empty((t_rows * n_kv, dk), np.float32)
        rms_norm(k.reshape((t_rows * n_kv, dk)), kn, eps, kx)
        k3 = kx.reshape((t_rows, n_kv, dk))
    qr = np.empty((t_rows, n_head, dk), np.float32)
    kr = np.empty((t_rows, n_kv, dk), np.float32)
    rotate(q3, cos, sin, dim, neox, qr)
    rotate(k3, cos, sin, dim, neox, kr)
    v3 = v.reshape((t_rows, n_kv, dv))
    for t in range(t_rows):
        p = pos[t]
        kc[p] = kr[t]
        vc[p] = v3[t]
    attend_rows(qr, kc, vc, pos, window, scale, softcap, out)
