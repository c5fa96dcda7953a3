"""Prompt-lookup drafts against a brute-force search, the draft statistics in the timings (exact counts for drafts
that are always right and always wrong), and the option checks."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.spec import SpecConfig, SpecError, SuffixDraft, pipeline_for
from engine.serve.protocol import timings_dict
from tests.engine.spec.toys import ScriptedDraft, reference_greedy


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=18),
    st.integers(0, 3),
    st.integers(1, 6),
)
def test_suffix_draft_matches_brute_force(seq: list[int], pending: int, n: int) -> None:
    cut = max(0, len(seq) - pending)
    committed, pend = seq[:cut], seq[cut:]
    src = SuffixDraft(min_match=2, max_match=5)
    src.reset(committed[: cut // 2])
    src.commit(committed[cut // 2 :])  # indexing in two steps gives the same index
    got = src.propose(pend, n)
    expect, m = _brute_force(committed, pend, n, 2, 5)
    assert (got.tokens, got.match) == (expect, m)


def _brute_force(committed: list[int], pend: list[int], n: int, lo: int, hi: int) -> tuple[list[int], int]:
    """The longest suffix (lo..hi tokens) of committed + pend that occurred earlier and was followed inside the
    committed part (latest occurrence on a tie), and n tokens of its continuation, by trying every place."""
    seq = committed + pend
    best_end, best_m = -1, 0
    for end in range(len(committed) - 1, lo - 1, -1):  # followed by committed[end]; latest first
        m = 0
        while m < hi and end - m - 1 >= 0 and seq[end - m - 1] == seq[len(seq) - m - 1]:
            m += 1
        if m >= lo and m > best_m:
            best_end, best_m = end, m
    if best_end < 0:
        return [], 0
    ext = list(seq)
    for i in range(n):
        ext.append(ext[best_end + i])
    return ext[len(seq) :], best_m


def test_suffix_draft_examples() -> None:
    src = SuffixDraft(min_match=2, max_match=8)
    src.reset([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2])
    # "1 2" occurs three times; extended backwards none is longer, so the latest: followed by 3 5 7 1 2 ...
    assert src.propose([], 4).tokens == [3, 5, 7, 1]
    assert src.propose([3, 4], 3).tokens == [9, 1, 2]  # "... 2 3 4" matched at the start
    assert src.propose([6], 3).tokens == []  # "2 6" never seen
    periodic = SuffixDraft(2, 8)
    periodic.reset([4, 5, 6, 4, 5])
    assert periodic.propose([], 7).tokens == [6, 4, 5, 6, 4, 5, 6]  # runs into the present and repeats it


def test_stats_exact(tiny_models: dict[str, Path]) -> None:
    lm = load_model(tiny_models["llama"], "cpu", "f32")
    prompt = [5, 9, 33, 71, 120, 200, 7, 64]
    m = 24
    ref = reference_greedy(lm.model, prompt, m, 64)
    truth = prompt + ref
    vocab = lm.config.n_vocab
    req = GenerationRequest(prompt, max_tokens=m, sampling=GREEDY, ignore_eos=True)

    def run(wrong_every: int) -> DoneEvent:
        r = Runner(
            lm.model, lm.tokenizer, 64, "f32", 64, spec=SpecConfig(n=4),
            drafts=lambda s: ScriptedDraft(truth, vocab, wrong_every),
        )  # fmt: skip
        return [e for e in r.generate(req) if isinstance(e, DoneEvent)][0]

    right = run(0)
    # The first token comes from the prompt's logits; windows of 4 kept drafts + the bonus give 5 each; the last
    # window has 3 tokens of budget left.
    t = right.timings
    assert right.tokens == ref
    assert (t.decode_windows, t.drafts_proposed, t.drafts_accepted) == (5, 19, 19)
    assert t.draft_acceptance == 1.0
    wrong = run(1).timings
    assert (wrong.decode_windows, wrong.drafts_proposed, wrong.drafts_accepted) == (23, 20 * 4 + 3 + 2 + 1, 0)
    body = timings_dict(t)
    assert (body["draft_n"], body["draft_n_accepted"]) == (19, 19)


def test_options() -> None:
    with pytest.raises(SpecError, match="--spec 33"):
        SpecConfig(n=33)
    with pytest.raises(SpecError, match="--pipeline-windows 1"):
        SpecConfig(n=4, pipeline_windows=1)
    assert not SpecConfig(n=0).drafting and not SpecConfig(n=4, suffix=False, draft_layer=False).drafting


def test_pipeline_windows_off_says_why(tiny_models: dict[str, Path]) -> None:
    lm = load_model(tiny_models["llama"], "cpu", "f32")
    lines: list[str] = []
    assert pipeline_for(lm.model, SpecConfig(n=4, pipeline_windows=2), lines.append) is None
    assert lines == [
        "--pipeline-windows 2 is off: it needs a layer split of two or more stages (--layer-split)"
    ]
    assert pipeline_for(lm.model, SpecConfig(n=4), lines.append) is None and len(lines) == 1
