"""Several sequences in shared steps (engine/pipeline/batch.py) against each served alone by the Runner: the same
greedy tokens and texts for every architecture, requests joining and leaving mid-run, prompt chunks beside decode
rows, cancels, prefix reuse per slot, and refusals that consume nothing."""

from pathlib import Path

import pytest
import torch

from engine.models.family_base import BatchPart
from engine.pipeline.batch import BatchRunner
from engine.pipeline.generate import (
    DoneEvent,
    Event,
    GenerationError,
    GenerationRequest,
    PromptChunkEvent,
    Runner,
    TextEvent,
    TokenEvent,
)
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY, SamplingParams
from engine.pipeline.spec import SpecConfig
from engine.testing.tiny_families import FAMILIES, write_tiny_family
from engine.testing.tiny_models import ARCHITECTURES, write_tiny_model


@pytest.fixture(autouse=True)
def _float_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    # exact products in both runs: the CPU's 8-bit expert kernels take up to 4 rows, so a batch and a request
    # alone would otherwise round differently
    monkeypatch.setenv("STRATA_ACTIVATIONS", "float")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 500, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _alone(lm: object, req: GenerationRequest, max_ctx: int = 256) -> list[Event]:
    runner = Runner(lm.model, lm.tokenizer, max_ctx, "f32")  # type: ignore[attr-defined]
    return list(runner.generate(req))


def _summary(events: list[Event]) -> tuple[list[int], str, str]:
    done = [e for e in events if isinstance(e, DoneEvent)]
    assert len(done) == 1 and events[-1] is done[0]
    text = "".join(e.text for e in events if isinstance(e, TokenEvent | TextEvent))
    return done[0].tokens, done[0].finish_reason, text


def _run(
    br: BatchRunner, reqs: list[GenerationRequest], join_at: dict[int, int] | None = None
) -> list[list[Event]]:
    """Admit requests (request i at step join_at[i], default 0) as slots free up, FIFO; step until all are done."""
    join_at = join_at or {}
    got: list[list[Event]] = [[] for _ in reqs]
    waiting = list(range(len(reqs)))
    step = 0
    while waiting or br.busy:
        while waiting and br.free and join_at.get(waiting[0], 0) <= step:
            i = waiting.pop(0)
            br.admit(reqs[i], got[i].append)
        br.step()
        step += 1
        assert step < 5000
    return got


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eight_requests_at_once_give_each_ones_tokens_alone(tmp_path: Path, arch: str, overlap: bool) -> None:
    lm = load_model(
        write_tiny_model(tmp_path / f"{arch}.gguf", arch, "Q8_0", seed=4), device="cpu", dtype="f32"
    )
    reqs = [
        GenerationRequest(p, max_tokens=4 + 3 * i, sampling=GREEDY, ignore_eos=True)
        for i, p in enumerate(_prompts(10, seed=1))
    ]
    br = BatchRunner(lm.model, lm.tokenizer, 256, "f32", slots=8, step_tokens=24, overlap=overlap)
    got = _run(br, reqs, join_at={8: 3, 9: 7})  # two join while others decode (and wait for a free slot)
    for req, events in zip(reqs, got, strict=True):
        assert _summary(events) == _summary(_alone(lm, req))
    assert br.free == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_the_families_batch_by_sequence(tmp_path: Path, family: str) -> None:
    lm = load_model(
        write_tiny_family(tmp_path / f"{family}.gguf", family, qtype="Q8_0", seed=3), "cpu", "f32"
    )
    reqs = [GenerationRequest(p, max_tokens=6, sampling=GREEDY, ignore_eos=True) for p in _prompts(3, seed=2)]
    got = _run(BatchRunner(lm.model, lm.tokenizer, 256, "f32", slots=3), reqs)
    for req, events in zip(reqs, got, strict=True):
        assert _summary(events) == _summary(_alone(lm, req))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = write_tiny_model(tmp_path_factory.mktemp("b") / "q.gguf", "qwen3moe", "Q8_0", seed=4)
    return load_model(path, device="cpu", dtype="f32")


