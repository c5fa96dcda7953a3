"""The in-process layer split on the CPU: 2 and 3 stages of tiny MoE models give the unsplit model's logits bit
for bit and its greedy tokens, with the prompt pieces pipelined across stage threads, int8 KV and the prompt
cache included."""

import threading
from pathlib import Path

import pytest
import torch

from engine.link.startup import load_split_model
from engine.pipeline import batch
from engine.pipeline.batch import BatchRunner
from engine.pipeline.generate import DoneEvent, GenerationRequest, PromptChunkEvent, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.prompt_cache import PromptCache
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SPLIT_SPAN_CHUNKS, SplitOptions, prefill_span
from engine.pipeline.stages import SplitModel
from engine.testing.tiny_models import write_tiny_model

PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180, 3, 8]
PIECE = 4  # the split reads pieces of 4 tokens; the unsplit reference reads chunks of 4 at the same positions


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("split")
    return {
        "qwen3moe": write_tiny_model(d / "q3.gguf", "qwen3moe", qtype="Q8_0", seed=5, n_layer=6),
        "qwen2moe": write_tiny_model(d / "q2.gguf", "qwen2moe", qtype="Q4_0", seed=6, n_layer=6),
    }


def _greedy(model: object, tok: object, kv: str, chunk: int, n: int = 10) -> list[int]:
    runner = Runner(model, tok, 64, kv, chunk)  # type: ignore[arg-type]
    req = GenerationRequest(PROMPT, max_tokens=n, sampling=GREEDY, ignore_eos=True)
    return next(e for e in runner.generate(req) if isinstance(e, DoneEvent)).tokens


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("split", [(3,), (2, 4)])
def test_split_matches_unsplit(models: dict[str, Path], arch: str, split: tuple[int, ...]) -> None:
    base = load_model(models[arch], "cpu", "f32")
    lm = load_split_model(
        models[arch],
        SplitOptions(device="cpu", layer_split=split, pipeline=True, pipe_chunk=PIECE),
        64,
        "f32",
        "f32",
    )
    sm = lm.model
    assert isinstance(sm, SplitModel) and len(sm.stages) == len(split) + 1
    assert [s.layers for s in sm.stages] == [
        range(a, b) for a, b in zip((0, *split), (*split, 6), strict=True)
    ]
    with torch.inference_mode():
        ref_cache, cache = base.model.new_cache(64, "f32"), sm.new_cache(64, "f32")
        ref = torch.cat(
            [
                base.model.forward(torch.tensor(PROMPT[o : o + PIECE]), ref_cache, o)
                for o in range(0, 20, PIECE)
            ]
        )
        ours = sm.forward(torch.tensor(PROMPT[:20]), cache, 0)  # five pieces through the pipeline
        assert cache.length == 20
        assert torch.equal(ours, ref)
        assert all(ms > 0 for ms in sm.timing.ms)
        # the next step continues from the split cache exactly as from the unsplit one
        assert torch.equal(
            sm.forward(torch.tensor([9]), cache, 20), base.model.forward(torch.tensor([9]), ref_cache, 20)
        )
    assert torch.equal(sm.expert_counts, base.model.expert_counts)
    # greedy tokens through Runner: prompt chunks of 16 read as pieces of 4 across the stages
    assert _greedy(sm, lm.tokenizer, "f32", 16) == _greedy(base.model, base.tokenizer, "f32", PIECE)


def test_int8_kv_and_prompt_cache_across_stages(models: dict[str, Path]) -> None:
    """The split's one cache object holds each stage's layers on its device; the prompt cache saves and restores
    all of them (a conversation left and taken up again reads only its new tokens, same tokens as unsplit)."""
    path = models["qwen3moe"]
    base = load_model(path, "cpu", "f32")
    lm = load_split_model(
        path, SplitOptions(device="cpu", layer_split=(2, 4), pipe_chunk=PIECE), 64, "int8", "f32"
    )

    def conversation(model: object, tok: object, chunk: int) -> list[list[int]]:
        runner = Runner(model, tok, 64, "int8", chunk, PromptCache(1 << 24, min_tokens=4))  # type: ignore[arg-type]
        other = [5, 6, 7, 8, 9, 10, 11, 12]
        outs = []
        for prompt in (PROMPT[:12], other, [*PROMPT[:12], 77, 78]):
            req = GenerationRequest(prompt, max_tokens=6, sampling=GREEDY, ignore_eos=True)
            outs.append(next(e for e in runner.generate(req) if isinstance(e, DoneEvent)))
        assert outs[2].timings.prompt_cached >= 11  # the first conversation came back from the prompt cache
        return [d.tokens for d in outs]

    assert conversation(lm.model, lm.tokenizer, 16) == conversation(base.model, base.tokenizer, PIECE)


def test_a_failing_stage_fails_the_forward_and_leaves_no_thread(models: dict[str, Path]) -> None:
    lm = load_split_model(
        models["qwen3moe"],
        SplitOptions(device="cpu", layer_split=(2, 4), pipeline=True, pipe_chunk=2),
        64,
        "f32",
        "f32",
    )
    sm = lm.model
    assert isinstance(sm, SplitModel)
    stage = sm.stages[1]
    real = stage.run
    calls = {"n": 0}

    def flaky(x: torch.Tensor, cache: object, start: int) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("stage 1 broke on its third piece")
        return real(x, cache, start)  # type: ignore[arg-type]

    stage.run = flaky  # type: ignore[method-assign]
    with torch.inference_mode(), pytest.raises(RuntimeError, match="third piece"):
        sm.forward(torch.tensor(PROMPT[:16]), sm.new_cache(64, "f32"), 0)
    assert not [t for t in threading.enumerate() if t.name.startswith("strata-stage-")]


