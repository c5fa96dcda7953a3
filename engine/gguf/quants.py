"""Dequantization of GGUF block formats with torch ops, on the device of the input.

Each decoder mirrors the arithmetic of `gguf.quants` step by step (same fp32 operations in the same order) so the
results are bit-identical to it on CPU and CUDA. Lookup tables (IQ grids, sign masks, code values) are read from the
`gguf` package at run time and cached per device.
"""

import functools
import math
from collections.abc import Callable

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

Q = GGMLQuantizationType


class UnsupportedQuantTypeError(ValueError):
    """The block type has no dequantizer here."""


def block_size(qtype: GGMLQuantizationType | int) -> tuple[int, int]:
    """(elements, bytes) of one block of `qtype`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


# ----------------------------------------------------------------------------------------------------------------
# Field readers. Blocks are uint8 [N, type_size]; multi-byte fields are copied out so their views are aligned.


def _field(b: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    return b[:, start : start + nbytes].clone(memory_format=torch.contiguous_format).view(dtype)


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    return _field(b, start, 2, torch.float16).float()  # [N, 1]


def _u16(b: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return _field(b, start, 2 * count, torch.int16).int() & 0xFFFF  # [N, count]


def _u32(b: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return _field(b, start, 4 * count, torch.int32).long() & 0xFFFFFFFF  # [N, count]


def _shifts(values: list[int], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return _shift_tensor(tuple(values), shape, like.dtype, like.device)


@functools.cache
def _shift_tensor(
    values: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    # Cached per device: no host-to-device copy inside a step, so dequantization can be captured in a CUDA graph.
    return torch.tensor(values, dtype=dtype, device=device).reshape(shape)


def _lo_hi(q: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k]: the k low nibbles, then the k high nibbles."""
    return torch.cat((q & 0x0F, q >> 4), dim=-1)


def _sign_bits(bits: torch.Tensor) -> torch.Tensor:
    """[...] bytes -> [..., 8] of +1.0 / -1.0, bit i negates element i."""
    b = (bits.unsqueeze(-1) >> _shifts(list(range(8)), (8,), bits)) & 1
    return torch.where(b == 0, 1.0, -1.0)


# ----------------------------------------------------------------------------------------------------------------
# Tables from gguf, cached per device.


def _grid_class(qtype: GGMLQuantizationType) -> type:
    return getattr(gq, qtype.name)


@functools.cache
def _grid(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    cls = _grid_class(qtype)
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return torch.from_numpy(grid.copy()).to(device)  # [G, W]


@functools.cache
def _ksigns(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int32)).to(
        device
    )  # [128]


