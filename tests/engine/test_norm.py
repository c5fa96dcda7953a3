"""rms_norm on the CPU: against float64 arithmetic, and the one-call path (float32 weights) bit-equal to the
float32 operations it replaced, so that switching between them changes no token."""

import pytest
import torch

from engine.layers.norm import rms_norm


@pytest.mark.parametrize(
    ("rows", "d", "scale"), [(1, 640, 1.0), (3, 2048, 1e-3), (17, 256, 1e2), (2, 96, 1.0)]
)
def test_rms_norm(rows: int, d: int, scale: float) -> None:
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(rows, d, generator=g) * scale, torch.randn(d, generator=g)
    got = rms_norm(x, w, 1e-6)
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)
    steps = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.equal(got, steps)
    assert rms_norm(x.bfloat16(), w, 1e-6, torch.float32).dtype == torch.float32
