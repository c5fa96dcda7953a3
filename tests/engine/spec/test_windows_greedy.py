"""Greedy tokens with verify windows (--spec 2/4/8) are the tokens of a plain one-token-per-forward loop, on tiny
models of every architecture (qwen3next's recurrent state included), on one stage and on a 2-stage CPU split
(serial windows and --pipeline-windows 2): with drafts copied from a repetitive prompt, with drafts that are always
wrong (every window rejected) and with drafts that are mostly right (most windows kept)."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY, Sampler
from engine.pipeline.spec import DraftSource, SpecConfig
from engine.testing.tiny_models import ARCHITECTURES
from engine.testing.tokenizer_fixture import tiny_bpe_metadata
from engine.tokenizer import Tokenizer
from tests.engine.spec.conftest import EVERY_ARCHITECTURE
from tests.engine.spec.toys import BigramToy, ScriptedDraft, reference_greedy, two_stage_split

BASE = [5, 9, 33, 71, 120, 200, 7, 64, 3, 11]
REPETITIVE = BASE * 2  # the lookup finds the prompt's own tail earlier in it
N = 16
CTX = 128

Drafts = Callable[[Sampler], DraftSource | None] | None


def _run(model: object, tok: object, spec: SpecConfig, drafts: Drafts = None) -> DoneEvent:
    runner = Runner(model, tok, CTX, "f32", 64, spec=spec, drafts=drafts)  # type: ignore[arg-type]
    req = GenerationRequest(REPETITIVE, max_tokens=N, sampling=GREEDY, ignore_eos=True)
    done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)]
    assert len(done) == 1
    return done[0]


def _lookup_must_draft(truth: list[int], start: int) -> bool:
    """Whether some step of a decode without kept drafts ends on a pair of tokens seen, and followed, before."""
    for pos in range(start, len(truth) - 1):
        key = truth[pos - 1 : pos + 1]
        if any(truth[i : i + 2] == key for i in range(pos - 2)):
            return True
    return False


def _scripted(truth: list[int], vocab: int, wrong_every: int) -> Drafts:
    return lambda sampler: ScriptedDraft(truth, vocab, wrong_every)


@pytest.mark.parametrize("arch", EVERY_ARCHITECTURE)
def test_one_stage(tiny_models: dict[str, Path], arch: str) -> None:
    lm = load_model(tiny_models[arch], "cpu", "f32")
    ref = reference_greedy(lm.model, REPETITIVE, N, CTX)
    truth = REPETITIVE + ref
    vocab = lm.config.n_vocab
    assert _run(lm.model, lm.tokenizer, SpecConfig(n=0)).tokens == ref
    for n in (2, 4, 8):
        lookup = _run(lm.model, lm.tokenizer, SpecConfig(n=n))
        assert lookup.tokens == ref, f"--spec {n}, prompt lookup"
        if _lookup_must_draft(truth, len(REPETITIVE)):
            assert lookup.timings.drafts_proposed > 0

        wrong = _run(lm.model, lm.tokenizer, SpecConfig(n=n), _scripted(truth, vocab, 1))
        assert wrong.tokens == ref, f"--spec {n}, every draft wrong"
        assert wrong.timings.drafts_accepted == 0 and wrong.timings.drafts_proposed > 0
        assert wrong.timings.decode_windows == N - 1  # one token per window, as without drafts

        right = _run(lm.model, lm.tokenizer, SpecConfig(n=n), _scripted(truth, vocab, 7))
        assert right.tokens == ref, f"--spec {n}, most drafts right"
        t = right.timings
        assert t.drafts_accepted >= 0.5 * t.drafts_proposed > 0
        assert t.decode_windows < (N - 1) / 2


@pytest.mark.parametrize("arch", EVERY_ARCHITECTURE)
def test_two_stage_split(tiny_models: dict[str, Path], arch: str) -> None:
    path = tiny_models[arch]
    ref_model = load_model(path, "cpu", "f32")
    ref = reference_greedy(ref_model.model, REPETITIVE, N, CTX)
    truth = REPETITIVE + ref
    sm = two_stage_split(path, arch, ref_model.config.n_layer // 2, CTX)
    assert len(sm.stages) == 2
    tok = ref_model.tokenizer
    vocab = ref_model.config.n_vocab
    wrong, right = _scripted(truth, vocab, 1), _scripted(truth, vocab, 0)
    cases: list[tuple[SpecConfig, Drafts]] = [
        (SpecConfig(n=2), None),
        (SpecConfig(n=4), wrong),
        (SpecConfig(n=8), _scripted(truth, vocab, 5)),
        (SpecConfig(n=4, pipeline_windows=2), None),
        (SpecConfig(n=4, pipeline_windows=2), wrong),
    ]
    for spec, drafts in cases:
        done = _run(sm, tok, spec, drafts)
        assert done.tokens == ref, f"{spec}, {'lookup' if drafts is None else 'scripted'} drafts"

    # Guessed windows: with right drafts the front stages' guesses hold; forced misses read every window again.
    held = _run(sm, tok, SpecConfig(n=4, pipeline_windows=2), right)
    assert held.tokens == ref
    if arch == "qwen3next":  # recurrent state: --pipeline-windows stays off (pipeline_support says why)
        assert held.timings.guessed_windows == 0
        return
    assert held.timings.guessed_kept >= 2 and held.timings.drafts_accepted == held.timings.drafts_proposed
    missed = _run(sm, tok, SpecConfig(n=4, pipeline_windows=2, force_guess_miss=True), right)
    assert missed.tokens == ref
    assert missed.timings.guessed_windows >= 2 and missed.timings.guessed_kept == 0


def test_penalties_and_stop_inside_kept_drafts(tiny_models: dict[str, Path]) -> None:
    """Penalties see each row's own history; a stop that falls inside a window's kept drafts ends the answer
    there, and the KV keeps only what was emitted, so the next request reuses it exactly."""
    lm = load_model(tiny_models["qwen2"], "cpu", "f32")
    params = GREEDY.__class__(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.5)
    plain = Runner(lm.model, lm.tokenizer, CTX, "f32", 64)
    req = GenerationRequest(REPETITIVE, max_tokens=N, sampling=params, ignore_eos=True)
    ref = [e for e in plain.generate(req) if isinstance(e, DoneEvent)][0].tokens
    truth = REPETITIVE + ref
    vocab = lm.config.n_vocab
    runner = Runner(
        lm.model, lm.tokenizer, CTX, "f32", 64, spec=SpecConfig(n=4), drafts=_scripted(truth, vocab, 0)
    )
    done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
    assert done.tokens == ref and done.timings.drafts_accepted > 0

    # max_tokens inside a window of kept drafts: the cache holds the prompt and the emitted tokens but the last
    short = GenerationRequest(REPETITIVE, max_tokens=7, sampling=params, ignore_eos=True)
    out = [e for e in runner.generate(short) if isinstance(e, DoneEvent)][0].tokens
    assert out == ref[:7]
    assert runner.cached_tokens == (REPETITIVE + out)[: len(runner.cached_tokens)]
    assert runner.cache.length == len(runner.cached_tokens) <= len(REPETITIVE) + 7


def test_end_of_generation_inside_kept_drafts() -> None:
    """A toy target that says 3 4 5 then end-of-text, drafted right in one window: the answer ends before the
    end token, finish is "stop", and the cache holds the prompt and the answer only."""
    tok = Tokenizer.from_metadata(tiny_bpe_metadata())
    eot = min(tok.eog_ids)
    target = torch.full((512, 512), -10.0)
    for a, b in ((2, 3), (3, 4), (4, 5), (5, eot), (eot, 6)):
        target[a, b] = 10.0
    toy = BigramToy(target, target)
    toy.draft_layer_count = 0  # drafts from the script below, not from the toy's draft layer
    truth = [1, 2, 3, 4, 5, eot, 6, 6, 6]
    runner = Runner(toy, tok, 32, "f32", 8, spec=SpecConfig(n=6), drafts=_scripted(truth, 512, 0))
    req = GenerationRequest([1, 2], max_tokens=8, sampling=GREEDY)
    events = list(runner.generate(req))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert done.tokens == [3, 4, 5] and done.finish_reason == "stop"
    # 4 5 eot 6 kept (the target says 0 after 6), then the answer stops at eot
    assert done.timings.decode_windows == 1 and done.timings.drafts_accepted == 4
    assert runner.cached_tokens == [1, 2, 3, 4, 5] and runner.cache.length == 5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_windows_logits_are_the_one_token_steps_to_the_bit_on_the_cpu(
    tiny_models: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU with 8-bit activations (the default) a window of up to 8 rows attends row by row as one-token
    steps do, and its matrix products round each row as a one-row product does: its logits are the one-token
    steps' exactly, so greedy output with drafts is the output without (a float difference of 1e-6 in the
    attention used to flip activation codes downstream and, on a near-tie, a token)."""
    monkeypatch.setenv("STRATA_ACTIVATIONS", "int8")
    lm = load_model(tiny_models[arch], "cpu", "f32")
    m = lm.model
    ids = torch.tensor(REPETITIVE)
    w = 5
    a, b = m.new_cache(CTX, "f32"), m.new_cache(CTX, "f32")
    m.forward(ids[:-w], a, 0, last_only=True)
    m.forward(ids[:-w], b, 0, last_only=True)
    window = m.forward(ids[-w:], a, len(ids) - w)
    steps = torch.cat([m.forward(ids[j : j + 1], b, j) for j in range(len(ids) - w, len(ids))])
    assert torch.equal(window, steps)
