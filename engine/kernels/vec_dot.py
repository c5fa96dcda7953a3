"""The dot products of the GEMV kernels (engine/kernels/gemv.py): one named Triton body per block type and read
pattern, as llama.cpp's mmvq.cu names a vec_dot per block type, and the helpers they share (6-bit K-quant scales,
dp4a, halfword-pair loads). `_row_dot` picks the body by the launch's QTYPE (a compile-time constant: the choice
costs nothing at run time); gemv's tuning file picks the QTYPE per launch class."""

import triton
import triton.language as tl


@triton.jit
def k_scales(base, j, mask):
    """The 6-bit scale and min of sub-block `j` (0..7) of the Q4_K/Q5_K super-blocks at `base` (uint8 pointers;
    j broadcasts against them), as float32."""
    a = tl.load(base + 4 + j, mask=mask, other=0).to(tl.int32)
    b = tl.load(base + 8 + j, mask=mask, other=0).to(tl.int32)
    c = tl.load(base + 4 + tl.where(j >= 4, j - 4, j), mask=mask, other=0).to(tl.int32)
    sc = tl.where(j < 4, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """Per 32-bit lane: the sum of the four products of a's unsigned bytes and b's signed bytes. The dp4a
    instruction on a GPU; the same sum spelled out where Triton's interpreter runs the kernel (ASM off)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip
    acc = tl.zeros_like(a)
    for i in tl.static_range(4):
        acc += ((a >> (8 * i)) & 255) * (((b >> (8 * i)) & 255).to(tl.int8).to(tl.int32))
    return acc


@triton.jit
def _halfword_pair(p16, mask):
    """The 32-bit words made of the int16 at p16 (low half) and the next (high half): word loads for blocks that
    are only 2-byte aligned."""
    lo = tl.load(p16, mask=mask, other=0).to(tl.int32) & 0xFFFF
    return lo | (tl.load(p16 + 1, mask=mask, other=0).to(tl.int32) << 16)


@triton.jit
def _f16_at(p):
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _q4k_words(w_rows, nmask, sbi, c4, w4, nsb):
    """The nibbles of super-blocks sbi [1, SB, 1, 1] of the Q4_K rows at `w_rows` [BN, 1, 1] as 32-bit words
    [BN, SB, 4, 8]: word 8c + w holds elements 4w..4w+3 of sub-blocks 2c (low nibbles) and 2c + 1 (high)."""
    # Q4_K rows and super-blocks start at multiples of 16 bytes (144 = 9 * 16): say so, for vector loads
    p = tl.multiple_of(
        (w_rows[:, :, :, None] + sbi * 144 + 16).to(tl.pointer_type(tl.int32)), [16, 16, 16, 16]
    )
    return tl.load(p + 8 * c4 + w4, mask=nmask[:, None, None, None] & (sbi < nsb), other=0)


@triton.jit
def _q4k_scales(w_rows, nmask, sb3, c3, nsb):
    """d, dmin [BN, SB, 1] and the scales and mins of sub-blocks 2c and 2c + 1 [BN, SB, 4] of super-blocks sb3."""
    bm = nmask[:, None, None] & (sb3 < nsb)
    base = w_rows + sb3 * 144
    d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
    dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
    sc_lo, mn_lo = k_scales(base, 2 * c3, bm)
    sc_hi, mn_hi = k_scales(base, 2 * c3 + 1, bm)
    return d, dmin, sc_lo, mn_lo, sc_hi, mn_hi


@triton.jit
def _dot_q4_k(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """Q4_K: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles; SB super-blocks a step (QTYPE 0)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    s4 = tl.arange(0, SB)[None, :, None, None]
    j4 = tl.arange(0, 8)[None, None, :, None]
    l4 = tl.arange(0, 32)[None, None, None, :]
    m4 = nmask[:, None, None, None]
    w4 = w_rows[:, :, :, None]
    nsb = K // 256
    for step in range(0, tl.cdiv(nsb, SB)):
        sbi = step * SB + s4
        bm = m4 & (sbi < nsb)
        base = w4 + sbi * 144
        d = tl.load((base).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        sc, mn = k_scales(base, j4, bm)
        qb = tl.load(base + 16 + 32 * (j4 // 2) + l4, mask=bm, other=0).to(tl.int32)
        q = tl.where(j4 % 2 == 1, qb >> 4, qb & 15)
        w = d * sc * q.to(tl.float32) - dmin * mn
        x = tl.load(x_rows[:, :, :, None] + sbi * 256 + j4 * 32 + l4, mask=sbi < nsb, other=0.0).to(
            tl.float32
        )
        acc += tl.sum(tl.sum(tl.sum(w * x, axis=3), axis=2), axis=1)
    return acc


@triton.jit
def _dot_q4_k_bytes(
    w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr
):
    """Q4_K reading each byte once: low nibbles are sub-block 2c, high nibbles 2c + 1 (QTYPE 5)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    s4 = tl.arange(0, SB)[None, :, None, None]
    c4 = tl.arange(0, 4)[None, None, :, None]
    l4 = tl.arange(0, 32)[None, None, None, :]
    m4 = nmask[:, None, None, None]
    w4 = w_rows[:, :, :, None]
    x4 = x_rows[:, :, :, None]
    nsb = K // 256
    for step in range(0, tl.cdiv(nsb, SB)):
        sbi = step * SB + s4
        bm = m4 & (sbi < nsb)
        base = w4 + sbi * 144  # [BN, SB, 1, 1]
        d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        sc_lo, mn_lo = k_scales(base, 2 * c4, bm)  # [BN, SB, 4, 1]
        sc_hi, mn_hi = k_scales(base, 2 * c4 + 1, bm)
        qb = tl.load(base + 16 + 32 * c4 + l4, mask=bm, other=0).to(tl.int32)  # [BN, SB, 4, 32]
        xm = sbi < nsb
        xl = tl.load(x4 + sbi * 256 + 64 * c4 + l4, mask=xm, other=0.0).to(tl.float32)
        xh = tl.load(x4 + sbi * 256 + 64 * c4 + 32 + l4, mask=xm, other=0.0).to(tl.float32)
        dot_lo = tl.sum((qb & 15).to(tl.float32) * xl, axis=3)[:, :, :, None]
        dot_hi = tl.sum((qb >> 4).to(tl.float32) * xh, axis=3)[:, :, :, None]
        sum_lo = tl.sum(xl, axis=3)[:, :, :, None]
        sum_hi = tl.sum(xh, axis=3)[:, :, :, None]
        part = d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (mn_lo * sum_lo + mn_hi * sum_hi)
        acc += tl.sum(tl.sum(tl.sum(part, axis=3), axis=2), axis=1)
    return acc


@triton.jit
def _dot_q4_k_words(
    w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr
):
    """Q4_K, the nibbles read as 32-bit words (wide loads: more bytes in flight per load) (QTYPE 10)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    s4 = tl.arange(0, SB)[None, :, None, None]
    c4 = tl.arange(0, 4)[None, None, :, None]
    w4 = tl.arange(0, 8)[None, None, None, :]
    b5 = tl.arange(0, 4)[None, None, None, None, :]
    s3 = tl.arange(0, SB)[None, :, None]
    c3 = tl.arange(0, 4)[None, None, :]
    x5 = x_rows[:, :, :, None, None]
    nsb = K // 256
    for step in range(0, tl.cdiv(nsb, SB)):
        sbi = step * SB + s4
        words = _q4k_words(w_rows, nmask, sbi, c4, w4, nsb)[:, :, :, :, None]  # [BN, SB, 4, 8, 1]
        sh = 8 * b5
        q_lo = ((words >> sh) & 15).to(tl.float32)
        q_hi = ((words >> (sh + 4)) & 15).to(tl.float32)
        sb5 = sbi[:, :, :, :, None]
        xoff = sb5 * 256 + 64 * c4[:, :, :, :, None] + 4 * w4[:, :, :, :, None] + b5
        xm = sb5 < nsb
        x_lo = tl.load(x5 + xoff, mask=xm, other=0.0).to(tl.float32)  # [1, SB, 4, 8, 4]
        x_hi = tl.load(x5 + xoff + 32, mask=xm, other=0.0).to(tl.float32)
        dot_lo = tl.sum(tl.sum(q_lo * x_lo, axis=4), axis=3)  # [BN, SB, 4]
        dot_hi = tl.sum(tl.sum(q_hi * x_hi, axis=4), axis=3)
        sum_lo = tl.sum(tl.sum(x_lo, axis=4), axis=3)  # [1, SB, 4]
        sum_hi = tl.sum(tl.sum(x_hi, axis=4), axis=3)
        d, dmin, sc_lo, mn_lo, sc_hi, mn_hi = _q4k_scales(w_rows, nmask, step * SB + s3, c3, nsb)
        part = d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (mn_lo * sum_lo + mn_hi * sum_hi)
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    return acc


@triton.jit
def _dot_q4_k_q8(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """Q4_K against 8-bit activations (quantize_q8), four products an instruction (dp4a) (QTYPE 12)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # x_rows points at a row packed by quantize_q8: K int8 values, then (scale, scale * sum of q) per 32.
    s4 = tl.arange(0, SB)[None, :, None, None]
    c4 = tl.arange(0, 4)[None, None, :, None]
    w4 = tl.arange(0, 8)[None, None, None, :]
    s3 = tl.arange(0, SB)[None, :, None]
    c3 = tl.arange(0, 4)[None, None, :]
    xw = x_rows.to(tl.pointer_type(tl.int32))[:, :, :, None]
    meta = (x_rows.to(tl.pointer_type(tl.int8)) + K).to(tl.pointer_type(tl.float32))  # [1, 1, 1]
    nsb = K // 256
    for step in range(0, tl.cdiv(nsb, SB)):
        sbi = step * SB + s4
        words = _q4k_words(w_rows, nmask, sbi, c4, w4, nsb)  # [BN, SB, 4, 8]
        xm = sbi < nsb
        x_lo = tl.load(xw + sbi * 64 + 16 * c4 + w4, mask=xm, other=0)  # [1, SB, 4, 8]: 4 int8 each
        x_hi = tl.load(xw + sbi * 64 + 16 * c4 + 8 + w4, mask=xm, other=0)
        dot_lo = tl.sum(_dp4a(words & 0x0F0F0F0F, x_lo, ASM), axis=3).to(tl.float32)  # [BN, SB, 4]
        dot_hi = tl.sum(_dp4a((words >> 4) & 0x0F0F0F0F, x_hi, ASM), axis=3).to(tl.float32)
        sb3 = step * SB + s3
        blk = (sb3 * 8 + 2 * c3) * 2  # [1, SB, 4]: the low sub-block's (scale, sum) pair
        mm = sb3 < nsb
        dx_lo = tl.load(meta + blk, mask=mm, other=0.0)
        sx_lo = tl.load(meta + blk + 1, mask=mm, other=0.0)
        dx_hi = tl.load(meta + blk + 2, mask=mm, other=0.0)
        sx_hi = tl.load(meta + blk + 3, mask=mm, other=0.0)
        d, dmin, sc_lo, mn_lo, sc_hi, mn_hi = _q4k_scales(w_rows, nmask, sb3, c3, nsb)
        part = d * (sc_lo * dx_lo * dot_lo + sc_hi * dx_hi * dot_hi) - dmin * (mn_lo * sx_lo + mn_hi * sx_hi)
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    return acc


@triton.jit
def _dot_q6_k_q8(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """Q6_K on 8-bit activations (dp4a); its 2-byte aligned blocks read as halfword pairs (QTYPE 13)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # word 16h + 8a + 4g + u of the low bits holds elements 128h + 32a + 16g + 4u + b (low nibbles) and + 64
    # (high nibbles) in its bytes b; word 8h + 4g + u of the high bits holds their top two bits at 2a (+ 4)
    s6 = tl.arange(0, SB)[None, :, None, None, None, None]
    h6 = tl.arange(0, 2)[None, None, :, None, None, None]
    a6 = tl.arange(0, 2)[None, None, None, :, None, None]
    g6 = tl.arange(0, 2)[None, None, None, None, :, None]  # 16-element scale group within 32
    u6 = tl.arange(0, 4)[None, None, None, None, None, :]
    n6 = nmask[:, None, None, None, None, None]
    r6 = w_rows[:, :, :, None, None, None]
    xw = x_rows.to(tl.pointer_type(tl.int32))[:, :, :, None, None, None]
    meta = (x_rows.to(tl.pointer_type(tl.int8)) + K).to(tl.pointer_type(tl.float32))[:, :, :, None, None]
    s5 = tl.arange(0, SB)[None, :, None, None, None]
    h5 = tl.arange(0, 2)[None, None, :, None, None]
    a5 = tl.arange(0, 2)[None, None, None, :, None]
    g5 = tl.arange(0, 2)[None, None, None, None, :]
    nsb = K // 256
    for step in range(0, tl.cdiv(nsb, SB)):
        sbi = step * SB + s6
        bm = n6 & (sbi < nsb)
        p16 = (r6 + sbi * 210).to(tl.pointer_type(tl.int16))
        ql = _halfword_pair(p16 + 32 * h6 + 16 * a6 + 8 * g6 + 2 * u6, bm)  # the low bits' words
        qh = _halfword_pair(p16 + 64 + 16 * h6 + 8 * g6 + 2 * u6, bm)  # the high bits' words
        q_lo = (ql & 0x0F0F0F0F) | (((qh >> (2 * a6)) & 0x03030303) << 4)  # unsigned 0..63 a byte
        q_hi = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (2 * a6 + 4)) & 0x03030303) << 4)
        xm = sbi < nsb
        xo = sbi * 64 + 32 * h6 + 8 * a6 + 4 * g6 + u6
        x_lo = tl.load(xw + xo, mask=xm, other=0)
        x_hi = tl.load(xw + xo + 16, mask=xm, other=0)
        off = tl.full(q_lo.shape, 0x20202020, tl.int32)  # each code's -32, as a dot product of its own
        dot_lo = tl.sum(_dp4a(q_lo, x_lo, ASM) - _dp4a(off, x_lo, ASM), axis=5).to(tl.float32)
        dot_hi = tl.sum(_dp4a(q_hi, x_hi, ASM) - _dp4a(off, x_hi, ASM), axis=5).to(tl.float32)
        sb5 = step * SB + s5
        b5 = nmask[:, None, None, None, None] & (sb5 < nsb)
        base5 = (w_rows[:, :, :, None, None] + sb5 * 210).to(tl.pointer_type(tl.int8))
        sc_lo = tl.load(base5 + 192 + 8 * h5 + 2 * a5 + g5, mask=b5, other=0).to(tl.float32)
        sc_hi = tl.load(base5 + 196 + 8 * h5 + 2 * a5 + g5, mask=b5, other=0).to(tl.float32)
        d = tl.load((base5 + 208).to(tl.pointer_type(tl.float16)), mask=b5, other=0.0).to(tl.float32)
        blk = (sb5 * 8 + 4 * h5 + a5) * 2  # the low nibbles' 32-element x block (high: 2 blocks on)
        mm = sb5 < nsb
        dx_lo = tl.load(meta + blk, mask=mm, other=0.0)
        dx_hi = tl.load(meta + blk + 4, mask=mm, other=0.0)
        part = d * (dx_lo * sc_lo * dot_lo + dx_hi * sc_hi * dot_hi)
        acc += tl.sum(tl.sum(tl.sum(tl.sum(part, axis=4), axis=3), axis=2), axis=1)
    return acc


@triton.jit
def _dot_f32(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """Float32 rows (the MoE router) (QTYPE 6)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k3 = tl.arange(0, 256 * SB)[None, None, :]
    m3k = nmask[:, None, None]
    for k0 in range(0, K, 256 * SB):
        kk = k0 + k3
        w = tl.load(w_rows.to(tl.pointer_type(tl.float32)) + kk, mask=m3k & (kk < K), other=0.0)
        x = tl.load(x_rows + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(w * x, axis=2), axis=1)
    return acc


@triton.jit
def _dot_q6_k(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d; SB a step (QTYPE 1)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    s5 = tl.arange(0, SB)[None, :, None, None, None]
    h5 = tl.arange(0, 2)[None, None, :, None, None]
    q5 = tl.arange(0, 4)[None, None, None, :, None]
    l5 = tl.arange(0, 32)[None, None, None, None, :]
    n5 = nmask[:, None, None, None, None]
    w5 = w_rows[:, :, :, None, None]
    nsb = K // 256
    for step in range(0, tl.cdiv(nsb, SB)):
        sb5 = step * SB + s5
        bm = n5 & (sb5 < nsb)
        base = w5 + sb5 * 210
        d = tl.load((base + 208).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        ql = tl.load(base + 64 * h5 + 32 * (q5 % 2) + l5, mask=bm, other=0).to(tl.int32)
        qh = tl.load(base + 128 + 32 * h5 + l5, mask=bm, other=0).to(tl.int32)
        lo = tl.where(q5 >= 2, ql >> 4, ql & 15)
        q = (lo | (((qh >> (2 * q5)) & 3) << 4)) - 32
        sc = tl.load((base + 192 + 8 * h5 + l5 // 16 + 2 * q5).to(tl.pointer_type(tl.int8)), mask=bm, other=0)
        w = d * sc.to(tl.float32) * q.to(tl.float32)
        x = tl.load(
            x_rows[:, :, :, None, None] + sb5 * 256 + 128 * h5 + 32 * q5 + l5, mask=sb5 < nsb, other=0.0
        ).to(tl.float32)
        acc += tl.sum(tl.sum(tl.sum(tl.sum(w * x, axis=4), axis=3), axis=2), axis=1)
    return acc


@triton.jit
def _dot_q6_k_halfwords(
    w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr
):
    """Q6_K with the bits read as 16-bit words (its 210-byte blocks are only 2-byte aligned) (QTYPE 11)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # halfword 32h + 16a + w of the low bits holds elements 128h + 32a + 2w + b (low nibbles) and + 64 (high
    # nibbles) in its bytes b; halfword 16h + w of the high bits holds their top two bits at 2q (q = a or a + 2)
    s6 = tl.arange(0, SB)[None, :, None, None, None, None]
    h6 = tl.arange(0, 2)[None, None, :, None, None, None]
    a6 = tl.arange(0, 2)[None, None, None, :, None, None]
    w6 = tl.arange(0, 16)[None, None, None, None, :, None]
    b6 = tl.arange(0, 2)[None, None, None, None, None, :]
    n6 = nmask[:, None, None, None, None, None]
    r6 = w_rows[:, :, :, None, None, None]
    x6 = x_rows[:, :, :, None, None, None]
    nsb = K // 256
    for step in range(0, tl.cdiv(nsb, SB)):
        sbi = step * SB + s6
        bm = n6 & (sbi < nsb)
        base = r6 + sbi * 210
        p16 = base.to(tl.pointer_type(tl.int16))
        ql = tl.load(p16 + 32 * h6 + 16 * a6 + w6, mask=bm, other=0).to(tl.int32)  # [BN, SB, 2, 2, 16, 1]
        qh = tl.load(p16 + 64 + 16 * h6 + w6, mask=bm, other=0).to(tl.int32)  # [BN, SB, 2, 1, 16, 1]
        sh = 8 * b6
        hb = qh >> (sh + 2 * a6)
        q_a = (((ql >> sh) & 15) | ((hb & 3) << 4)) - 32
        q_b = (((ql >> (sh + 4)) & 15) | (((hb >> 4) & 3) << 4)) - 32
        d = tl.load((base + 208).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        scp = (base + 192 + 8 * h6 + 2 * a6 + w6 // 8).to(tl.pointer_type(tl.int8))
        sc_a = tl.load(scp, mask=bm, other=0).to(tl.float32)
        sc_b = tl.load(scp + 4, mask=bm, other=0).to(tl.float32)
        xm = sbi < nsb
        xoff = sbi * 256 + 128 * h6 + 32 * a6 + 2 * w6 + b6
        x_a = tl.load(x6 + xoff, mask=xm, other=0.0).to(tl.float32)
        x_b = tl.load(x6 + xoff + 64, mask=xm, other=0.0).to(tl.float32)
        part = d * (sc_a * q_a.to(tl.float32) * x_a + sc_b * q_b.to(tl.float32) * x_b)
        acc += tl.sum(tl.sum(tl.sum(tl.sum(tl.sum(part, axis=5), axis=4), axis=3), axis=2), axis=1)
    return acc


@triton.jit
def _dot_q5_k(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """Q5_K: as Q4_K plus 32 bytes of high bits before the nibbles (QTYPE 4)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    j = tl.arange(0, 8)[None, :, None]  # sub-block (or 32-element block) within a 256-element step
    l32 = tl.arange(0, 32)[None, None, :]
    m3 = nmask[:, None, None]
    for sb in range(0, K // 256):
        base = w_rows + sb * 176
        d = tl.load((base).to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
        dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
        sc, mn = k_scales(base, j, m3)
        qb = tl.load(base + 48 + 32 * (j // 2) + l32, mask=m3, other=0).to(tl.int32)
        qh = tl.load(base + 16 + l32, mask=m3, other=0).to(tl.int32)
        q = tl.where(j % 2 == 1, qb >> 4, qb & 15) + (((qh >> j) & 1) << 4)
        w = d * sc * q.to(tl.float32) - dmin * mn
        x = tl.load(x_rows + sb * 256 + j * 32 + l32).to(tl.float32)
        acc += tl.sum(tl.sum(w * x, axis=2), axis=1)
    return acc


@triton.jit
def _dot_mxfp4(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """MXFP4: an e8m0 scale byte + 16 bytes of 4-bit codes (lo_hi order), eight blocks a step (QTYPE 8)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    j = tl.arange(0, 8)[None, :, None]  # sub-block (or 32-element block) within a 256-element step
    l32 = tl.arange(0, 32)[None, None, :]
    m3 = nmask[:, None, None]
    nblk = K // 32
    for step in range(0, tl.cdiv(nblk, 8)):
        blk = step * 8 + j
        bm = m3 & (blk < nblk)
        base = w_rows + blk * 17
        e = tl.load(base, mask=bm, other=0).to(tl.int32)
        # 2^(e - 128), the code values being doubled; e < 2 gives the subnormals gguf's dequantizer gives
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        qb = tl.load(base + 1 + (l32 % 16), mask=bm, other=0).to(tl.int32)
        q = tl.load(lut + tl.where(l32 >= 16, qb >> 4, qb & 15))
        x = tl.load(x_rows + blk * 32 + l32, mask=blk < nblk, other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(d * q * x, axis=2), axis=1)
    return acc


@triton.jit
def _dot_iq4_xs(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """IQ4_XS: d, 2 + 4 bytes of 6-bit sub-block scales, 128 bytes of IQ4_NL codes (QTYPE 9)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    j = tl.arange(0, 8)[None, :, None]  # sub-block (or 32-element block) within a 256-element step
    l32 = tl.arange(0, 32)[None, None, :]
    m3 = nmask[:, None, None]
    for sb in range(0, K // 256):
        base = w_rows + sb * 136
        d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
        sh = tl.load(base + 2, mask=m3, other=0).to(tl.int32) | (
            tl.load(base + 3, mask=m3, other=0).to(tl.int32) << 8
        )
        sl = (tl.load(base + 4 + j // 2, mask=m3, other=0).to(tl.int32) >> (4 * (j % 2))) & 15
        ls = sl | (((sh >> (2 * j)) & 3) << 4)  # [BN, 8, 1]
        qb = tl.load(base + 8 + 16 * j + (l32 % 16), mask=m3, other=0).to(tl.int32)
        q = tl.load(lut + tl.where(l32 >= 16, qb >> 4, qb & 15))
        x = tl.load(x_rows + sb * 256 + 32 * j + l32).to(tl.float32)
        acc += tl.sum(tl.sum(d * (ls - 32).to(tl.float32) * q * x, axis=2), axis=1)
    return acc


@triton.jit
def _dot_q8_0(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """Q8_0: d (f16) + 32 int8, eight blocks a step (QTYPE 2)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    j = tl.arange(0, 8)[None, :, None]  # sub-block (or 32-element block) within a 256-element step
    l32 = tl.arange(0, 32)[None, None, :]
    m3 = nmask[:, None, None]
    nblk = K // 32
    for step in range(0, tl.cdiv(nblk, 8)):
        blk = step * 8 + j
        bm = m3 & (blk < nblk)
        base = w_rows + blk * 34
        d = tl.load((base).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        q = tl.load((base + 2 + l32).to(tl.pointer_type(tl.int8)), mask=bm, other=0).to(tl.float32)
        x = tl.load(x_rows + blk * 32 + l32, mask=blk < nblk, other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(d * q * x, axis=2), axis=1)
    return acc


@triton.jit
def _dot_q4_0(w_rows, x_rows, K, nmask, lut, BLOCK_N: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """Q4_0: d (f16) + 16 bytes; element l < 16 low nibble of byte l, else high nibble of byte l - 16 (the other QTYPEs)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    j = tl.arange(0, 8)[None, :, None]  # sub-block (or 32-element block) within a 256-element step
    l32 = tl.arange(0, 32)[None, None, :]
    m3 = nmask[:, None, None]
    nblk = K // 32
    for step in range(0, tl.cdiv(nblk, 8)):
        blk = step * 8 + j
        bm = m3 & (blk < nblk)
        base = w_rows + blk * 18
        d = tl.load((base).to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        qb = tl.load(base + 2 + (l32 % 16), mask=bm, other=0).to(tl.int32)
        q = tl.where(l32 >= 16, qb >> 4, qb & 15) - 8
        x = tl.load(x_rows + blk * 32 + l32, mask=blk < nblk, other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(d * q.to(tl.float32) * x, axis=2), axis=1)
    return acc


@triton.jit
def _row_dot(
    w_rows,
    x_rows,
    K,
    nmask,
    lut,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    ASM: tl.constexpr = True,
):
    """sum_k W[n, k] * x[k] for the BLOCK_N rows starting at the uint8 pointers `w_rows` [BLOCK_N, 1, 1]: one
    named body per block type and read pattern (the QTYPE ids are gemv's launch variants; the tuning file picks
    them per launch class), as llama.cpp's mmvq.cu names a vec_dot per block type."""
    if QTYPE == 0:
        return _dot_q4_k(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 5:
        return _dot_q4_k_bytes(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 10:
        return _dot_q4_k_words(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 12:
        return _dot_q4_k_q8(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 13:
        return _dot_q6_k_q8(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 6:
        return _dot_f32(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 1:
        return _dot_q6_k(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 11:
        return _dot_q6_k_halfwords(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 4:
        return _dot_q5_k(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 8:
        return _dot_mxfp4(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 9:
        return _dot_iq4_xs(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    elif QTYPE == 2:
        return _dot_q8_0(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
    else:
        return _dot_q4_0(w_rows, x_rows, K, nmask, lut, BLOCK_N, SB, ASM)
