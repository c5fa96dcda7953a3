"""Prompt chunks as CUDA graphs (engine/pipeline/cuda_graphs.py, PromptGraphs): the same logits, KV cache and
expert counts as the eager layers, whatever the chunk's position; and the cases that must stay eager."""

from pathlib import Path

import pytest
import torch

from engine.experts.policy import ExpertPolicy
from engine.pipeline import cuda_graphs
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model

ARCHS = {
    "qwen3moe": {"qtype": "Q4_K", "types": {"ffn_down": "Q6_K"}},
    "qwen3": {"qtype": "Q4_K"},
    "gemma3": {"qtype": "Q8_0"},  # sliding windows, post norms, its own embedding scale
}


def _model(tmp_path: Path, arch: str) -> Path:
    return write_tiny_model(tmp_path / f"{arch}.gguf", arch, seed=3, **ARCHS[arch])  # type: ignore[arg-type]


def _eager(model, ids: torch.Tensor, cache, start: int) -> torch.Tensor:
    """The chunk through the layers one by one (forward_at: no graphs)."""
    pos = torch.arange(start, start + ids.shape[0], device=model.device)
    out = model.forward_at(ids.to(model.device), cache, pos, start + ids.shape[0], last_only=True)
    cache.length = start + ids.shape[0]
    return out


def test_prompt_graphs_are_off_on_the_cpu(tmp_path: Path) -> None:
    lm = load_model(_model(tmp_path, "qwen3moe"), device="cpu")
    assert lm.model.prompt_graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(ARCHS))
def test_graphed_chunks_equal_the_eager_layers(tmp_path: Path, arch: str) -> None:
    lm = load_model(_model(tmp_path, arch), device="cuda", dtype="bf16")
    m = lm.model
    assert m.prompt_graphs is not None
    ids = torch.randint(1, 400, (70,), generator=torch.Generator().manual_seed(1))
    chunks = [(0, ids[:40]), (40, ids[40:])]  # a second chunk of another size at a later position
    ref_cache = m.new_cache(128, "bf16")
    counts0 = m.expert_counts.clone() if m.expert_counts is not None else None
    refs = [_eager(m, c, ref_cache, s) for s, c in chunks]
    eager_counts = m.expert_counts.clone() - counts0 if counts0 is not None else None
    for rnd in range(3):  # sizes seen once run eagerly, then are captured, then replayed
        cache = m.new_cache(128, "bf16")
        before = m.expert_counts.clone() if m.expert_counts is not None else None
        for (s, c), ref in zip(chunks, refs, strict=True):
            got = m.forward(c, cache, s, last_only=True)
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
        for i in m.layer_range:
            lk, rk = cache.layers[i], ref_cache.layers[i]
            torch.testing.assert_close(lk.k[:70], rk.k[:70], rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(lk.v[:70], rk.v[:70], rtol=1e-2, atol=1e-2)
        if before is not None:  # one count per selection, no more
            assert torch.equal(m.expert_counts - before, eager_counts), rnd
    assert set(m.prompt_graphs.sets) == {40, 30}


@pytest.mark.gpu
def test_greedy_text_is_unchanged(tmp_path: Path) -> None:
    from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
    from engine.pipeline.sampling import GREEDY

    path = _model(tmp_path, "qwen3moe")
    prompt = list(range(5, 45))
    outs = []
    for graphs in (False, True):
        lm = load_model(path, device="cuda", dtype="bf16")
        if not graphs:
            lm.model.prompt_graphs = None
        runner = Runner(lm.model, lm.tokenizer, 256, "bf16")
        for _ in range(3):  # the third request replays the captured chunk
            req = GenerationRequest(prompt, max_tokens=12, sampling=GREEDY, ignore_eos=True)
            done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
            outs.append((graphs, done.tokens))
    assert all(toks == outs[0][1] for _, toks in outs)


@pytest.mark.gpu
def test_experts_in_host_memory_keep_chunks_eager(tmp_path: Path) -> None:
    lm = load_model(_model(tmp_path, "qwen3moe"), device="cuda", dtype="bf16", experts=ExpertPolicy(slots=4))
    assert lm.model.prompt_graphs is None  # their chunks stage experts from the host first, on the host


@pytest.mark.gpu
def test_sizes_outside_the_range_and_the_lru(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graphs, "PROMPT_GRAPH_SIZES", 1)
    lm = load_model(_model(tmp_path, "qwen3"), device="cuda", dtype="bf16")
    pg = lm.model.prompt_graphs
    cache = lm.model.new_cache(64, "bf16")
    assert pg.step(torch.arange(1, 5, device="cuda"), cache, 0) is None  # 4 rows: the decode-sized path
    for t in (20, 20, 24, 24):
        pg.step(torch.arange(1, t + 1, device="cuda"), cache, 0)
    assert list(pg.sets) == [24]


def test_a_capture_that_runs_out_of_vram_leaves_the_size_eager(caplog: pytest.LogCaptureFixture) -> None:
    """A card too full for a size's graphs: the chunk runs eagerly (None), the size is not tried again, and the
    log says so once."""
    from collections import OrderedDict

    pg = object.__new__(cuda_graphs.PromptGraphs)  # no CUDA here: only the bookkeeping around the capture
    pg.seen, pg.failed, pg.sets = set(), set(), OrderedDict()
    tries = []

    def out_of_vram(t: int) -> None:
        tries.append(t)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    pg._capture = out_of_vram
    toks = torch.arange(1, 21)
    with caplog.at_level("WARNING", logger="strata.engine"):
        assert [pg.step(toks, None, 0) for _ in range(4)] == [None] * 4  # type: ignore[arg-type]
    assert tries == [20] and pg.failed == {20} and not pg.sets
    assert sum("run without CUDA graphs" in r.message for r in caplog.records) == 1
