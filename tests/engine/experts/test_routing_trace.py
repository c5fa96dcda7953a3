"""Routing traces: the file format (and bad files refused), the cache simulator's rules, the generator's calibration
against the published figures of real routing, and record -> replay on a tiny MoE model on the CPU."""

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cli import main
from engine.experts.trace import (
    RoutingTrace,
    TraceError,
    coverage,
    for_model,
    hit_rate,
    load_trace,
    save_trace,
    usage_counts,
)
from engine.experts.trace_gen import PRESETS, TraceParams, generate, preset, trace_spec
from engine.link.startup import load_split_model
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.sampling import SamplingParams
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _trace(n: int = 5, layers: int = 2, n_expert: int = 8, k: int = 2, seed: int = 0) -> RoutingTrace:
    return generate(n, layers, n_expert, k, TraceParams(skew=1.0, reuse=0.5), seed=seed)


def test_a_trace_round_trips_through_its_file(tmp_path: Path) -> None:
    t = _trace()
    t.meta["model"] = "x.gguf"
    back = load_trace(save_trace(tmp_path / "t.npz", t))
    np.testing.assert_array_equal(back.ids, t.ids)
    np.testing.assert_array_equal(back.weights, t.weights)
    assert back.layers == t.layers and back.n_expert == 8 and back.k == 2 and back.tokens == 5
    assert back.meta["model"] == "x.gguf" and back.meta["source"] == "generated"
    assert not list(tmp_path.glob("*.part"))


def test_bad_trace_files_are_refused_saying_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "none.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(TraceError, match="not a readable routing trace"):
        load_trace(junk)
    other = tmp_path / "other.npz"
    np.savez(other, ids=np.zeros((2, 1, 1), np.int16))
    with pytest.raises(TraceError, match="lacks layers, meta, weights"):
        load_trace(other)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, ids=np.array([{"a": 1}], dtype=object), weights=np.zeros(1), layers=np.zeros(1),
             meta=np.zeros(1, np.uint8))  # fmt: skip
    with pytest.raises(TraceError):
        load_trace(pickled)  # object arrays would need pickle: never loaded
    good = save_trace(tmp_path / "good.npz", _trace())
    with zipfile.ZipFile(good) as z:
        parts = {n: z.read(n) for n in z.namelist()}
    bad_meta = tmp_path / "meta.npz"
    np.savez(bad_meta, **{n[:-4]: np.load(good)[n[:-4]] for n in parts if n != "meta.npy"},
             meta=np.frombuffer(b'{"format": "something-else"}', np.uint8))  # fmt: skip
    with pytest.raises(TraceError, match="not a routing trace"):
        load_trace(bad_meta)
    with pytest.raises(TraceError, match=r"outside 0\.\.7"):
        RoutingTrace(np.full((1, 1, 1), 9, np.int16), np.ones((1, 1, 1), np.float32), [0], 8)
    with pytest.raises(TraceError, match="differ in shape"):
        RoutingTrace(np.zeros((2, 1, 1), np.int16), np.ones((1, 1, 1), np.float32), [0], 8)


def test_a_trace_fits_a_model_or_says_why_not() -> None:
    t = _trace(layers=2)
    assert for_model(t, [1, 3], 8, 2).layers == [1, 3]  # generated: the model's MoE layers in order
    with pytest.raises(TraceError, match="routes to 2 of 8 experts; this model to 4 of 8"):
        for_model(t, [1, 3], 8, 4)
    rec = RoutingTrace(t.ids, t.weights, [0, 1], 8, {"source": "recorded"})
    with pytest.raises(TraceError, match=r"no routing for MoE layers \[2\]"):
        for_model(rec, [0, 2], 8, 2)
    assert for_model(rec, [1], 8, 2).layers == [1]  # a stage's part of the layers


def test_a_traces_usage_counts_land_on_its_layers() -> None:
    t = _trace(n=6, layers=2)
    c = usage_counts(t, 3, start=2)  # generated: laid on the last two of three layers
    assert c.shape == (3, 8) and c[0].sum() == 0
    for j in range(2):
        np.testing.assert_array_equal(
            c[1 + j], np.bincount(t.ids[2:, j].ravel().astype(np.int64), minlength=8)
        )
    rec = RoutingTrace(t.ids, t.weights, [0, 2], 8, {"source": "recorded"})
    c = usage_counts(rec, 3)
    assert c[1].sum() == 0 and c[0].sum() == c[2].sum() == 6 * 2


