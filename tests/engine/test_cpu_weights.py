"""Float copies of CPU weights (--cpu-weights-mib): same logits as the blocks, the budget holds, 0 turns it off."""

from pathlib import Path

import pytest
import torch

from engine.layers.qtensor import QTensor
from engine.link.startup import load_split_model
from engine.pipeline.loader import load_model
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model

TOKENS = torch.tensor([1, 17, 42, 99, 150, 7])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cw") / "m.gguf", "qwen3", qtype="Q4_K", seed=3)


def _logits(path: Path, mib: int | None) -> tuple[torch.Tensor, object]:
    lm = load_model(path, device="cpu", dtype="f32", cpu_weights_mib=mib)
    m = lm.model
    cache = m.new_cache(32, "f32")
    m.forward(TOKENS[:-1], cache, 0)
    return m.forward(TOKENS[-1:], cache, len(TOKENS) - 1), m


def _weights(m: object) -> list[QTensor]:
    parts = [m.output, *[v for lw in m.layers.values() for v in vars(lw).values()]]  # type: ignore[attr-defined]
    return [q for q in parts if isinstance(q, QTensor) and len(q.shape) == 2]


def test_float_copies_give_the_blocks_logits(tiny: Path) -> None:
    blocks, mb = _logits(tiny, 0)
    floats, mf = _logits(tiny, None)
    assert all(q.dense is None for q in _weights(mb))  # 0: nothing copied
    assert all(q.dense is not None for q in _weights(mf))  # the automatic budget holds a tiny model whole
    assert torch.allclose(floats, blocks, atol=1e-5, rtol=1e-5)


def test_the_budget_is_not_exceeded(tiny: Path) -> None:
    _, m = _logits(tiny, None)
    sizes = sorted({q.shape[0] * q.shape[1] * 4 for q in _weights(m)})
    budget_mib = 1  # smaller than the whole model, larger than one weight
    assert sizes[0] < budget_mib << 20 < sum(q.shape[0] * q.shape[1] * 4 for q in _weights(m))
    logits, m = _logits(tiny, budget_mib)
    kept = [q for q in _weights(m) if q.dense is not None]
    assert kept and len(kept) < len(_weights(m))
    assert sum(q.dense.numel() * 4 for q in kept) <= budget_mib << 20  # type: ignore[union-attr]
    blocks, _ = _logits(tiny, 0)
    assert torch.allclose(logits, blocks, atol=1e-5, rtol=1e-5)


def test_the_split_loader_honours_the_flag(tiny: Path) -> None:
    lm = load_split_model(tiny, SplitOptions(device="cpu", cpu_weights_mib=0), 32, "f32", "f32")
    cache = lm.model.new_cache(32, "f32")
    lm.model.forward(TOKENS, cache, 0)
    assert all(q.dense is None for q in _weights(lm.model))
    lm = load_split_model(tiny, SplitOptions(device="cpu"), 32, "f32", "f32")
    cache = lm.model.new_cache(32, "f32")
    lm.model.forward(TOKENS, cache, 0)
    assert any(q.dense is not None for q in _weights(lm.model))


def test_routed_experts_keep_float_copies_too(tmp_path: Path) -> None:
    """A MoE on the CPU: each expert used keeps a float copy within the budget (they were dequantized at every use),
    with the blocks' logits; with the budget at 0 none does."""
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", qtype="Q4_K", seed=5)
    blocks, mb = _logits(path, 0)
    floats, mf = _logits(path, None)
    assert torch.allclose(floats, blocks, atol=1e-5, rtol=1e-5)
    for m, kept in ((mb, False), (mf, True)):
        ew = next(lw.experts for lw in m.layers.values() if lw.experts is not None)  # type: ignore[attr-defined]
        parts = ew.gate.parts or {}
        assert bool(parts) == kept and all((p.dense is not None) == kept for p in parts.values())