def test_a_long_prompt_is_read_in_chunks_beside_the_decode_rows(qwen: object) -> None:
    br = BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=2, step_tokens=16)  # type: ignore[attr-defined]
    short = GenerationRequest([5, 6, 7], max_tokens=30, sampling=GREEDY, ignore_eos=True)
    a: list[Event] = []
    br.admit(short, a.append)
    br.step()  # the short prompt is read; it decodes from now on
    long_ = GenerationRequest(list(range(1, 101)), max_tokens=3, sampling=GREEDY, ignore_eos=True)
    b: list[Event] = []
    br.admit(long_, b.append)
    steps = []
    while not any(isinstance(e, TokenEvent) for e in b):  # until the long prompt is read
        got = br.step()
        assert got
        steps += got
    # the 100-token prompt took 7 steps of at most 15 prompt tokens, each beside the short request's decode row
    assert [s.prompt_tokens for s in steps] == [15] * 6 + [10]
    assert all(s.decode_rows == 1 and s.rows <= 16 for s in steps)
    chunks = [e for e in b if isinstance(e, PromptChunkEvent)]
    assert [(c.start, c.tokens) for c in chunks] == [(15 * i, 15) for i in range(6)] + [(90, 10)]
    while br.busy:
        br.step()
    assert _summary(a) == _summary(_alone(qwen, short))
    assert _summary(b) == _summary(_alone(qwen, long_))


def test_a_cancelled_request_frees_its_slot_at_the_next_step(qwen: object) -> None:
    br = BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=1)  # type: ignore[attr-defined]
    gone = False
    events: list[Event] = []
    br.admit(GenerationRequest([1, 2, 3], max_tokens=50, sampling=GREEDY), events.append, lambda: gone)
    br.step()
    br.step()
    assert br.free == 0
    gone = True
    assert br.step() == [] and br.free == 1  # nothing left to run
    assert not any(isinstance(e, DoneEvent) for e in events)
    other: list[Event] = []
    br.admit(GenerationRequest([9, 8], max_tokens=2, sampling=GREEDY, ignore_eos=True), other.append)
    while br.busy:
        br.step()
    assert (
        _summary(other)[0] == _summary(_alone(qwen, GenerationRequest([9, 8], 2, GREEDY, ignore_eos=True)))[0]
    )


def test_a_follow_up_turn_lands_in_the_slot_that_holds_its_prefix(qwen: object) -> None:
    br = BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=3)  # type: ignore[attr-defined]
    first = GenerationRequest(list(range(10, 40)), max_tokens=5, sampling=GREEDY, ignore_eos=True)
    other = GenerationRequest(list(range(50, 60)), max_tokens=5, sampling=GREEDY, ignore_eos=True)
    got = _run(br, [first, other])
    turn2 = GenerationRequest([*first.prompt, *_summary(got[0])[0], 7, 8, 9], max_tokens=4, sampling=GREEDY,
                              ignore_eos=True)  # fmt: skip
    held = next(s for s in br.slots if s.tokens[:30] == first.prompt)
    events: list[Event] = []
    slot = br.admit(turn2, events.append)
    assert slot is held
    while br.busy:
        br.step()
    done = [e for e in events if isinstance(e, DoneEvent)][0]
    assert done.timings.prompt_cached == 34  # the first turn's prompt and the 4 tokens it read back
    assert _summary(events) == _summary(_alone(qwen, turn2))


