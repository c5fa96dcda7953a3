"""Random raw GGUF blocks with sane scales, for test models in block types gguf cannot quantize (K- and IQ-types).

All bits of a block are random except its scale fields, which are set so the dequantized weights are finite, have
a standard deviation near `std` and a mean near zero (the K-quant mins and Q4_1/Q5_1 offsets balance the codes).
"""

import functools

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.gguf.quants import SUPPORTED_TYPES, block_size, dequantize

Q = GGMLQuantizationType

# Per type: byte offset of the fp16 scale `d`, and optionally (offset, sign * mean code) of a second fp16 field
# set to d * that value: K-quant `dmin` (+mean, it is subtracted) or Q4_1/Q5_1 `m` (-mean, it is added).
_D_AT: dict[GGMLQuantizationType, int] = {
    Q.Q4_0: 0,
    Q.Q4_1: 0,
    Q.Q5_0: 0,
    Q.Q5_1: 0,
    Q.Q8_0: 0,
    Q.Q2_K: 80,
    Q.Q3_K: 108,
    Q.Q4_K: 0,
    Q.Q5_K: 0,
    Q.Q6_K: 208,
    Q.TQ1_0: 52,
    Q.TQ2_0: 64,
    Q.IQ2_XXS: 0,
    Q.IQ2_XS: 0,
    Q.IQ2_S: 0,
    Q.IQ3_XXS: 0,
    Q.IQ3_S: 0,
    Q.IQ1_S: 0,
    Q.IQ4_NL: 0,
    Q.IQ4_XS: 0,
}
_OFFSET_FIELD: dict[GGMLQuantizationType, tuple[int, float]] = {
    Q.Q4_1: (2, -7.5),
    Q.Q5_1: (2, -15.5),
    Q.Q2_K: (82, 1.5),
    Q.Q4_K: (2, 7.5),
    Q.Q5_K: (2, 15.5),
}
_FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def _set_f16(blocks: np.ndarray, at: int, values: np.ndarray) -> None:
    blocks[:, at : at + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _set_scales(blocks: np.ndarray, qtype: GGMLQuantizationType, scale: np.ndarray) -> None:
    """Write per-block scale `scale` [N] into the scale fields of `blocks` [N, type_size] (in place)."""
    if qtype in _D_AT:
        _set_f16(blocks, _D_AT[qtype], scale)
        if qtype in _OFFSET_FIELD:
            at, mean = _OFFSET_FIELD[qtype]
            _set_f16(blocks, at, scale.astype(np.float16).astype(np.float32) * mean)
    elif qtype == Q.IQ1_M:
        # The fp16 scale is spread over the top nibbles of the four uint16 sub-scales.
        bits = scale.astype(np.float16).view(np.uint16).astype(np.uint32)
        sc = blocks[:, 48:56].copy().view(np.uint16).astype(np.uint32)  # [N, 4]
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[:, 48:56] = sc.astype(np.uint16).view(np.uint8)
    elif qtype == Q.MXFP4:
        # e8m0 exponent byte: the block scale is 2^(e - 128) in gguf's halved convention
        e = np.clip(np.rint(128 + np.log2(scale)), 2, 254)
        blocks[:, 0] = e.astype(np.uint8)
    elif hasattr(Q, "NVFP4") and qtype == Q.NVFP4:
        # four unsigned e4m3 sub-block scales, decoded with a 0.5 factor
        code = gq.NVFP4.fp32_to_ue4m3(np.repeat(2.0 * scale, 4).astype(np.float32))
        blocks[:, 0:4] = np.asarray(code, dtype=np.uint8).reshape(-1, 4)
    else:
        raise ValueError(f"random_blocks has no scale layout for {qtype.name}")


def _random_codes(
    rng: np.random.Generator, qtype: GGMLQuantizationType, n_blocks: int, block_bytes: int
) -> np.ndarray:
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    if qtype == Q.TQ2_0:
        # ternary: 2-bit codes 0..2 only (3 is never written by ggml and would bias the mean)
        codes = rng.integers(0, 3, (n_blocks, 64, 4), dtype=np.uint8)
        blocks[:, :64] = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
    return blocks


@functools.cache
def _unit_std(qtype: GGMLQuantizationType) -> float:
    """Standard deviation of the weights of random blocks whose scale is 1."""
    rng = np.random.default_rng(12345)
    _, block_bytes = block_size(qtype)
    blocks = _random_codes(rng, qtype, 256, block_bytes)
    _set_scales(blocks, qtype, np.ones(256, dtype=np.float32))
    values = dequantize(torch.from_numpy(blocks), qtype)
    return float(values.double().std())


def random_blocks(
    qtype: GGMLQuantizationType | int,
    n_rows: int,
    row_elems: int,
    seed: int | np.random.Generator = 0,
    *,
    std: float = 0.05,
) -> np.ndarray:
    """Random raw blocks of `qtype` as uint8 [n_rows, row_bytes], deterministic for a given seed.

    The dequantized weights (`gguf.quants.dequantize` or `engine.gguf.quants.dequantize`) are finite with a
    standard deviation of roughly `std` (per-block scales vary by +-50%). F32/F16/BF16 hold normal(0, std) values.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"random_blocks does not support {qtype.name}")
    block_elems, block_bytes = block_size(qtype)
    if row_elems <= 0 or row_elems % block_elems:
        raise ValueError(
            f"row_elems must be a positive multiple of {block_elems} for {qtype.name}, got {row_elems}"
        )
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if qtype in _FLOAT_TYPES:
        values = rng.normal(0.0, std, (n_rows, row_elems)).astype(np.float32)
        if qtype == Q.F16:
            values = values.astype(np.float16)
        elif qtype == Q.BF16:
            return np.asarray(gq.quantize(values, Q.BF16), dtype=np.uint8).reshape(n_rows, -1)
        return values.view(np.uint8).reshape(n_rows, -1)
    n_blocks = n_rows * (row_elems // block_elems)
    blocks = _random_codes(rng, qtype, n_blocks, block_bytes)
    scale = (std / _unit_std(qtype)) * rng.uniform(0.5, 1.5, n_blocks)
    _set_scales(blocks, qtype, scale.astype(np.float32))
    return blocks.reshape(n_rows, row_elems // block_elems * block_bytes)
