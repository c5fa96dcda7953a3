"""Grouped MoE matrix multiply for prompt chunks: every routed expert of a layer in one launch per projection, on
tensor cores, dequantizing each expert's GGUF blocks tile by tile in registers.

The (token, slot) pairs of a chunk are sorted by expert on the device and cut into blocks of BLOCK_M rows of one
expert; each program multiplies one block by one BLOCK_N-row tile of that expert's weight, reading the weight
through the expert cache's address table (a VRAM slot, or pinned host memory over PCIe). No host synchronisation
and no dequantized copy of any expert: the chunk's routing decides the work on the device."""

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT

from engine.kernels.gemv import _GLU
from engine.kernels.moe_blocks import BLOCK_M, Blocks
from engine.kernels.tuning import tuned
from engine.kernels.vec_dot import k_scales

# Block types with a tile dequantizer here (K a multiple of 256): id as in engine.kernels.gemv.
TILE_TYPES = {QT.Q4_K: 0, QT.Q6_K: 1, QT.Q8_0: 2, QT.Q4_0: 3, QT.Q5_K: 4, QT.MXFP4: 8, QT.IQ4_XS: 9}
_BLOCK32 = {QT.Q8_0, QT.Q4_0, QT.MXFP4}  # 32-element blocks: any K that is a multiple of 32
TILE_VARIANTS = {QT.Q4_K: (0, 10)}  # other tile decoders of a type, chosen by the tuning file


@triton.jit
def _code_value(q, QTYPE: tl.constexpr):
    """The code value of 4-bit codes q (int32) of the lookup-table types, computed rather than gathered from the
    table (the GEMV bodies gather; gathered values feeding tl.dot failed on an H200): MXFP4's E2M1 doubled (as
    gguf's table holds it), IQ4_NL's sixteen levels through a tree of selects."""
    if QTYPE == 8:
        c = q & 7
        mag = tl.where(c < 4, c, tl.where(c < 6, 2 * c - 4, 4 * c - 16))
        v = tl.where((q & 8) != 0, -mag, mag)
    else:
        b0, b1, b2 = (q & 1) != 0, (q & 2) != 0, (q & 4) != 0
        hi = tl.where(
            b2,
            tl.where(b1, tl.where(b0, 113, 89), tl.where(b0, 69, 53)),
            tl.where(b1, tl.where(b0, 38, 25), tl.where(b0, 13, 1)),
        )
        lo = tl.where(
            b2,
            tl.where(b1, tl.where(b0, -10, -22), tl.where(b0, -35, -49)),
            tl.where(b1, tl.where(b0, -65, -83), tl.where(b0, -104, -127)),
        )
        v = tl.where((q & 8) != 0, hi, lo)
    return v.to(tl.float32)