def test_an_unrelated_request_leaves_a_held_prefix_for_its_return(qwen: object) -> None:
    """A request that shares nothing with any slot goes to an empty (or the least recently used) slot, so a long
    prefix held in another slot is still there when a request that shares it comes back."""
    br = BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=3)  # type: ignore[attr-defined]
    shared = list(range(10, 70))
    a = GenerationRequest([*shared, 1, 2], max_tokens=3, sampling=GREEDY, ignore_eos=True)
    b = GenerationRequest(list(range(100, 160)), max_tokens=3, sampling=GREEDY, ignore_eos=True)
    c = GenerationRequest(list(range(200, 260)), max_tokens=3, sampling=GREEDY, ignore_eos=True)
    again = GenerationRequest([*shared, 3, 4], max_tokens=3, sampling=GREEDY, ignore_eos=True)
    slots = []
    for req in (a, b, c):  # one after another: every slot but the first is free each time
        events: list[Event] = []
        slots.append(br.admit(req, events.append))
        while br.busy:
            br.step()
    assert len({s.index for s in slots}) == 3  # b and c took the empty slots, not a's
    events = []
    assert br.admit(again, events.append) is slots[0]
    while br.busy:
        br.step()
    done = [e for e in events if isinstance(e, DoneEvent)][0]
    assert done.timings.prompt_cached == len(shared)
    assert _summary(events) == _summary(_alone(qwen, again))
    # With no empty slot left, an unrelated request takes the least recently used one (b's), not a's
    d = GenerationRequest(list(range(300, 340)), max_tokens=3, sampling=GREEDY, ignore_eos=True)
    assert br.admit(d, [].append) is slots[1]
    while br.busy:
        br.step()


def test_prompt_kernels_are_built_before_the_first_request_and_leave_the_caches_as_they_were(
    qwen: object,
) -> None:
    """cuda_graphs.read_prompt_sizes (what warm_prompts runs on a card without prompt graphs): each bucket size up
    to the step's tokens and one short of each, alone and two in a step; afterwards the caches hold nothing, the
    expert counts are as before, and a request gets the tokens it gets alone. On the CPU nothing is built."""
    from engine.pipeline.cuda_graphs import read_prompt_sizes, warm_prompts

    m = qwen.model  # type: ignore[attr-defined]
    br = BatchRunner(m, qwen.tokenizer, 256, "f32", slots=2, step_tokens=12)  # type: ignore[attr-defined]
    caches = [s.cache for s in br.slots]
    assert warm_prompts(m, caches, 12) == []  # the CPU builds no kernels
    counts = m.expert_counts.clone() if m.expert_counts is not None else None
    read: list[list[int]] = []
    real = m.forward_batch

    def forward_batch(parts: list[BatchPart]) -> torch.Tensor:
        read.append([int(p.tokens.shape[0]) for p in parts])
        return real(parts)

    m.forward_batch = forward_batch
    try:
        assert read_prompt_sizes(m, [m], caches, 12) == [3, 4, 7, 8, 11, 12]
    finally:
        del m.forward_batch
    assert read == [[3], [3, 3], [4], [4, 4], [7], [8], [11], [12]]
    assert all(c.length == 0 for c in caches)
    if counts is not None:
        assert torch.equal(counts, m.expert_counts)
    req = GenerationRequest(_prompts(1, seed=5)[0], max_tokens=6, sampling=GREEDY, ignore_eos=True)
    assert _summary(_run(br, [req])[0]) == _summary(_alone(qwen, req))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prompt_warm_leaves_every_familys_slots_and_a_runners_cache_as_they_were(
    tmp_path: Path, family: str
) -> None:
    """What warm_prompts runs at a card's load (here on the CPU, the same calls), for each family's model without
    prompt graphs (recurrent state included): afterwards requests in the slots and in a single Runner get the
    tokens they get from a fresh model."""
    from engine.pipeline.cuda_graphs import read_prompt_sizes

    lm = load_model(
        write_tiny_family(tmp_path / f"{family}.gguf", family, qtype="Q8_0", seed=3), "cpu", "f32"
    )
    reqs = [GenerationRequest(p, max_tokens=5, sampling=GREEDY, ignore_eos=True) for p in _prompts(2, seed=7)]
    want = [_summary(_alone(lm, r)) for r in reqs]
    br = BatchRunner(lm.model, lm.tokenizer, 256, "f32", slots=2, step_tokens=12)  # type: ignore[attr-defined]
    assert read_prompt_sizes(lm.model, [lm.model], [s.cache for s in br.slots], 12) == [3, 4, 7, 8, 11, 12]
    assert [_summary(e) for e in _run(br, reqs)] == want
    runner = Runner(lm.model, lm.tokenizer, 256, "f32")  # type: ignore[attr-defined]
    read_prompt_sizes(lm.model, [lm.model], [runner.cache], 12)
    assert [_summary(list(runner.generate(r))) for r in reqs] == want


