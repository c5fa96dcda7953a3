"""RoPE's rotation on the CPU in one block-kernel call (cpu_blocks_jit.rotate) gives the same bits as its torch
form, for both pair layouts, partial rotation and YaRN's scaled cos/sin."""

import pytest
import torch

from engine.gguf.model_config import RopeConfig
from engine.kernels import cpu_blocks
from engine.layers.rope import Rope

pytestmark = pytest.mark.skipif(not cpu_blocks.available()[0], reason="the CPU block kernels cannot run here")


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(("t", "h", "d", "dim"), [(1, 14, 64, 64), (5, 3, 128, 64), (2, 1, 80, 32)])
@pytest.mark.parametrize("scaling", ["none", "yarn"])
def test_kernel_rotation_is_the_torch_rotation(
    neox: bool, t: int, h: int, d: int, dim: int, scaling: str
) -> None:
    cfg = RopeConfig(dim=dim, base=10000.0, neox=neox)
    if scaling == "yarn":
        cfg = RopeConfig(dim=dim, base=1e6, neox=neox, scaling="yarn", factor=4.0, orig_ctx=4096)
    rope = Rope(cfg)
    g = torch.Generator().manual_seed(t * 100 + h)
    x = torch.randn(t, h, d, generator=g) * 3
    pos = torch.arange(7000, 7000 + t)
    cos, sin = rope.cos_sin(pos)
    got = rope.apply(x, cos, sin)
    want = rope.apply_torch(x, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(x[..., dim:], got[..., dim:])
    # and the rotation itself against float64 arithmetic
    half = dim // 2
    xd = x.double()
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    a, b = (xd[..., :half], xd[..., half:dim]) if neox else (xd[..., 0:dim:2], xd[..., 1:dim:2])
    r0, r1 = a * c - b * s, b * c + a * s
    ref = torch.cat((r0, r1), -1) if neox else torch.stack((r0, r1), -1).flatten(-2)
    torch.testing.assert_close(got[..., :dim].double(), ref, rtol=1e-5, atol=1e-5)