def test_the_simulated_caches_follow_their_rules() -> None:
    seq = np.array([[0], [1], [0], [2], [1]])
    # LRU of 2: 0 and 1 in, 0 hits, 2 evicts 1 (older), 1 misses again
    assert hit_rate(seq, 2, "lru") == pytest.approx(1 / 5)
    # LFU: 0 used twice stays; 2 replaces 1; 1 replaces 2 (lowest decayed count)
    assert hit_rate(seq, 2, "lfu") == pytest.approx(1 / 5)
    # 2 arrives when 0 (used thrice) is older than 1 (used once): LRU evicts 0, LFU evicts 1
    often = np.array([[0], [0], [0], [1], [2], [0]])
    assert hit_rate(often, 2, "lru") == pytest.approx(2 / 6)
    assert hit_rate(often, 2, "lfu") == pytest.approx(3 / 6)
    assert hit_rate(seq, 2, "static") == pytest.approx(4 / 5)  # 0 and 1 kept: the trace's two most used
    assert hit_rate(seq, 8, "lru") == pytest.approx(2 / 5)  # only first uses miss
    # a step choosing more experts than the cache holds admits what fits and never evicts its own
    assert hit_rate(np.array([[0, 1, 2], [0, 1, 2]]), 2, "lru") == pytest.approx(2 / 6)
    assert coverage(np.array([[0], [0], [0], [1]]), 4, 0.7) == 0.25
    with pytest.raises(ValueError, match="use one of lru, lfu, static"):
        hit_rate(seq, 2, "fifo")


def test_the_realistic_preset_matches_the_published_routing_figures() -> None:
    """Qwen3-30B-A3B geometry (128 experts, top-8): 90% of the mass needs 45-51% of the experts; an LRU of
    12.5-25% of the experts hits 67-81% (docs/performance.md, "Routing traces")."""
    t = generate(1500, 3, 128, 8, preset("realistic"), seed=11)
    cov = np.mean([coverage(t.ids[:, j], 128) for j in range(3)])
    lru16 = np.mean([hit_rate(t.ids[:, j], 16) for j in range(3)])
    lru32 = np.mean([hit_rate(t.ids[:, j], 32) for j in range(3)])
    assert 0.45 <= cov <= 0.51, cov
    assert 0.67 <= lru16 <= 0.81 and 0.67 <= lru32 <= 0.81 and lru16 < lru32, (lru16, lru32)
    u = generate(1500, 2, 128, 8, PRESETS["uniform"], seed=11)
    assert coverage(u.ids[:, 0], 128) > 0.85 and abs(hit_rate(u.ids[:, 0], 16) - 0.125) < 0.03
    loc = generate(1500, 2, 128, 8, PRESETS["local"], seed=11)
    assert hit_rate(loc.ids[:, 0], 16) > lru16 + 0.08
    # every token's experts are distinct; weights are sorted and sum to one
    assert all(len(set(r)) == 8 for r in t.ids[:, 0].tolist())
    assert np.allclose(t.weights.sum(-1), 1.0, atol=1e-5) and (np.diff(t.weights, axis=-1) <= 0).all()
    with pytest.raises(ValueError, match="use one of uniform, realistic, local"):
        preset("real")