def test_requests_that_cannot_be_read_are_refused_before_they_take_a_slot(qwen: object) -> None:
    br = BatchRunner(qwen.model, qwen.tokenizer, 32, "f32", slots=1)  # type: ignore[attr-defined]
    with pytest.raises(GenerationError, match="empty"):
        br.admit(GenerationRequest([]), print)
    with pytest.raises(GenerationError, match="--max-context"):
        br.admit(GenerationRequest(list(range(40))), print)
    assert br.free == 1
    br.admit(GenerationRequest([1]), print)
    with pytest.raises(RuntimeError, match="no free slot"):
        br.admit(GenerationRequest([2]), print)


def test_a_failed_step_tells_each_of_its_requests_and_frees_their_slots(qwen: object) -> None:
    class Broken:
        device = torch.device("cpu")

        def new_cache(self, n: int, kv: str) -> object:
            return qwen.model.new_cache(n, kv)  # type: ignore[attr-defined]

        def forward_batch(self, parts: list[BatchPart]) -> torch.Tensor:
            raise RuntimeError("out of memory")

    br = BatchRunner(Broken(), qwen.tokenizer, 64, "f32", slots=2)  # type: ignore[attr-defined]
    failed: list[BaseException] = []
    for p in ([1, 2], [3, 4, 5]):
        br.admit(GenerationRequest(p), print, fail=failed.append)
    assert br.step() == []
    assert [str(e) for e in failed] == ["out of memory"] * 2 and br.free == 2


def test_every_slot_reports_its_state(qwen: object) -> None:
    br = BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=2, step_tokens=8)  # type: ignore[attr-defined]
    br.admit(
        GenerationRequest(list(range(1, 21)), max_tokens=5, sampling=GREEDY, ignore_eos=True), lambda e: None
    )
    br.step()
    assert [s["state"] for s in br.slot_report()] == ["prompt", "idle"]
    while br.slot_report()[0]["state"] == "prompt":
        br.step()
    rep = br.slot_report()[0]
    assert rep["state"] == "decode" and rep["tokens"] == 20


def test_a_layer_split_batches_through_its_stages(tmp_path: Path) -> None:
    """Three in-process stages: each step's rows cross every hand-off together, and each request gets the tokens
    of the unsplit model alone."""
    from engine.link.startup import load_split_model
    from engine.pipeline.split import SplitOptions
    from engine.pipeline.stages import SplitModel

    path = write_tiny_model(tmp_path / "s.gguf", "qwen3moe", "Q8_0", seed=4, n_layer=6)
    whole = load_model(path, device="cpu", dtype="f32")
    lm = load_split_model(path, SplitOptions(device="cpu", layer_split=(2, 4)), 256, "f32", "f32", parallel=3)
    assert isinstance(lm.model, SplitModel) and lm.sequences == 3
    calls: list[int] = []
    send = lm.model.handoffs[0].send
    lm.model.handoffs[0].send = lambda x, marks=None: (calls.append(x.shape[0]), send(x, marks))[1]  # type: ignore[method-assign]
    reqs = [GenerationRequest(p, max_tokens=5, sampling=GREEDY, ignore_eos=True) for p in _prompts(5, seed=3)]
    got = _run(BatchRunner(lm.model, lm.tokenizer, 256, "f32", slots=3), reqs)
    for req, events in zip(reqs, got, strict=True):
        assert _summary(events) == _summary(_alone(whole, req))
    assert max(calls) >= 3  # a step of three decode rows crossed as one tensor


