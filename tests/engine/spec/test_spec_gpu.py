"""Verify windows on CUDA: a window replayed from its CUDA graph gives the eager forward's logits, and greedy tokens
with --spec 4 (windows in graphs, the one-token steps in the model's own graphs) are those without drafts."""

from pathlib import Path

import pytest
import torch

from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.spec import SpecConfig, WindowGraphs
from tests.engine.spec.toys import ScriptedDraft, reference_greedy

pytestmark = pytest.mark.gpu

PROMPT = [5, 9, 33, 71, 120, 200, 7, 64, 3, 11] * 2


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@torch.inference_mode()
def test_window_graph_equals_eager(tiny_models: dict[str, Path], dtype: str) -> None:
    lm = load_model(tiny_models["qwen3moe"], "cuda", dtype)
    m = lm.model
    assert WindowGraphs.usable(m)
    kv = "f32" if dtype == "f32" else "bf16"
    graphs = WindowGraphs(m, 5)
    a, b = m.new_cache(256, kv), m.new_cache(256, kv)
    m.forward(torch.tensor(PROMPT), a, 0)
    m.forward(torch.tensor(PROMPT), b, 0)
    p = len(PROMPT)
    for start, window in ((p, [17, 42, 99, 150, 7]), (p + 5, [1, 2, 3]), (p + 8, [4, 5, 6, 7, 8])):
        got = graphs.forward(window, a, start)  # captured on first use, then replayed
        want = m.forward(torch.tensor(window), b, start)
        assert a.length == b.length == start + len(window)
        if len(window) == 5:
            assert torch.equal(got, want), f"window at {start}"
        else:  # padded to 5 rows: other matmul shapes, the same values up to rounding
            assert torch.allclose(got, want, rtol=0, atol=2e-2 if dtype == "bf16" else 1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert len(graphs.graphs) == 1


def test_greedy_same_with_windows_on_cuda(tiny_models: dict[str, Path]) -> None:
    lm = load_model(tiny_models["qwen3moe"], "cuda", "f32")
    n = 40
    ref = reference_greedy(lm.model, PROMPT, n, 256)
    truth = PROMPT + ref
    vocab = lm.config.n_vocab
    req = GenerationRequest(PROMPT, max_tokens=n, sampling=GREEDY, ignore_eos=True)
    for wrong_every in (None, 0, 1, 5):
        drafts = None if wrong_every is None else (lambda s, w=wrong_every: ScriptedDraft(truth, vocab, w))
        runner = Runner(lm.model, lm.tokenizer, 256, "f32", 64, spec=SpecConfig(n=4), drafts=drafts)
        assert runner.window_graphs is not None
        done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
        assert done.tokens == ref, f"drafts wrong every {wrong_every}"


def test_split_windows_as_graphs(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-stage split on one card: each stage replays its verify windows from
    graphs of their row count; greedy tokens with --spec 4 (drafts right, wrong, and sometimes wrong) are the
    one-card model's without drafts, and the stages did capture window graphs."""
    from engine.link.startup import load_split_model
    from engine.pipeline.split import SplitOptions
    from engine.pipeline.stages import LocalStage, SplitModel

    lm = load_model(tiny_models["qwen3moe"], "cuda", "f32")
    n = 40
    ref = reference_greedy(lm.model, PROMPT, n, 256)
    truth = PROMPT + ref
    vocab = lm.config.n_vocab
    half = lm.config.n_layer // 2
    sp = load_split_model(
        tiny_models["qwen3moe"], SplitOptions(device="cuda", layer_split=(half,), split_device=("0",)), 256,
        "f32", "f32",
    )  # fmt: skip
    assert isinstance(sp.model, SplitModel)
    req = GenerationRequest(PROMPT, max_tokens=n, sampling=GREEDY, ignore_eos=True)
    for wrong_every in (0, 1, 5):
        runner = Runner(sp.model, sp.tokenizer, 256, "f32", 64, spec=SpecConfig(n=4),
                        drafts=lambda s, w=wrong_every: ScriptedDraft(truth, vocab, w))  # fmt: skip
        done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
        assert done.tokens == ref, f"drafts wrong every {wrong_every}"
    stages = [s for s in sp.model.stages if isinstance(s, LocalStage)]
    assert all(s.graphs is not None and any(k[1][1] > 1 for k in s.graphs.graphs.graphs) for s in stages)
