"""rms_norm on the CPU: the kernel (Numba, where the block kernels run) against float64 arithmetic, a row's bits
the same alone, in a step of several and as a strided slice; and torch's one-call path (float32 weights, where
Numba is missing) bit-equal to the float32 operations it replaced, so that switching between them changes no
token."""

import pytest
import torch

from engine.kernels import cpu_blocks
from engine.layers import norm
from engine.layers.norm import rms_norm

SHAPES = [(1, 640, 1.0), (3, 2048, 1e-3), (17, 256, 1e2), (2, 96, 1.0)]


def _want(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    xd = x.double()
    y = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    return y if w is None else y * w.double()


@pytest.mark.skipif(not cpu_blocks.available()[0], reason="the CPU kernels need Numba, AVX2 and F16C")
@pytest.mark.parametrize(("rows", "d", "scale"), SHAPES)
def test_rms_norm_kernel(rows: int, d: int, scale: float) -> None:
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(rows, d, generator=g) * scale, torch.randn(d, generator=g)
    got = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.double(), _want(x, w), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(rms_norm(x, None, 1e-6).double(), _want(x, None), rtol=2e-6, atol=1e-6)
    for r in range(rows):  # each row alone
        assert torch.equal(rms_norm(x[r : r + 1], w, 1e-6), got[r : r + 1])
    wide = torch.cat([x, torch.randn(rows, 5, generator=g)], -1)[:, :d]  # the step's rows as a strided slice
    assert torch.equal(rms_norm(wide, w, 1e-6), got)
    assert torch.equal(rms_norm(x.view(1, rows, d), w, 1e-6), got.view(1, rows, d))
    half = rms_norm(x.bfloat16(), w, 1e-6, torch.float32)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half.double(), _want(x.bfloat16().float(), w), rtol=2e-6, atol=1e-6)
    assert rms_norm(x, w.bfloat16(), 1e-6).dtype == torch.float32


@pytest.mark.parametrize(("rows", "d", "scale"), SHAPES)
def test_rms_norm_torch(rows: int, d: int, scale: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(norm.cpu_blocks, "available", lambda: (False, "off for this test"))
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(rows, d, generator=g) * scale, torch.randn(d, generator=g)
    got = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.double(), _want(x, w), rtol=2e-6, atol=1e-6)
    steps = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.equal(got, steps)
    assert rms_norm(x.bfloat16(), w, 1e-6, torch.float32).dtype == torch.float32