@functools.cache
def code_values(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    """float32 [16] code values of a lookup-table block type (IQ4_NL, MXFP4, ...) on `device`, from gguf's tables."""
    values = np.array(_grid_class(qtype).kvalues, dtype=np.int8).astype(np.float32)
    return torch.from_numpy(values).to(device)  # [16]


# ----------------------------------------------------------------------------------------------------------------
# Decoders: uint8 [N, type_size] -> float32 [N, block_elems].


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return (_field(b, 0, 2, torch.int16).int() << 16).view(torch.float32)


def q4_0_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 blocks uint8 [N, 18] -> (codes [N, 32] 0..15, scales [N, 1] float32): element = scale * (code - 8)."""
    return _lo_hi(b[:, 2:18]), _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q, d = q4_0_parts(b)
    return d * (q.int() - 8).float()  # [N, 32]


def q4_1_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks uint8 [N, 20] -> (codes [N, 32] 0..15, scales [N, 1], offsets [N, 1] float32): element =
    scale * code + offset."""
    return _lo_hi(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q, d, m = q4_1_parts(b)
    return d * q.float() + m


def _q5_bits(b: torch.Tensor, qh_at: int, qs_at: int) -> torch.Tensor:
    qh = _u32(b, qh_at, 1)  # [N, 1]
    hi = (qh >> _shifts(list(range(32)), (1, 32), qh)) & 1  # [N, 32]
    lo = _lo_hi(b[:, qs_at : qs_at + 16]).long()
    return lo | (hi << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return d * (_q5_bits(b, 2, 6) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return d * _q5_bits(b, 4, 8).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:34].view(torch.int8).float() * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    qs = b[:, 16:80].reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b)
    q = (qs & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    lsc = (scales[:, :8].reshape(n, 1, 8) >> _shifts([0, 4], (1, 2, 1), b)).reshape(n, 16)
    hsc = (scales[:, 8:12].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], (1, 4, 1), b)).reshape(n, 16)
    sc = (((lsc & 0x0F) | ((hsc & 3) << 4)).int() - 32).float()
    dl = (d * sc).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> _shifts(list(range(8)), (1, 1, 8, 1), b)).reshape(n, 16, 16) & 1
    q = (ql.int() - ((qh ^ 1).int() << 2)).float()  # the high bit *clear* subtracts 4
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte packed 6-bit scales and mins of Q4_K/Q5_K -> two [N, 8]."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def q4_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks uint8 [N, 144] -> (codes [N, 8, 32] 0..15, scales [N, 8], offsets [N, 8] float32): element j of
    sub-block s is scales[s] * codes[s, j] - offsets[s], so a Q4_K row is 4-bit codes with a scale and an offset per
    32 (the form of group-wise 4-bit kernels)."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    q = (b[:, 16:144].reshape(n, 4, 1, 32) >> _shifts([0, 4], (1, 1, 2, 1), b)) & 0x0F
    return q.reshape(n, 8, 32), d * sc.float(), dmin * mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    q, ds, dm = q4_k_parts(b)
    return (ds[..., None] * q.float() - dm[..., None]).reshape(b.shape[0], QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    ds = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    ql = ((b[:, 48:176].reshape(n, 4, 1, 32) >> _shifts([0, 4], (1, 1, 2, 1), b)) & 0x0F).reshape(n, 8, 32)
    qh = ((b[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(list(range(8)), (1, 1, 8, 1), b)) & 1).reshape(
        n, 8, 32
    )
    q = (ql | (qh << 4)).float()
    return (ds * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    ql = ((b[:, 0:128].reshape(n, 2, 1, 64) >> _shifts([0, 4], (1, 1, 2, 1), b)) & 0x0F).reshape(n, 8, 32)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b)) & 3).reshape(
        n, 8, 32
    )
    q = ((ql | (qh << 4)).int() - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _tq1_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 52)
    qs = b[:, 0:52].int()
    pow3 = _shifts([1, 3, 9, 27, 81], (1, 5, 1), qs)
    q0 = (qs[:, 0:32].reshape(n, 1, 32) * pow3).reshape(n, 160)
    q1 = (qs[:, 32:48].reshape(n, 1, 16) * pow3).reshape(n, 80)
    qh = (qs[:, 48:52].reshape(n, 1, 4) * pow3[:, :4]).reshape(n, 16)
    t = torch.cat((q0, q1, qh), dim=-1) & 0xFF  # byte arithmetic wraps, as in ggml
    q = (((t * 3) >> 8) - 1).float()
    return d * q


def _tq2_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 64)
    qs = (b[:, 0:64].reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b)) & 3
    return d * (qs.reshape(n, QK_K).int() - 1).float()


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, 0:1].int()
    # e8m0 scale halved (the code values below are doubled): 2^(e-128), subnormal for e < 2
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)  # [N, 1]
    q = code_values(Q.MXFP4, b.device)[_lo_hi(b[:, 1:17]).long()]  # [N, 32]
    return d * q


