"""One weight for q, k and v (engine.layers.fast_decode.fuse_qkv): the fused projection gives the three separate
ones, its views stay the original weights, and different block types are left apart."""

import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.random_blocks import random_blocks
from engine.layers.fast_decode import fuse_qkv
from engine.layers.qtensor import QTensor


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