def test_streams_interleave_conversations_of_one_popularity() -> None:
    """realistic-x8: token i is conversation i % 8's token i // 8. Each conversation keeps the preset's recency (its
    own LRU hits as one stream's do), all share the layers' popularity, and 8 consecutive tokens (one step of 8
    slots' decode rows) choose more distinct experts than 8 neighbouring tokens of one conversation."""
    params, streams = trace_spec("realistic-x8")
    assert params == preset("realistic") and streams == 8 and trace_spec("uniform") == (preset("uniform"), 1)
    one = generate(1600, 2, 128, 8, params, seed=11)
    many = generate(1600, 2, 128, 8, params, seed=11, streams=8)
    assert many.meta["streams"] == 8 and "streams" not in one.meta and many.ids.shape == one.ids.shape
    for j in range(2):
        own = np.mean([hit_rate(many.ids[s::8, j], 16) for s in range(8)])
        assert abs(own - hit_rate(one.ids[:, j], 16)) < 0.05, own
        # the interleaved trace read in order has lost its recency: one step's 8 rows are 8 conversations
        assert hit_rate(many.ids[:, j], 16) < own - 0.15

        def distinct(ids: np.ndarray) -> float:
            return float(np.mean([len(np.unique(ids[i : i + 8])) for i in range(0, ids.shape[0], 8)]))

        assert distinct(many.ids[:, j]) > distinct(one.ids[:, j]) + 5
        # one popularity: the conversations' most used experts agree
        a = np.bincount(many.ids[0::8, j].ravel(), minlength=128)
        b = np.bincount(many.ids[1::8, j].ravel(), minlength=128)
        assert np.corrcoef(a, b)[0, 1] > 0.5
    with pytest.raises(ValueError, match="streams"):
        generate(4, 1, 8, 2, params, streams=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("trace") / "tiny.gguf", "qwen3moe", qtype="Q8_0", seed=3)


PROMPTS = ["hello there", "write a poem about the sea", "what is 2+2?"]


def _greedy(tiny: Path, n: int) -> tuple[list[list[int]], np.ndarray]:
    lm = load_split_model(tiny, SplitOptions(device="cpu", use_profile=False))
    runner = Runner(lm.model, lm.tokenizer, 256, "f32", 64)
    out = []
    for text in PROMPTS:
        rendered = lm.chat.render([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = lm.tokenizer.encode(rendered, add_special=True, parse_special=True)
        req = GenerationRequest(
            ids, max_tokens=n, sampling=SamplingParams(temperature=0.0), cache_prompt=False
        )
        done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)]
        out.append(done[0].tokens)
    counts = lm.model.expert_counts
    assert counts is not None
    return out, counts.cpu().numpy()


def test_a_recorded_trace_replays_to_the_same_tokens_on_the_cpu(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_PROFILE_DIR", str(tmp_path / "profiles"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    trace_path = tmp_path / "tiny.npz"
    args = ["profile", "--device", "cpu", "--model", str(tiny), "--prompts", str(prompts), "-n", "6"]
    assert main([*args, "--trace", str(trace_path)]) == 0
    out = capsys.readouterr().out
    t = load_trace(trace_path)
    assert f"routing trace {trace_path}: {t.tokens} tokens x 2 MoE layers x 2" in out
    assert t.meta["source"] == "recorded" and t.meta["model"] == "tiny.gguf" and t.layers == [0, 1]

    plain, plain_counts = _greedy(tiny, 6)
    # the trace holds every token the profile read, each layer's choices as the counts saw them
    assert t.tokens == plain_counts[0].sum() // 2
    for j in range(2):
        np.testing.assert_array_equal(np.bincount(t.ids[:, j].ravel(), minlength=8), plain_counts[j])

    monkeypatch.setenv("STRATA_ROUTE_TRACE", str(trace_path))
    replayed, counts = _greedy(tiny, 6)
    assert replayed == plain
    np.testing.assert_array_equal(counts, plain_counts)

    # another trace steers the routing: the counts are the trace's own, token for token
    other = generate(t.tokens, 2, 8, 2, PRESETS["local"], seed=5)
    save_trace(tmp_path / "other.npz", other)
    monkeypatch.setenv("STRATA_ROUTE_TRACE", str(tmp_path / "other.npz"))
    _, steered = _greedy(tiny, 6)
    n = int(steered[0].sum()) // 2
    for j in range(2):
        np.testing.assert_array_equal(
            np.bincount(other.ids[:n, j].ravel().astype(np.int64), minlength=8), steered[j]
        )


def test_a_trace_for_another_model_is_refused_at_load(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_trace(tmp_path / "big.npz", generate(4, 48, 128, 8, PRESETS["uniform"]))
    monkeypatch.setenv("STRATA_ROUTE_TRACE", str(tmp_path / "big.npz"))
    with pytest.raises(TraceError, match="routes to 8 of 128 experts; this model to 2 of 8"):
        load_split_model(tiny, SplitOptions(device="cpu", use_profile=False))
    assert torch.get_num_threads() == 1
