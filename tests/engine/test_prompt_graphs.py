"""Prompt chunks as CUDA graphs (engine/pipeline/cuda_graphs.py, PromptGraphs): the same logits, KV cache and
expert counts as the eager layers, whatever the chunk's position and however many pad rows its captured size
adds; and the cases that must stay eager."""

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
    # a second chunk of another size at a later position; they run as sizes 48 and 32 (8 and 2 pad rows)
    chunks = [(0, ids[:40]), (40, ids[40:])]
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
    assert set(m.prompt_graphs.sets) == {48, 32}


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
def test_sizes_share_buckets_and_warm_captures_them_at_load(tmp_path: Path) -> None:
    lm = load_model(_model(tmp_path, "qwen3"), device="cuda", dtype="bf16")
    m, pg = lm.model, lm.model.prompt_graphs
    cache = m.new_cache(256, "bf16")
    assert pg.step(torch.arange(1, 2, device="cuda"), cache, 0) is None  # one token: the decode step's path
    assert pg.step(torch.arange(1, 21, device="cuda"), cache, 0) is None  # 20 tokens: bucket 24, first seen
    assert pg.step(torch.arange(1, 25, device="cuda"), cache, 0) is not None  # 24: the same bucket, captured
    assert list(pg.sets) == [24]
    assert pg.warm(100) == [4, 8, 12, 16, 32, 48, 64, 96, 128]  # the sizes a 100-token chunk may need, but 24
    ids = torch.randint(1, 400, (50,), generator=torch.Generator().manual_seed(2))
    got = pg.step(ids.cuda(), m.new_cache(256, "bf16"), 0)  # a length never seen: the warmed size 64 at once
    assert got is not None
    torch.testing.assert_close(got, _eager(m, ids, m.new_cache(256, "bf16"), 0), rtol=1e-3, atol=1e-3)


def test_a_capture_that_runs_out_of_vram_leaves_the_size_eager(caplog: pytest.LogCaptureFixture) -> None:
    """A card too full for a size's graphs: the chunk runs eagerly (None), the size is not tried again, and the
    log says so once."""
    pg = object.__new__(cuda_graphs.PromptGraphs)  # no CUDA here: only the bookkeeping around the capture
    pg.seen, pg.failed, pg.sets = set(), set(), {}
    tries = []

    def out_of_vram(t: int) -> None:
        tries.append(t)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    pg._capture = out_of_vram
    toks = torch.arange(1, 21)
    with caplog.at_level("WARNING", logger="strata.engine"):
        assert [pg.step(toks, None, 0) for _ in range(4)] == [None] * 4  # type: ignore[arg-type]
    assert tries == [24] and pg.failed == {24} and not pg.sets  # 20 tokens run as 24
    assert sum("run without CUDA graphs" in r.message for r in caplog.records) == 1


def test_every_chunk_size_has_a_bucket_at_most_half_again_as_large() -> None:
    assert cuda_graphs.prompt_bucket(1) is None and cuda_graphs.prompt_bucket(1025) is None
    for t in range(2, 1025):
        b = cuda_graphs.prompt_bucket(t)
        assert b is not None and t <= b <= max(4, (3 * t + 1) // 2), t


def test_pad_rows_of_a_chunk_do_not_count() -> None:
    from engine.layers.moe import count_experts

    counts = torch.zeros(6, dtype=torch.int64)
    ids = torch.tensor([[0, 1], [2, 1], [0, 1], [5, 5]])  # rows 2 and 3 are pads
    count_experts(counts, ids, torch.tensor([2]))
    assert counts.tolist() == [1, 2, 1, 0, 0, 0]
    count_experts(counts, ids)
    assert counts.tolist() == [3, 5, 2, 0, 0, 2]


@pytest.mark.gpu
def test_warm_builds_every_attention_kernel_a_prompt_needs(tmp_path: Path) -> None:
    """After warm with the server's KV type, prompts of new lengths at new positions build no attention kernel
    (a server's first prompt of a kind waited ~0.7 s for one)."""
    from engine.kernels.prefill_attention import _prefill_attn_kernel

    lm = load_model(_model(tmp_path, "qwen3"), device="cuda", dtype="bf16")
    m, pg = lm.model, lm.model.prompt_graphs
    pg.warm(128, "bf16")

    def built() -> int:
        return sum(len(c[0]) for c in _prefill_attn_kernel.device_caches.values())

    before = built()
    assert before > 0
    for t, start in ((9, 0), (23, 5), (37, 11), (64, 3), (100, 28), (128, 0)):
        cache = m.new_cache(256, "bf16")
        ids = torch.randint(1, 400, (start + t,), generator=torch.Generator().manual_seed(t))
        if start:
            m.forward(ids[:start], cache, 0)
        assert pg.step(ids[start:].cuda(), cache, start) is not None
    assert built() == before


@pytest.mark.gpu
def test_graphs_without_the_head_hand_every_row_on(tmp_path: Path) -> None:
    """A remote main's first stage holds the head that runs after the chain: its stage's prompt graphs (head=False)
    give every real row's hidden state, as the eager layers do, and the second chunk attends to the first's KV."""
    from engine.pipeline.stages import LocalStage

    lm = load_model(_model(tmp_path, "qwen3moe"), device="cuda", dtype="bf16")
    m = lm.model
    st = LocalStage(m, "first", head=False)
    pg = st.prompt_graphs
    assert pg is not None and pg is not m.prompt_graphs and not pg.head and m.prompt_graphs.head
    pg.warm(64)
    ids = torch.randint(1, 400, (60,), generator=torch.Generator().manual_seed(4)).cuda()
    cache, ref_cache = m.new_cache(128, "bf16"), m.new_cache(128, "bf16")
    # both chunks longer than FAST_MAX_ROWS: layer_at takes up to 16 rows through the decode path (8-bit activations)
    for start, n in ((0, 37), (37, 23)):
        got = st.run(ids[start : start + n], cache, start, last_only=True)
        pos = torch.arange(start, start + n, device=m.device)
        masks = m.step_masks(pos, start + n)
        h = m.embed(ids[start : start + n])
        for i in m.layer_range:
            h = m.layer_at(i, h, ref_cache, pos, start + n, masks)
        assert got.shape == (n, m.cfg.n_embd)
        torch.testing.assert_close(got, h, rtol=1e-3, atol=1e-2)