def test_with_8_bit_activations_a_batch_keeps_each_rows_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default --activations int8: a row alone goes through the CPU's 8-bit expert kernels (up to 4 rows), a
    batch of 6 through float products; each row's logits stay within cosine 0.999 of its own alone."""
    monkeypatch.setenv("STRATA_ACTIVATIONS", "int8")
    m = load_model(write_tiny_model(tmp_path / "q.gguf", "qwen3moe", "Q4_K", seed=5), "cpu", "f32").model
    from engine.experts.backends import CpuInPlaceExperts

    assert all(isinstance(b, CpuInPlaceExperts) for b in m.moe.values())  # the 8-bit kernels are in play
    prompts = _prompts(6, seed=6)
    caches = [m.new_cache(64, "f32") for _ in prompts]
    for p, c in zip(prompts, caches, strict=True):
        m.forward(torch.tensor(p), c, 0)
    alone = [m.forward(torch.tensor([7]), c, len(p))[-1] for p, c in zip(prompts, caches, strict=True)]
    for p, c in zip(prompts, caches, strict=True):
        c.truncate(len(p))
    both = m.forward_batch(
        [BatchPart(torch.tensor([7]), c, len(p)) for p, c in zip(prompts, caches, strict=True)]
    )
    for a, b in zip(alone, both, strict=True):
        assert torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item() >= 0.999


def test_both_runners_give_each_token_its_log_probability(qwen: object) -> None:
    """The one-request Runner (its decode windows) and the slots give the same log-probabilities, those of the
    model's raw logits, with the likeliest alternatives."""
    req = GenerationRequest([3, 1, 4, 1, 5], max_tokens=5, sampling=GREEDY, ignore_eos=True, logprobs=2)
    alone = [e.logprob for e in _alone(qwen, req) if isinstance(e, TokenEvent)]
    (batched,) = _run(BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=2), [req])  # type: ignore[attr-defined]
    both = [e.logprob for e in batched if isinstance(e, TokenEvent)]
    assert len(alone) == len(both) == 5
    for a, b in zip(alone, both, strict=True):
        assert a is not None and b is not None and len(a.top) == 2
        assert abs(a.logprob - b.logprob) <= 1e-5 and a.logprob == a.top[0][1]  # greedy: the likeliest


def test_overlapped_steps_give_seeded_draws_stop_strings_and_cancels_as_alone(qwen: object) -> None:
    """With `overlap` a step's tokens are read while the next step runs (each token feeds the next step on the
    device): seeded top-k draws are each request's own alone, a request that meets its stop string mid-flight
    ends there and its slot serves the next request correctly, and a request cancelled while a step holds its
    token leaves without another event."""
    sampled = [
        GenerationRequest(p, max_tokens=9, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=40 + i))
        for i, p in enumerate(_prompts(3, seed=8))
    ]  # fmt: skip
    plain = GenerationRequest([4, 5, 6], max_tokens=12, sampling=GREEDY, ignore_eos=True)
    tokens = _summary(_alone(qwen, plain))[0]
    stop_at = qwen.tokenizer.decode(tokens[3:5])  # type: ignore[attr-defined]
    stopped = GenerationRequest([4, 5, 6], max_tokens=12, sampling=GREEDY, ignore_eos=True, stop=[stop_at])
    after = GenerationRequest([9, 9, 2, 3], max_tokens=7, sampling=GREEDY, ignore_eos=True)
    reqs = [*sampled, stopped, after]
    br = BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=4, overlap=True)  # type: ignore[attr-defined]
    got = _run(br, reqs, join_at={4: 6})  # `after` waits for the slot `stopped` leaves
    for req, events in zip(reqs, got, strict=True):
        assert _summary(events) == _summary(_alone(qwen, req))
    assert _summary(got[3])[1] == "stop" and len(_summary(got[3])[0]) < 12
    gone = False
    events: list[Event] = []
    br.admit(GenerationRequest([1, 2, 3], max_tokens=50, sampling=GREEDY), events.append, lambda: gone)
    for _ in range(4):
        br.step()
    assert br.in_flight  # its next token is still on the device
    seen = len(events)
    gone = True
    br.step()
    assert br.free == 4 and len(events) == seen and not any(isinstance(e, DoneEvent) for e in events)