@triton.jit
def _deq_tile(w_rows, sb, nmask, K, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Elements sb*256 .. sb*256+255 of the BLOCK_N rows at uint8 pointers `w_rows` [BLOCK_N, 1, 1] -> float32
    [BLOCK_N, 256] (rows off `nmask`, and 32-element blocks past K, read as zero)."""
    m3 = nmask[:, None, None]
    j = tl.arange(0, 8)[None, :, None]  # 32-element sub-block (or Q8_0/Q4_0 block) within the 256
    l32 = tl.arange(0, 32)[None, None, :]
    if QTYPE == 0:  # Q4_K
        base = w_rows + sb * 144
        d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
        dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
        sc, mn = k_scales(base, j, m3)
        qb = tl.load(base + 16 + 32 * (j // 2) + l32, mask=m3, other=0).to(tl.int32)
        q = tl.where(j % 2 == 1, qb >> 4, qb & 15).to(tl.float32)
        w = d * sc * q - dmin * mn
    elif QTYPE == 10:  # Q4_K with the nibbles read as 32-bit words (elements 64c + 32h + 4w + b, in order)
        c5 = tl.arange(0, 4)[None, :, None, None, None]
        h5 = tl.arange(0, 2)[None, None, :, None, None]
        w5 = tl.arange(0, 8)[None, None, None, :, None]
        b5 = tl.arange(0, 4)[None, None, None, None, :]
        n5 = nmask[:, None, None, None, None]
        base = w_rows[:, :, :, None, None] + sb * 144
        p = tl.multiple_of((base + 16).to(tl.pointer_type(tl.int32)), [16, 16, 16, 16, 16])
        words = tl.load(p + 8 * c5 + w5, mask=n5, other=0)  # [BN, 4, 1, 8, 1]
        q = ((words >> (8 * b5 + 4 * h5)) & 15).to(tl.float32)  # [BN, 4, 2, 8, 4]
        d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=n5, other=0.0).to(tl.float32)
        dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=n5, other=0.0).to(tl.float32)
        sc, mn = k_scales(base, 2 * c5 + h5, n5)  # [BN, 4, 2, 1, 1]
        w = d * sc * q - dmin * mn
    elif QTYPE == 4:  # Q5_K: Q4_K plus a high bit per element
        base = w_rows + sb * 176
        d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
        dmin = tl.load((base + 2).to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
        sc, mn = k_scales(base, j, m3)
        qb = tl.load(base + 48 + 32 * (j // 2) + l32, mask=m3, other=0).to(tl.int32)
        qh = tl.load(base + 16 + l32, mask=m3, other=0).to(tl.int32)
        q = (tl.where(j % 2 == 1, qb >> 4, qb & 15) + (((qh >> j) & 1) << 4)).to(tl.float32)
        w = d * sc * q - dmin * mn
    elif QTYPE == 1:  # Q6_K: element 128h + 32qq + l
        h4 = tl.arange(0, 2)[None, :, None, None]
        q4 = tl.arange(0, 4)[None, None, :, None]
        l4 = tl.arange(0, 32)[None, None, None, :]
        base = w_rows[:, :, :, None] + sb * 210
        m4 = nmask[:, None, None, None]
        d = tl.load((base + 208).to(tl.pointer_type(tl.float16)), mask=m4, other=0.0).to(tl.float32)
        ql = tl.load(base + 64 * h4 + 32 * (q4 % 2) + l4, mask=m4, other=0).to(tl.int32)
        qh = tl.load(base + 128 + 32 * h4 + l4, mask=m4, other=0).to(tl.int32)
        lo = tl.where(q4 >= 2, ql >> 4, ql & 15)
        q = ((lo | (((qh >> (2 * q4)) & 3) << 4)) - 32).to(tl.float32)
        s8 = tl.load((base + 192 + 8 * h4 + l4 // 16 + 2 * q4).to(tl.pointer_type(tl.int8)), mask=m4, other=0)
        w = d * s8.to(tl.float32) * q
    elif QTYPE == 9:  # IQ4_XS: 6-bit sub-block scales, IQ4_NL codes
        base = w_rows + sb * 136
        d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=m3, other=0.0).to(tl.float32)
        sh = tl.load(base + 2, mask=m3, other=0).to(tl.int32) | (
            tl.load(base + 3, mask=m3, other=0).to(tl.int32) << 8
        )
        sl = (tl.load(base + 4 + j // 2, mask=m3, other=0).to(tl.int32) >> (4 * (j % 2))) & 15
        ls = sl | (((sh >> (2 * j)) & 3) << 4)
        qb = tl.load(base + 8 + 16 * j + (l32 % 16), mask=m3, other=0).to(tl.int32)
        w = d * (ls - 32).to(tl.float32) * _code_value(tl.where(l32 >= 16, qb >> 4, qb & 15), QTYPE)
    elif QTYPE == 2:  # Q8_0: eight 34-byte blocks
        bm = m3 & (sb * 8 + j < K // 32)
        base = w_rows + (sb * 8 + j) * 34
        d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        q = tl.load((base + 2 + l32).to(tl.pointer_type(tl.int8)), mask=bm, other=0).to(tl.float32)
        w = d * q
    elif QTYPE == 8:  # MXFP4: eight 17-byte blocks, e8m0 scales
        bm = m3 & (sb * 8 + j < K // 32)
        base = w_rows + (sb * 8 + j) * 17
        e = tl.load(base, mask=bm, other=0).to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        qb = tl.load(base + 1 + (l32 % 16), mask=bm, other=0).to(tl.int32)
        w = tl.where(bm, d * _code_value(tl.where(l32 >= 16, qb >> 4, qb & 15), QTYPE), 0.0)
    else:  # Q4_0: eight 18-byte blocks
        bm = m3 & (sb * 8 + j < K // 32)
        base = w_rows + (sb * 8 + j) * 18
        d = tl.load(base.to(tl.pointer_type(tl.float16)), mask=bm, other=0.0).to(tl.float32)
        qb = tl.load(base + 2 + (l32 % 16), mask=bm, other=0).to(tl.int32)
        w = d * (tl.where(l32 >= 16, qb >> 4, qb & 15) - 8).to(tl.float32)
    return tl.reshape(w, [BLOCK_N, 256])


@triton.jit
def _moe_gemm_kernel(
    table_ptr,  # int64 [E]: address of each expert's first row
    table2_ptr,  # int64 [E]: the up projection's (GLU)
    row_bytes,
    x_ptr,  # [T, K] (slots read their token's row) or [S, K] (X_PER_SLOT)
    order_ptr,  # int64 [S]: slots sorted by expert
    blk_expert_ptr,  # int64 [MAXB]
    blk_start_ptr,  # int64 [MAXB]: first sorted position of the block
    blk_end_ptr,  # int64 [MAXB]: one past its last
    nblocks_ptr,  # int64 [1]: blocks in use
    y_ptr,  # [S, N]
    N,
    K,
    TOPK,
    QTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    X_PER_SLOT: tl.constexpr,
    GLU: tl.constexpr,  # 0: plain, 1: silu(gate) * up, 2: gelu_tanh(gate) * up
    IEEE: tl.constexpr,  # float32 activations: no TF32 rounding
):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    if b < tl.load(nblocks_ptr):
        e = tl.load(blk_expert_ptr + b)
        m = tl.load(blk_start_ptr + b) + tl.arange(0, BLOCK_M)
        mm = m < tl.load(blk_end_ptr + b)
        slot = tl.load(order_ptr + m, mask=mm, other=0)  # [BLOCK_M]
        xrow = slot if X_PER_SLOT else slot // TOPK
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        w_rows = (tl.load(table_ptr + e).to(tl.pointer_type(tl.uint8)) + n.to(tl.int64) * row_bytes)[
            :, None, None
        ]
        u_rows = (tl.load(table2_ptr + e).to(tl.pointer_type(tl.uint8)) + n.to(tl.int64) * row_bytes)[
            :, None, None
        ]
        k256 = tl.arange(0, 256)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for sb in range(0, tl.cdiv(K, 256)):
            kk = sb * 256 + k256[None, :]
            xt = tl.load(x_ptr + xrow[:, None].to(tl.int64) * K + kk, mask=mm[:, None] & (kk < K), other=0.0)
            wt = _deq_tile(w_rows, sb, nm, K, QTYPE, BLOCK_N)
            if IEEE:
                acc += tl.dot(xt, tl.trans(wt), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(wt.to(xt.dtype)))
            if GLU != 0:
                ut = _deq_tile(u_rows, sb, nm, K, QTYPE, BLOCK_N)
                if IEEE:
                    acc2 += tl.dot(xt, tl.trans(ut), input_precision="ieee")
                else:
                    acc2 += tl.dot(xt, tl.trans(ut.to(xt.dtype)))
        if GLU == 1:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2
        elif GLU == 2:
            inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = 0.5 * acc * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0)) * acc2
        out = y_ptr + slot[:, None].to(tl.int64) * N + n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _block_table_kernel(
    counts_ptr, expert_ptr, start_ptr, end_ptr, nblocks_ptr, E, MAXB,
    BLOCK_M: tl.constexpr, EP: tl.constexpr, BB: tl.constexpr,
):  # fmt: skip
    """Blocks b0..b0+BB of the table, one program each BB: the per-expert slot counts -> for each block b, its
    expert, first and one-past-last sorted position; and (program 0) the number of blocks in use. Block b belongs
    to the expert whose cumulative block count first exceeds b (searchsorted, right). Every program recomputes
    the E-long sums (cheaper than a second launch); int32 lanes and [BB, EP] tiles small enough for registers
    (one program walking all blocks in [64, EP] int64 tiles spilled: 60 us a layer on an H200)."""
    e = tl.arange(0, EP)
    em = e < E
    cnt = tl.load(counts_ptr + e, mask=em, other=0).to(tl.int32)
    nblk = (cnt + BLOCK_M - 1) // BLOCK_M
    cum_blk = tl.cumsum(nblk, axis=0)  # [EP]
    first = tl.cumsum(cnt, axis=0) - cnt  # first sorted position of each expert
    if tl.program_id(0) == 0:
        tl.store(nblocks_ptr, tl.sum(nblk, axis=0).to(tl.int64))
    b = tl.program_id(0) * BB + tl.arange(0, BB)  # [BB]
    # experts whose blocks all lie at or before b: the expert of b is their count (clamped)
    ex = tl.sum(((cum_blk[None, :] <= b[:, None]) & em[None, :]).to(tl.int32), axis=1)
    ex = tl.minimum(ex, E - 1)
    pick = e[None, :] == ex[:, None]  # [BB, EP] one-hot
    c_first = tl.sum(tl.where(pick, first[None, :], 0), axis=1)
    c_cnt = tl.sum(tl.where(pick, cnt[None, :], 0), axis=1)
    c_blk0 = tl.sum(tl.where(pick, (cum_blk - nblk)[None, :], 0), axis=1)
    start = c_first + (b - c_blk0) * BLOCK_M
    end = tl.minimum(start + BLOCK_M, c_first + c_cnt)
    m = b < MAXB
    tl.store(expert_ptr + b, ex.to(tl.int64), mask=m)
    tl.store(start_ptr + b, start.to(tl.int64), mask=m)
    tl.store(end_ptr + b, end.to(tl.int64), mask=m)


def block_table(
    counts: torch.Tensor, max_blocks: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Blocks schedule (engine/kernels/moe_blocks.py) in one launch: counts [E] -> expert, start, end
    [max_blocks], nblocks [1], int64."""
    dev = counts.device
    out = torch.empty(3, max_blocks, dtype=torch.int64, device=dev)
    nblocks = torch.empty(1, dtype=torch.int64, device=dev)
    e = counts.numel()
    ep = triton.next_power_of_2(e)
    bb = max(1, min(16, 2048 // ep))
    _block_table_kernel[(triton.cdiv(max_blocks, bb),)](
        counts, out[0], out[1], out[2], nblocks, e, max_blocks, BLOCK_M=block_m, EP=ep, BB=bb, num_warps=4,
    )  # fmt: skip
    return out[0], out[1], out[2], nblocks


@triton.jit
def _expert_order_kernel(ids_ptr, counts_ptr, order_ptr, S, E, EP: tl.constexpr, TILE: tl.constexpr):
    """Program e: the positions of the (token, slot) pairs that chose expert e, in index order, written from its
    first sorted position on (the exclusive sum of the counts of the experts before it): what a stable argsort of
    the ids by expert gives, in one launch instead of a radix sort's."""
    ex = tl.program_id(0)
    e = tl.arange(0, EP)
    before = tl.sum(tl.load(counts_ptr + e, mask=e < ex, other=0), axis=0)  # int64
    offs = tl.arange(0, TILE)
    for s0 in range(0, S, TILE):
        s = s0 + offs
        hit = (tl.load(ids_ptr + s, mask=s < S, other=-1) == ex).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit  # exclusive: the hits before this one in the tile
        tl.store(order_ptr + before + rank, s.to(tl.int64), mask=hit != 0)
        before += tl.sum(hit, axis=0)


def expert_order(flat: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """flat [S] expert ids, counts [E] (int64, how many of each) -> order [S] int64: torch.argsort(flat,
    stable=True), one program per expert."""
    s, e = flat.numel(), counts.numel()
    order = torch.empty(s, dtype=torch.int64, device=flat.device)
    _expert_order_kernel[(e,)](
        flat.contiguous(), counts, order, s, e, EP=triton.next_power_of_2(e), TILE=1024
    )
    return order


BLOCK_N = 64


def tile_variant(qtype: QT) -> int:
    """The tile decoder of a block type for the grouped kernel: its own, or another body the tuning file names
    (engine/kernels/gemv_tuned.json, "moe_gemm"; bench/moe_gemm_micro.py measures them)."""
    got = _tuned_entry(qtype)
    return got[0] if got and got[0] in TILE_VARIANTS.get(qtype, ()) else TILE_TYPES[qtype]


def tile_launch(qtype: QT) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages; 0 = Triton's default) of the grouped kernel for a block type: the tuning file's
    "moe_gemm": [decoder, BLOCK_N, warps, stages] where it names them (bench/moe_gemm_micro.py --sweep)."""
    got = _tuned_entry(qtype)
    return (got[1], got[2], got[3]) if len(got) == 4 else (BLOCK_N, 8, 0)


def _tuned_entry(qtype: QT) -> list[int]:
    """The tuning file's "moe_gemm" entry of a block type (engine/kernels/gemv_tuned.json), [] without one."""
    return tuned().get(qtype.name, {}).get("moe_gemm") or []


def decodes(qtype: QT, k: int) -> bool:
    """Whether _deq_tile decodes rows of k elements of this block type."""
    return qtype in TILE_TYPES and k % (32 if qtype in _BLOCK32 else 256) == 0


def supports(qtype: QT, k: int) -> bool:
    return decodes(qtype, k)


def moe_gemm(
    blocks: Blocks,
    table: torch.Tensor,
    qtype: QT,
    row_bytes: int,
    x: torch.Tensor,
    n: int,
    k: int,
    topk: int,
    slots: int,
    x_per_slot: bool = False,
    up_table: torch.Tensor | None = None,
    act: str | None = None,
    out_dtype: torch.dtype = torch.float32,
    variant: int | None = None,
    launch: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """For every (token, slot) s with expert e: y[s] = W_e . x (or act(W_e . x) * U_e . x with `up_table`).
    x [T, k] (or [S, k] with x_per_slot) -> [S, n] in out_dtype, S = `slots`. `variant`: the tile decoder
    (default: tile_variant's choice); `launch`: (BLOCK_N, warps, stages), default tile_launch's."""
    x = x.contiguous()
    y = torch.empty(slots, n, dtype=out_dtype, device=x.device)
    glu = _GLU[act] if up_table is not None and act is not None else 0
    block_n, warps, stages = launch if launch is not None else tile_launch(qtype)
    # float32 tiles take twice the shared memory of the tuned shape
    if launch is None and x.dtype == torch.float32:
        block_n = min(block_n, BLOCK_N)
    extra = {"num_stages": stages} if stages else {}
    grid = (blocks.max_blocks, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        table, up_table if up_table is not None else table, row_bytes, x, blocks.order, blocks.expert,
        blocks.start, blocks.end, blocks.nblocks, y, n, k, topk,
        QTYPE=tile_variant(qtype) if variant is None else variant, BLOCK_M=blocks.block_m, BLOCK_N=block_n,
        X_PER_SLOT=int(x_per_slot), GLU=glu,
        IEEE=x.dtype == torch.float32, num_warps=warps, **extra,
    )  # fmt: skip
    return y
