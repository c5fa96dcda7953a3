"""One weight for q, k and v (engine.models.fast_decode.fuse_qkv): the fused projection gives the three separate
ones, its views stay the original weights, and different block types are left apart."""

import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.random_blocks import random_blocks
from engine.layers.qtensor import QTensor
from engine.models.fast_decode import fuse_qkv


def _w(qt: QT, n: int, k: int, seed: int) -> QTensor:
    return QTensor(torch.from_numpy(random_blocks(qt, n, k, seed=seed)), qt, (n, k))


def test_fused_projection_equals_the_three() -> None:
    q, k, v = _w(QT.Q4_K, 64, 256, 1), _w(QT.Q4_K, 32, 256, 2), _w(QT.Q4_K, 32, 256, 3)
    x = torch.randn(3, 256)
    expect = torch.cat([w.linear(x) for w in (q, k, v)], dim=-1)
    fused = fuse_qkv(q, k, v)
    assert fused is not None
    qkv, q2, k2, v2 = fused
    assert qkv.shape == (128, 256)
    assert torch.allclose(qkv.linear(x), expect, atol=1e-5)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.equal(a.raw, b.raw) and a.shape == b.shape
        assert b.raw.data_ptr() >= qkv.raw.data_ptr()  # views into the fused weight, no second copy


def test_mixed_block_types_stay_apart() -> None:
    assert fuse_qkv(_w(QT.Q4_K, 64, 256, 1), _w(QT.Q4_K, 32, 256, 2), _w(QT.Q6_K, 32, 256, 3)) is None


def test_prompt_path_reads_the_fused_weight_with_the_same_result(tmp_path) -> None:
    """On CUDA the layers hold the fused weight and prompt chunks project through it; the same done on the CPU
    (fused by hand) gives the logits of the separate projections. qwen2moe: with q/k/v biases."""
    from engine.pipeline.loader import load_model
    from engine.testing.tiny_models import write_tiny_model

    for arch in ("qwen3moe", "qwen2moe"):
        path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype="Q8_0")
        m = load_model(str(path), device="cpu", dtype="f32").model
        ids = torch.tensor([1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256])
        want = m.forward(ids, m.new_cache(32, "f32"), 0)
        for lw in m.layers.values():
            m._fuse_qkv(lw)
            assert lw.qkv is not None
        got = m.forward(ids, m.new_cache(32, "f32"), 0)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
