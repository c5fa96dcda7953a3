"""--kv q4_0: 4-bit keys and values with a scale per 32 values, rounded as llama.cpp's q4_0 (gguf's quantizer is
the reference), read back by the torch path, and the logits they give near those of a float cache."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from engine.layers.kv_cache import KVCache, KVCacheError, dequant4, kv_bytes_per_token, quant4
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model


@pytest.mark.parametrize("d", [64, 128, 256])
def test_q4_0_rounds_as_gguf_q4_0(d: int) -> None:
    x = np.random.default_rng(d).standard_normal((50, d)).astype(np.float32) * 3
    x[7] = 0.0  # an all-zero block: scale 0, codes 8
    want = quants.dequantize(quants.quantize(x, QT.Q4_0), QT.Q4_0)
    codes, scales = quant4(torch.from_numpy(x))
    assert codes.dtype == torch.uint8 and codes.shape == (50, d // 2) and scales.shape == (50, d // 32)
    got = dequant4(codes, scales, torch.float32).numpy()
    np.testing.assert_array_equal(got, want)


def test_a_q4_cache_writes_reads_and_splits() -> None:
    c = KVCache(range(2), 12, 2, 64, 64, "q4_0", torch.device("cpu"))
    lk = c.layers[0]
    assert lk.k.shape == (12, 2, 32) and lk.k_scale is not None and lk.k_scale.shape == (12, 2, 2)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    keys, _ = c.store(0, torch.tensor([0, 1, 2]), k, v, 3)
    assert keys.shape == (3, 2, 64) and keys.dtype == torch.float32
    assert torch.equal(keys, dequant4(*quant4(k), torch.float32))
    assert (
        keys - k
    ).abs().max() <= k.abs().amax() / 8 + 1e-6  # half a step of the largest block's scale at most
    # a position costs what the planners count: 32 code bytes and 2 float16 scales per head, keys and values
    cfg = SimpleNamespace(n_head_kv=2, head_dim_k=64, head_dim_v=64)
    assert c.nbytes == 12 * 2 * kv_bytes_per_token(cfg, "q4_0") == 12 * 2 * 2 * 2 * (32 + 4)  # type: ignore[arg-type]
    _, b = c.split(2)
    b.store(1, torch.tensor([1]), k[:1], v[:1], 2)
    assert torch.equal(c.layers[1].k[6 + 1], quant4(k[:1])[0][0])
    assert b.layers[1].k_scale is not None and b.layers[1].k_scale.shape == (6, 2, 2)


def test_q4_names_the_head_sizes_it_takes() -> None:
    with pytest.raises(
        KVCacheError, match=r"q4_0 needs key and value heads of 64, 128 or 256 values.*80.*int8"
    ):
        KVCache(range(1), 8, 2, 80, 80, "q4_0", torch.device("cpu"))


@pytest.mark.parametrize("arch", ["qwen3moe", "llama", "gemma3"])
def test_q4_kv_logits_stay_near_a_float_caches(tmp_path: Path, arch: str) -> None:
    """A 60-token prompt read in chunks, then 8 decode steps: the steps' logits against the f32 cache's. Four bits
    cost accuracy (on these random models the mean cosine is 0.96-0.997 where int8's is 0.9999; a MoE's routing can
    flip on one step), so this checks that the cache reads back as itself, not that it is lossless."""
    lm = load_model(write_tiny_model(tmp_path / f"{arch}.gguf", arch, seed=3), device="cpu")
    m = lm.model
    ids = torch.randint(1, m.cfg.n_vocab, (68,), generator=torch.Generator().manual_seed(0))
    got, want = [], []
    for kv, out in (("q4_0", got), ("f32", want)):
        cache = m.new_cache(128, kv)
        with torch.inference_mode():
            for at in range(0, 60, 20):
                out.append(m.forward(ids[at : at + 20], cache, at)[-1])
            for p in range(60, 68):
                out.append(m.forward(ids[p : p + 1], cache, p)[-1])
    cos = [
        torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()
        for a, b in zip(got, want, strict=True)
    ]
    assert sum(cos) / len(cos) > 0.95 and sorted(cos)[len(cos) // 2] > 0.97, cos


def test_a_tie_for_the_largest_magnitude_takes_the_positive_value() -> None:
    x = torch.zeros(1, 64)
    x[0, 3], x[0, 9] = -2.0, 2.0  # first the negative one
    codes, scales = quant4(x)
    assert scales[0, 0].item() == -0.25  # 2 / -8
    assert dequant4(codes, scales, torch.float32)[0, 9].item() == 2.0