def test_serial_split_equals_unsplit_forward(models: dict[str, Path]) -> None:
    """Without the pipeline a split forward runs the same pieces as one forward of the unsplit model."""
    path = models["qwen3moe"]
    base = load_model(path, "cpu", "f32")
    lm = load_split_model(
        path, SplitOptions(device="cpu", layer_split=(3,), pipeline=False), 64, "f32", "f32"
    )
    with torch.inference_mode():
        ours = lm.model.forward(torch.tensor(PROMPT), lm.model.new_cache(64, "f32"), 0)
        ref = base.model.forward(torch.tensor(PROMPT), base.model.new_cache(64, "f32"), 0)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("pipeline", [False, True])
def test_prompt_chunks_compute_the_last_rows_logits_only(models: dict[str, Path], pipeline: bool) -> None:
    """A prompt chunk (last_only, as the Runner asks for one) gets the last row's logits from the stage with the
    head, serial and in pipelined pieces: the same row as the full forward's, and the cache holds every position."""
    path = models["qwen3moe"]
    lm = load_split_model(
        path,
        SplitOptions(device="cpu", layer_split=(2, 4), pipeline=pipeline, pipe_chunk=PIECE),
        64,
        "f32",
        "f32",
    )
    m = lm.model
    assert isinstance(m, SplitModel)
    with torch.inference_mode():
        full_cache, last_cache = m.new_cache(64, "f32"), m.new_cache(64, "f32")
        full = m.forward(torch.tensor(PROMPT), full_cache, 0)
        last = m.forward(torch.tensor(PROMPT), last_cache, 0, last_only=True)
        assert last.shape == (1, full.shape[1])
        # a one-row matrix product may round differently from the same row in a many-row one
        assert (last - full[-1:]).abs().max().item() < 1e-4
        assert last_cache.length == full_cache.length == len(PROMPT)
        # the next step reads the same cache: the same logits either way
        nxt = torch.tensor([PROMPT[0]])
        assert torch.equal(m.forward(nxt, last_cache, len(PROMPT)), m.forward(nxt, full_cache, len(PROMPT)))


def test_a_pipelined_split_reads_a_long_prompt_in_spans_that_empty_the_pipeline_once(
    models: dict[str, Path],
) -> None:
    """On a split whose stages read pieces at once, Runner reads a prompt in spans of several chunks (the pipeline
    empties once a span, not once a chunk): the same pieces at the same positions, so the unsplit model's greedy
    tokens; a split whose stages take turns keeps reading chunk by chunk."""
    base = load_model(models["qwen3moe"], "cpu", "f32")
    opts = SplitOptions(device="cpu", layer_split=(3,), pipeline=True, pipe_chunk=PIECE)
    sm = load_split_model(models["qwen3moe"], opts, 64, "f32", "f32").model
    assert prefill_span(sm, 4, 64) == 4 * SPLIT_SPAN_CHUNKS
    assert prefill_span(sm, 8, 20) == 20  # never past the context
    serial = load_split_model(
        models["qwen3moe"], SplitOptions(device="cpu", layer_split=(3,), pipe_chunk=PIECE), 64, "f32", "f32"
    ).model
    assert not serial.pipelines_prompts and prefill_span(serial, 4, 64) == 4

    runner = Runner(sm, base.tokenizer, 64, "f32", 4, prefill_span=16)  # type: ignore[arg-type]
    req = GenerationRequest(PROMPT, max_tokens=10, sampling=GREEDY, ignore_eos=True)
    events = list(runner.generate(req))
    assert [e.tokens for e in events if isinstance(e, PromptChunkEvent)] == [16, 6]
    got = next(e for e in events if isinstance(e, DoneEvent)).tokens
    assert got == _greedy(base.model, base.tokenizer, "f32", PIECE)


@pytest.mark.parametrize(
    ("slots", "wait_s", "chunks"),
    [(2, 0.0, [4] * 5 + [2]), (2, 1e9, [4, 16, 2]), (1, 0.0, [16, 6])],
    ids=["slow-stages", "fast-stages", "one-slot"],
)
def test_slots_read_a_lone_prompt_in_spans_where_the_stages_read_one_quickly(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, slots: int, wait_s: float, chunks: list[int]
) -> None:
    """With slots, a prompt read alone on a pipelined split takes spans of several chunks only where a span reads
    within batch.SPAN_WAIT_S at the rate of its last chunk (a request that comes in meanwhile waits for it); the
    first chunk, with no rate yet, is a chunk. With one slot no request can come in meanwhile: spans from the first
    chunk, as the single-sequence Runner's. Either way the tokens are the unsplit model's."""
    monkeypatch.setattr(batch, "SPAN_WAIT_S", wait_s)
    base = load_model(models["qwen3moe"], "cpu", "f32")
    opts = SplitOptions(device="cpu", layer_split=(3,), pipeline=True, pipe_chunk=PIECE)
    sm = load_split_model(models["qwen3moe"], opts, 64, "f32", "f32").model
    br = BatchRunner(sm, base.tokenizer, 64, "f32", slots=slots, step_tokens=4, prefill_span=16)  # type: ignore[arg-type]
    events: list = []
    br.admit(GenerationRequest(PROMPT, max_tokens=10, sampling=GREEDY, ignore_eos=True), events.append)
    while br.busy:
        br.step()
    assert [e.tokens for e in events if isinstance(e, PromptChunkEvent)] == chunks
    got = next(e for e in events if isinstance(e, DoneEvent)).tokens
    assert got == _greedy(base.model, base.tokenizer, "f32", PIECE)
