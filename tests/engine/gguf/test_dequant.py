"""engine.gguf.quants against gguf.quants (numpy): bit-identical for every block type, on CPU and CUDA."""

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.gguf.quants import SUPPORTED_TYPES, UnsupportedQuantTypeError, block_size, dequantize
from engine.gguf.random_blocks import random_blocks

Q = GGMLQuantizationType
ALL_TYPES = sorted(SUPPORTED_TYPES)


def _gguf_can_dequantize(qtype: GGMLQuantizationType) -> bool:
    _, nbytes = GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _inputs(qtype: GGMLQuantizationType) -> list[np.ndarray]:
    """Sane blocks [2, 12, row_bytes] and fully random bytes (any scale, NaN/inf included)."""
    elems, nbytes = block_size(qtype)
    row_blocks = max(1, 2048 // elems)
    sane = random_blocks(qtype, 24, row_blocks * elems, seed=int(qtype)).reshape(2, 12, -1)
    rng = np.random.default_rng(1000 + int(qtype))
    wild = rng.integers(0, 256, (2, 12, row_blocks * nbytes), dtype=np.uint8)
    return [sane, wild]


def _assert_bit_identical(got: torch.Tensor, ref: np.ndarray) -> None:
    got_np = got.cpu().numpy()
    assert got_np.dtype == np.float32 and got_np.shape == ref.shape
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got_np), nan)
    np.testing.assert_array_equal(got_np[~nan].view(np.uint32), ref[~nan].view(np.uint32))


def _check(qtype: GGMLQuantizationType, device: str) -> None:
    for i, raw in enumerate(_inputs(qtype)):
        with np.errstate(all="ignore"):
            ref = gguf.quants.dequantize(raw, qtype)
        if i == 0:
            assert np.isfinite(ref).all()
        got = dequantize(torch.from_numpy(raw).to(device), qtype)
        assert got.device.type == device
        _assert_bit_identical(got, ref)


def test_every_type_gguf_can_dequantize_is_supported() -> None:
    expected = {t for t in GGMLQuantizationType if t in GGML_QUANT_SIZES and _gguf_can_dequantize(t)}
    assert SUPPORTED_TYPES == expected
    required = {
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ1_S",
        "IQ1_M",
    }
    required |= {
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ4_NL",
        "IQ4_XS",
        "MXFP4",
        "F32",
        "F16",
        "BF16",
    }
    assert required <= {t.name for t in SUPPORTED_TYPES}
    for t in SUPPORTED_TYPES:
        assert block_size(t) == GGML_QUANT_SIZES[t]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_bit_identical_to_gguf_cpu(qtype: GGMLQuantizationType) -> None:
    _check(qtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_bit_identical_to_gguf_cuda(qtype: GGMLQuantizationType) -> None:
    _check(qtype, "cuda")


def test_dtype_shape_and_views() -> None:
    raw = random_blocks(Q.Q4_K, 4, 512, seed=3)  # [4, 288]
    ref = gguf.quants.dequantize(raw, Q.Q4_K)  # [4, 512]
    t = torch.from_numpy(raw)
    got = dequantize(t, Q.Q4_K, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.from_numpy(ref).to(torch.bfloat16))
    assert torch.equal(dequantize(t, int(Q.Q4_K), shape=(2, 1024)), torch.from_numpy(ref).reshape(2, 1024))
    # a non-contiguous selection of rows (as an expert cache gathers them)
    assert torch.equal(dequantize(t[::2], Q.Q4_K), torch.from_numpy(ref[::2]))
    # F32 returns a new tensor, never a view of the input
    f32 = torch.arange(8, dtype=torch.float32).view(torch.uint8).reshape(2, 16)
    out = dequantize(f32, Q.F32)
    out[0, 0] = 99.0
    assert f32.view(torch.float32)[0, 0] == 0.0


def test_errors_name_the_problem() -> None:
    with pytest.raises(UnsupportedQuantTypeError, match=r"Q8_K.*supported: .*Q4_K") as err:
        dequantize(torch.zeros(292, dtype=torch.uint8), Q.Q8_K)
    assert "IQ1_M" in str(err.value)
    with pytest.raises(UnsupportedQuantTypeError, match="unknown GGML block type id 999"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 999)
    with pytest.raises(ValueError, match="multiple of 34 bytes"):
        dequantize(torch.zeros(2, 35, dtype=torch.uint8), Q.Q8_0)
    with pytest.raises(ValueError, match="not the 65"):
        dequantize(torch.zeros(2, 34, dtype=torch.uint8), Q.Q8_0, shape=(65,))
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(2, 34, dtype=torch.int8), Q.Q8_0)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_have_sane_scales(qtype: GGMLQuantizationType) -> None:
    elems, nbytes = block_size(qtype)
    row = 4 * max(elems, 64)
    raw = random_blocks(qtype, 32, row, seed=5)
    assert raw.dtype == np.uint8 and raw.shape == (32, row // elems * nbytes)
    w = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(w).all()
    assert 0.02 <= float(w.std()) <= 0.1
    assert abs(float(w.mean())) < 0.25 * float(w.std())
    assert np.array_equal(raw, random_blocks(qtype, 32, row, seed=5))
    assert not np.array_equal(raw, random_blocks(qtype, 32, row, seed=6))
    assert np.array_equal(raw, random_blocks(qtype, 32, row, seed=np.random.default_rng(5)))
    std2 = float(gguf.quants.dequantize(random_blocks(qtype, 32, row, seed=5, std=0.02), qtype).std())
    assert 0.01 <= std2 <= 0.04
    with pytest.raises(ValueError, match="multiple"):
        random_blocks(qtype, 1, elems + 1 if elems > 1 else 0)