def _spec_done(events: list[Event]) -> tuple[list[int], int, int, int]:
    done = next(e for e in events if isinstance(e, DoneEvent))
    t = done.timings
    return done.tokens, t.drafts_proposed, t.drafts_accepted, t.decode_windows


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(temperature=0.7, top_k=20, seed=3)], ids=["greedy", "seeded"]
)
def test_verify_windows_per_slot_give_each_requests_tokens_and_drafts_alone(qwen: object, sampling) -> None:
    """--spec with slots: a decoding slot reads its token and the drafts copied from its earlier context in the
    shared step, and keeps what the target agrees with. Each request gets the tokens, drafts, kept drafts and
    forwards the one-request Runner's windows give it (greedy: the tokens of decoding without drafts too)."""
    prompts = [[5, 6, 7, 8] * 6, [11, 12, 13] * 8, list(range(20, 40)), [9] * 6]
    reqs = [GenerationRequest(p, max_tokens=40, sampling=sampling, ignore_eos=True) for p in prompts]
    spec = SpecConfig(n=4)
    br = BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=3, step_tokens=16, spec=spec)  # type: ignore[attr-defined]
    got = _run(br, reqs)  # the fourth waits for a slot
    kept = 0
    for req, events in zip(reqs, got, strict=True):
        runner = Runner(qwen.model, qwen.tokenizer, 256, "f32", spec=spec)  # type: ignore[attr-defined]
        alone = list(runner.generate(req))
        assert _spec_done(events) == _spec_done(alone)
        assert _summary(events) == _summary(alone)
        if sampling is GREEDY:
            assert _summary(events) == _summary(_alone(qwen, req))
        kept += _spec_done(events)[2]
    if sampling is GREEDY:  # the repeating text's windows were kept: fewer forwards than tokens
        assert kept > 20 and _spec_done(got[0])[3] < 20
    for s in br.slots:  # every slot's KV holds what its tokens say (the drafts past the kept ones cut off)
        assert s.cache.length == len(s.tokens)


def test_a_request_that_stops_inside_a_window_leaves_its_slot_exact(qwen: object) -> None:
    """A stop string met on a kept draft ends the request there; the drafts after it leave the slot's KV, and the
    next request in that slot (reusing its prefix) gets the tokens it gets alone."""
    plain = GenerationRequest([5, 6, 7, 8] * 6, max_tokens=30, sampling=GREEDY, ignore_eos=True)
    tokens = _summary(_alone(qwen, plain))[0]
    # the text of the first 6 tokens: on this model the 6th is the second of a window's 3 kept drafts
    stop_at = qwen.tokenizer.decode(tokens[:6])  # type: ignore[attr-defined]
    stopped = GenerationRequest(plain.prompt, max_tokens=30, sampling=GREEDY, ignore_eos=True, stop=[stop_at])
    br = BatchRunner(qwen.model, qwen.tokenizer, 256, "f32", slots=1, spec=SpecConfig(n=6))  # type: ignore[attr-defined]
    (events,) = _run(br, [stopped])
    assert _summary(events) == _summary(_alone(qwen, stopped))
    assert _summary(events)[1] == "stop" and _spec_done(events)[2] > 0
    slot = br.slots[0]
    assert slot.cache.length == len(slot.tokens) <= len(plain.prompt) + len(_summary(events)[0])
    follow = GenerationRequest([*slot.tokens, 3, 4], max_tokens=12, sampling=GREEDY, ignore_eos=True)
    (again,) = _run(br, [follow])
    assert _summary(again) == _summary(_alone(qwen, follow))
    assert next(e for e in again if isinstance(e, DoneEvent)).timings.prompt_cached > 0