def _nvfp4(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    x = b[:, 0:4].int()  # unsigned e4m3 sub-block scales
    exp = (x >> 3) & 0x0F
    man = (x & 7).float()
    pow2 = ((exp - 7 + 127) << 23).view(torch.float32)  # 2^(exp-7), exact
    raw = torch.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * pow2)
    d = torch.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5).reshape(n, 4, 1)
    qs = b[:, 4:36].reshape(n, 4, 8)
    q = code_values(Q.NVFP4, b.device)[_lo_hi(qs).long()]  # [N, 4, 16]
    return (d * q).reshape(n, 64)


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    words = _u32(b, 2, 16).reshape(n, 8, 2)
    aux = words[..., 1]  # [N, 8]: 4 x 7-bit sign indices + 4-bit scale
    db = (d * (0.5 + (aux >> 28).float()) * 0.25).reshape(n, 8, 1, 1)
    sidx = (aux.unsqueeze(-1) >> _shifts([0, 7, 14, 21], (1, 1, 4), aux)) & 0x7F
    signs = _sign_bits(_ksigns(b.device)[sidx])  # [N, 8, 4, 8]
    gidx = b[:, 2:66].reshape(n, 8, 8)[..., 0:4].long()  # bytes of the first word
    grid = _grid(Q.IQ2_XXS, b.device)[gidx]  # [N, 8, 4, 8]
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs = _u16(b, 2, 32)  # [N, 32]
    sc = ((b[:, 66:74].reshape(n, 8, 1) >> _shifts([0, 4], (1, 1, 2), b)) & 0x0F).reshape(n, 16)
    db = (d * (0.5 + sc.float()) * 0.25).reshape(n, 16, 1, 1)
    signs = _sign_bits(_ksigns(b.device)[(qs >> 9).long()]).reshape(n, 16, 2, 8)
    grid = _grid(Q.IQ2_XS, b.device)[(qs & 511).long()].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs, sbits, qh = b[:, 2:34], b[:, 34:66], b[:, 66:74]
    sc = ((b[:, 74:82].reshape(n, 8, 1) >> _shifts([0, 4], (1, 1, 2), b)) & 0x0F).reshape(n, 16)
    db = (d * (0.5 + sc.float()) * 0.25).reshape(n, 16, 1, 1)
    signs = _sign_bits(sbits).reshape(n, 16, 2, 8)
    high = ((qh.reshape(n, 8, 1) >> _shifts([0, 2, 4, 6], (1, 1, 4), b)) & 3).reshape(n, 32)
    idx = qs.long() | (high.long() << 8)
    grid = _grid(Q.IQ2_S, b.device)[idx].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    aux = _u32(b, 66, 8)  # [N, 8]
    db = (d * (0.5 + (aux >> 28).float()) * 0.5).reshape(n, 8, 1, 1)
    sidx = (aux.unsqueeze(-1) >> _shifts([0, 7, 14, 21], (1, 1, 4), aux)) & 0x7F
    signs = _sign_bits(_ksigns(b.device)[sidx])  # [N, 8, 4, 8]
    grid = _grid(Q.IQ3_XXS, b.device)[b[:, 2:66].long()].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs, qh, sbits = b[:, 2:66], b[:, 66:74], b[:, 74:106]
    sc = ((b[:, 106:110].reshape(n, 4, 1) >> _shifts([0, 4], (1, 1, 2), b)) & 0x0F).reshape(n, 8)
    db = (d * (1 + 2 * sc.int()).float()).reshape(n, 8, 1, 1)
    signs = _sign_bits(sbits).reshape(n, 8, 4, 8)
    high = ((qh.reshape(n, 8, 1) >> _shifts(list(range(8)), (1, 1, 8), b)) & 1).reshape(n, 64)
    idx = qs.long() | (high.long() << 8)
    grid = _grid(Q.IQ3_S, b.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq1_delta(cond_negative: torch.Tensor) -> torch.Tensor:
    delta = float(gq.IQ1_S.delta)
    return torch.where(cond_negative, -delta, delta)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qh = _u16(b, 34, 8)  # [N, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = _iq1_delta((qh & 0x8000) != 0).reshape(n, 8, 1, 1)
    high = ((qh.unsqueeze(-1) >> _shifts([0, 3, 6, 9], (1, 1, 4), qh)) & 7).reshape(n, 32)
    idx = b[:, 2:34].long() | (high.long() << 8)
    grid = _grid(Q.IQ1_S, b.device)[idx].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, qh = b[:, 0:32], b[:, 32:48]
    sc = _u16(b, 48, 4)  # [N, 4]; the fp16 scale is spread over their top nibbles
    parts = (sc & 0xF000) >> _shifts([12, 8, 4, 0], (1, 4), sc)
    dbits = parts[:, 0] | parts[:, 1] | parts[:, 2] | parts[:, 3]
    d = dbits.to(torch.int16).view(torch.float16).float().reshape(n, 1)
    s3 = ((sc.unsqueeze(-1) >> _shifts([0, 3, 6, 9], (1, 1, 4), sc)) & 7).reshape(n, 16)
    dl = (d * (2 * s3 + 1).float()).reshape(n, 8, 2, 1, 1)
    qh2 = qh.reshape(n, 16, 1) >> _shifts([0, 4], (1, 1, 2), b)  # [N, 16, 2]
    idx = qs.long() | ((qh2 & 7).long() << 8).reshape(n, 32)
    delta = _iq1_delta((qh2 & 8) != 0).reshape(n, 8, 2, 2, 1)
    grid = _grid(Q.IQ1_M, b.device)[idx].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = code_values(Q.IQ4_NL, b.device)[_lo_hi(b[:, 2:18]).long()]  # [N, 32]
    return d * q


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    sh = _u16(b, 2, 1)  # [N, 1]
    sl = ((b[:, 4:8].reshape(n, 4, 1) >> _shifts([0, 4], (1, 1, 2), b)) & 0x0F).reshape(n, 8)
    hi = (sh >> _shifts([2 * i for i in range(8)], (1, 8), sh)) & 3
    sc = ((sl.int() | (hi << 4)) - 32).float()
    dl = (d * sc).reshape(n, 8, 1)
    idx = ((b[:, 8:136].reshape(n, 8, 1, 16) >> _shifts([0, 4], (1, 1, 2, 1), b)) & 0x0F).reshape(n, 8, 32)
    q = code_values(Q.IQ4_NL, b.device)[idx.long()]  # IQ4_XS uses the IQ4_NL code values
    return (dl * q).reshape(n, QK_K)


_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.BF16: _bf16,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.TQ1_0: _tq1_0,
    Q.TQ2_0: _tq2_0,
    Q.MXFP4: _mxfp4,
    Q.IQ2_XXS: _iq2_xxs,
    Q.IQ2_XS: _iq2_xs,
    Q.IQ2_S: _iq2_s,
    Q.IQ3_XXS: _iq3_xxs,
    Q.IQ3_S: _iq3_s,
    Q.IQ1_S: _iq1_s,
    Q.IQ1_M: _iq1_m,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
}
if hasattr(Q, "NVFP4") and hasattr(gq, "NVFP4"):  # added in newer gguf releases
    _DECODERS[Q.NVFP4] = _nvfp4

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F32, Q.F16, *_DECODERS})


