"""Slots through a worker on the card (the product's case: a card in each PC): the worker keeps its slots' KV as
rows of one cache and runs a step's decode rows through its fused path (captured before its first step), the main
does the same with its layers (its slot graphs without the head, which runs after the worker), and each request's logits are the unsplit model's for that sequence alone, with one
group and with two groups pipelined."""

import os
from pathlib import Path

import pytest
import torch

from engine.link.remote import HeadStage
from engine.link.startup import load_split_model
from engine.models.family_base import BatchPart
from engine.pipeline.loader import load_model
from engine.pipeline.split import SplitOptions
from engine.pipeline.stages import SplitModel
from engine.testing.tiny_models import write_tiny_model
from tests.engine.link.harness import TOKEN, start_worker

pytestmark = pytest.mark.gpu
PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "two-groups"])
def test_slots_through_a_worker_on_the_card_match_each_sequence_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)
    path = write_tiny_model(tmp_path / "m4.gguf", "qwen3moe", qtype="Q4_K", types={"ffn_down": "Q6_K"}, seed=5,
                            n_layer=4)  # fmt: skip
    whole = load_model(path, device="cuda", dtype="bf16").model
    flags = ["--device", "auto", "--dtype", "bf16", "--kv", "bf16", "--max-context", "128", "--parallel", "4"]
    worker = start_worker(
        path, 2, extra=flags, env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    )
    try:
        assert any("on CUDA" in line and "(4 slots)" in line for line in worker.log), worker.log
        lm = load_split_model(
            path, SplitOptions(layer_split=(2,), remote=f"127.0.0.1:{worker.port}"), 128, "bf16", "bf16",
            parallel=4,
        )  # fmt: skip
        m = lm.model
        assert isinstance(m, SplitModel) and lm.sequences == 4 and m.pipelines_groups
        caches = m.new_caches(4, 128, "bf16")
        # the main's stage runs the rows through its fused path too, without the head (which runs after the worker)
        assert all(c.shared is not None for c in caches) and m.warm_rows(caches) == 4
        head = m.stages[-1]
        assert (
            isinstance(head, HeadStage)
            and head.graphs is not None
            and sorted(head.graphs.sets) == [1, 2, 3, 4]
        )
        refs = [whole.new_cache(128, "bf16") for _ in range(4)]
        prompts = [PROMPT[: 3 + i] for i in range(4)]
        for p, c, r in zip(prompts, caches, refs, strict=True):
            m.forward(torch.tensor(p), c, 0, last_only=True)
            whole.forward(torch.tensor(p), r, 0, last_only=True)
        toks = [40 + i for i in range(4)]
        for step in range(4):
            parts = [BatchPart(torch.tensor([toks[s]]), caches[s], len(prompts[s]) + step) for s in range(4)]
            if grouped:  # two groups of two, the second sent before the first is read
                a, b = m.launch_batch(parts[:2]), m.launch_batch(parts[2:])
                got = torch.cat([a(), b()])
            else:
                got = m.forward_batch(parts)
            for s in range(4):
                ref = whole.forward(torch.tensor([toks[s]]), refs[s], len(prompts[s]) + step)
                assert _cos(got[s], ref[-1]) >= 0.999, (step, s)
            toks = [int(got[s].argmax()) for s in range(4)]
        m.close()
    finally:
        worker.stop()


def test_the_heads_graphs_give_the_eager_heads_logits(tmp_path: Path) -> None:
    """A remote main's head after the worker replays a graph per row count: the same logits as its eager launches,
    bit for bit, for every row count a step may have; a count not captured runs eagerly."""
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q4_K", types={"ffn_down": "Q6_K"}, seed=5)
    m = load_model(path, device="cuda", dtype="bf16").model
    st = HeadStage(m, "main")
    assert st.graphs is not None and st.warm_head(16) == 16 and st.warm_head(40) == 16
    gen = torch.Generator(device="cuda").manual_seed(3)
    for t in (1, 2, 5, 8, 16, 17):
        x = torch.randn(t, m.cfg.n_embd, device="cuda", generator=gen)
        assert (st.graphs.run(x) is None) == (t > 16)
        want = m.head(x)
        for _ in range(2):  # a replay does not depend on the one before
            got = st.run_parts(
                x, [BatchPart(torch.zeros(t, dtype=torch.long), m.new_cache(32, "bf16"), 0, t)]
            )
            assert got.shape == want.shape and torch.equal(got, want), t
        assert torch.equal(st.run(x[:1], m.new_cache(32, "bf16"), 0, last_only=True), m.head(x[:1]))
