"""--expert-prefetch on a card: the next layer's predicted misses staged on a side stream inside the CUDA graphs
give the same greedy tokens as without, whatever the prediction's accuracy (the router's own, or a replayed trace's
at 0, 0.5 and 1), and stay within the VRAM budget."""

from pathlib import Path

import pytest
import torch

from engine.experts.policy import ExpertPolicy
from engine.experts.trace import save_trace
from engine.experts.trace_gen import PRESETS, generate
from tests.engine.test_gpu_fast_path import _greedy

pytestmark = pytest.mark.gpu


def test_prefetch_gives_the_same_tokens_from_the_graphs(moe_q4k: Path) -> None:
    plain, _ = _greedy(moe_q4k, 32, experts=ExpertPolicy(slots=6))
    tokens, lm = _greedy(moe_q4k, 32, experts=ExpertPolicy(slots=6, prefetch="router"))
    pf = lm.model.expert_cache.prefetch
    assert pf is not None and pf.issued > 0 and "router" in pf.label
    assert lm.model.graphs is not None and lm.model.graphs.graphs  # the steps ran from CUDA graphs
    assert tokens == plain


@pytest.mark.parametrize("accuracy", ["0", "0.5", "1"])
def test_trace_predictions_of_any_accuracy_give_the_same_tokens(
    moe_q4k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accuracy: str
) -> None:
    save_trace(tmp_path / "t.npz", generate(400, 2, 8, 2, PRESETS["realistic"], seed=9))
    monkeypatch.setenv("STRATA_ROUTE_TRACE", str(tmp_path / "t.npz"))
    plain, lm0 = _greedy(moe_q4k, 32, experts=ExpertPolicy(slots=6))
    del lm0
    torch.cuda.empty_cache()
    monkeypatch.setenv("STRATA_PREFETCH_TRACE", accuracy)
    budget = 2048
    torch.cuda.reset_peak_memory_stats()
    tokens, lm = _greedy(
        moe_q4k, 32, experts=ExpertPolicy(slots=6, prefetch="router", vram_budget_mib=budget)
    )
    pf = lm.model.expert_cache.prefetch
    assert pf is not None and pf.issued > 0 and "trace" in pf.label
    assert tokens == plain
    assert torch.cuda.max_memory_allocated() <= budget << 20