def _supported_names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES))


def dequantize(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    shape: tuple[int, ...] | torch.Size | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode uint8 blocks [..., row_bytes] into [..., row_elems] (or `shape`) on raw's device.

    Computed in float32 (bit-identical to gguf.quants), then cast to `dtype`. Always returns a new tensor.
    """
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedQuantTypeError(
            f"unknown GGML block type id {qtype}; supported: {_supported_names()}"
        ) from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedQuantTypeError(
            f"cannot dequantize block type {qtype.name}; supported: {_supported_names()}"
        )
    if raw.dtype != torch.uint8:
        raise TypeError(f"dequantize expects uint8 blocks, got {raw.dtype}")
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    lead = tuple(raw.shape[:-1]) if raw.dim() else ()
    row_bytes = raw.shape[-1] if raw.dim() else 1
    if raw.dim() == 0 or row_bytes % block_bytes:
        raise ValueError(
            f"{qtype.name} rows must be a multiple of {block_bytes} bytes, got shape {tuple(raw.shape)}"
        )
    out_shape = (*lead, row_bytes // block_bytes * block_elems)
    if shape is not None:
        if math.prod(shape) != math.prod(out_shape):
            raise ValueError(
                f"{qtype.name} blocks of shape {tuple(raw.shape)} hold {math.prod(out_shape)} values, "
                f"not the {math.prod(shape)} of shape {tuple(shape)}"
            )
        out_shape = tuple(shape)
    blocks = raw.reshape(-1, block_bytes)  # [N, type_size]
    if qtype == Q.F32:
        values = _field(blocks, 0, 4, torch.float32)
    elif qtype == Q.F16:
        values = _field(blocks, 0, 2, torch.float16).float()
    else:
        values = _DECODERS[qtype](blocks)  # [N, block_elems]
    return values.reshape(out_shape).to(dtype)
