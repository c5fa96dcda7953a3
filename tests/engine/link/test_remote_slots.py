"""Several conversations at once over a remote stage: the main's slots each keep their KV on the worker under
their own number, a step's rows of every slot cross the link as one message, and each request gets the tokens of
the unsplit model alone: through one worker and through a relay, with prompt chunks beside decode rows, after a
worker restarted mid-conversation (each slot read again), and with workers that hold fewer slots than asked."""

import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.link import protocol as P
from engine.link.client import StageClient, StageError
from engine.link.keys import client_keys, server_keys
from engine.link.remote import RemoteStage
from engine.link.server import StageServer
from engine.link.startup import load_split_model
from engine.link.transport import Endpoint
from engine.models.family_base import BatchPart
from engine.pipeline.batch import BatchRunner
from engine.pipeline.generate import DoneEvent, Event, GenerationRequest, Runner, TokenEvent
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.spec import SpecConfig
from engine.pipeline.split import SplitOptions
from engine.pipeline.stages import SplitModel
from engine.testing.tiny_models import write_tiny_model
from tests.engine.link.echo_worker import Echo
from tests.engine.link.harness import ECHO_INFO, TOKEN, WorkerProc, start_worker, three_workers


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("slots") / "m.gguf", "qwen3moe", qtype="Q8_0", seed=6, n_layer=6
    )


@pytest.fixture(scope="module")
def workers(model: Path) -> Iterator[dict[str, WorkerProc]]:
    with three_workers(model, relay_extra=["--parallel", "2"], extra=["--parallel", "4"]) as started:
        yield started


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)
    monkeypatch.setenv("STRATA_ACTIVATIONS", "float")  # exact products alone and batched (as test_batch)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 500, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _tokens(events: list[Event]) -> list[int]:
    done = [e for e in events if isinstance(e, DoneEvent)]
    assert len(done) == 1, events[-1]
    return done[0].tokens


def _alone(whole: object, req: GenerationRequest) -> list[int]:
    runner = Runner(whole.model, whole.tokenizer, 256, "f32")  # type: ignore[attr-defined]
    return _tokens(list(runner.generate(req)))


def _serve(br: BatchRunner, reqs: list[GenerationRequest]) -> list[list[Event]]:
    """Admit the requests as slots free up (first come, first served), step until every one is done and no step
    is out -> each one's events."""
    got: list[list[Event]] = [[] for _ in reqs]
    waiting = list(range(len(reqs)))
    while waiting or br.busy or br.in_flight:
        while waiting and br.free:
            i = waiting.pop(0)
            br.admit(reqs[i], got[i].append)
        br.step()
    return got


def _each_as_alone(br: BatchRunner, reqs: list[GenerationRequest], whole: object) -> list[list[Event]]:
    """`_serve`, then check each request's tokens against the unsplit model's for it alone."""
    got = _serve(br, reqs)
    for req, events in zip(reqs, got, strict=True):
        assert _tokens(events) == _alone(whole, req)
    return got


def _load(model: Path, k: int, port: int, parallel: int) -> object:
    opts = SplitOptions(device="cpu", layer_split=(k,), remote=f"127.0.0.1:{port}", pipe_chunk=8)
    return load_split_model(model, opts, 256, "f32", "f32", parallel=parallel)


def _messages(sm: SplitModel) -> list[list[tuple[int, int, int]]]:
    """Record the rows of each message the main sends over the link."""
    client = sm.stages[1].client  # type: ignore[attr-defined]
    sent: list[list[tuple[int, int, int]]] = []
    submit = client.submit

    def spy(payload: object, dtype: str, shape: object, start: int, rows: object = None) -> int:
        sent.append(list(rows or [(0, start, shape[0])]))  # type: ignore[index]
        return submit(payload, dtype, shape, start, rows)

    client.submit = spy
    return sent


@pytest.mark.parametrize(("k", "worker", "slots"), [(3, "last3", 3), (2, "relay2", 2)])
def test_slots_over_a_remote_stage_give_each_request_its_tokens_alone(
    model: Path,
    workers: dict[str, WorkerProc],
    k: int,
    worker: str,
    slots: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    whole = load_model(model, "cpu", "f32")
    caplog.set_level(logging.INFO)
    lm = _load(model, k, workers[worker].port, parallel=3)
    sm = lm.model  # type: ignore[attr-defined]
    assert isinstance(sm, SplitModel)
    try:
        # the relay holds 2 sequences (its --parallel): the main serves 2 at once, and says why
        assert lm.sequences == slots  # type: ignore[attr-defined]
        if slots < 3:
            assert "the chain of workers holds 2 sequence(s)" in caplog.text
        sent = _messages(sm)
        reqs = [
            GenerationRequest(p, max_tokens=3 + 2 * i, sampling=GREEDY, ignore_eos=True)
            for i, p in enumerate(_prompts(5, seed=k))
        ]
        br = BatchRunner(sm, lm.tokenizer, 256, "f32", slots=slots, step_tokens=12)  # type: ignore[attr-defined]
        _each_as_alone(br, reqs, whole)
        # a step's rows of several slots crossed as one message, each slot named once, slots beyond slot 0 used
        assert max(len(rows) for rows in sent) == slots
        assert {r[0] for rows in sent for r in rows} == set(range(slots))
        assert all(len({r[0] for r in rows}) == len(rows) for rows in sent)
        assert sum(r[2] for rows in sent for r in rows) >= sum(len(r.prompt) + r.max_tokens - 1 for r in reqs)
    finally:
        sm.close()


@pytest.mark.parametrize("groups", [2, 3])
def test_groups_of_slots_are_pipelined_through_the_worker(
    model: Path, workers: dict[str, WorkerProc], groups: int
) -> None:
    """With groups, a group's step goes out while the worker still computes the previous group's: the link has
    several steps in flight, and every request still gets its tokens alone (joins, prompt chunks, ends)."""
    whole = load_model(model, "cpu", "f32")
    lm = _load(model, 3, workers["last3"].port, parallel=4)
    sm = lm.model  # type: ignore[attr-defined]
    try:
        assert sm.pipelines_groups
        client = sm.stages[1].client
        depth: list[int] = []
        submit = client.submit

        def spy(*a: object) -> int:
            depth.append(len(client.in_flight))
            return submit(*a)  # type: ignore[arg-type]

        client.submit = spy
        reqs = [
            GenerationRequest(p, max_tokens=2 + 3 * i, sampling=GREEDY, ignore_eos=True)
            for i, p in enumerate(_prompts(7, seed=11))
        ]
        br = BatchRunner(sm, lm.tokenizer, 256, "f32", slots=4, step_tokens=12, groups=groups)  # type: ignore[attr-defined]
        assert br.groups == groups
        _each_as_alone(br, reqs, whole)
        assert max(depth) >= groups - 1 >= 1  # steps of other groups were out when one was sent
        assert not br.in_flight and br.free == 4
    finally:
        sm.close()


def _one_group(model: Path, workers: dict[str, WorkerProc]) -> tuple[object, SplitModel, BatchRunner]:
    """The unsplit model, and 3 slots in one group over the "last3" worker with overlap (a card's default)."""
    whole = load_model(model, "cpu", "f32")
    lm = _load(model, 3, workers["last3"].port, parallel=3)
    sm = lm.model  # type: ignore[attr-defined]
    br = BatchRunner(sm, lm.tokenizer, 256, "f32", slots=3, step_tokens=12, overlap=True)  # type: ignore[attr-defined]
    return whole, sm, br


def test_one_group_reads_a_steps_tokens_while_the_worker_computes_the_next(
    model: Path, workers: dict[str, WorkerProc]
) -> None:
    """One group with overlap (a card's default): each step goes out before the previous step's tokens are read,
    so the host's work on them hides behind the worker's compute; requests that end at different steps (their
    slots' last rows wasted or not fed) and the ones that take their slots afterwards get their tokens alone."""
    whole, sm, br = _one_group(model, workers)
    try:
        client = sm.stages[1].client
        assert br.groups == 1
        out_while_read: list[int] = []
        read = br._read

        def spy(f):  # type: ignore[no-untyped-def]
            out_while_read.append(len(client.in_flight))
            return read(f)

        br._read = spy  # type: ignore[method-assign]
        reqs = [
            GenerationRequest(p, max_tokens=2 + 3 * i, sampling=GREEDY, ignore_eos=True)
            for i, p in enumerate(_prompts(6, seed=13))
        ]
        _each_as_alone(br, reqs, whole)
        assert max(out_while_read) >= 1  # the next step's messages were out during the read
        assert not br.in_flight and br.free == 3
    finally:
        sm.close()


def test_one_group_queues_the_next_steps_layers_and_a_cancelled_request_leaves(
    model: Path, workers: dict[str, WorkerProc]
) -> None:
    """With overlap, a decode step returns with the next step's local layers already queued (the host's work on
    the tokens then overlaps them), none of them sent before that call; a request cancelled meanwhile leaves within
    a step or two while the others get their tokens alone."""
    whole, sm, br = _one_group(model, workers)
    try:
        client = sm.stages[1].client
        reqs = [
            GenerationRequest(p, max_tokens=24, sampling=GREEDY, ignore_eos=True)
            for p in _prompts(3, seed=17)
        ]
        got: list[list[Event]] = [[] for _ in reqs]
        gone = [False]
        for i, r in enumerate(reqs):
            br.admit(r, got[i].append, (lambda: gone[0]) if i == 1 else (lambda: False))

        def tokens_of_1() -> int:
            return sum(isinstance(e, TokenEvent) for e in got[1])

        queued, cut = 0, None
        while br.busy or br.in_flight:
            out_before = len(client.in_flight)
            br.step()
            if br._queued is not None:
                queued += 1
                assert len(client.in_flight) == out_before == 0  # queued on the device, not sent
            if cut is None and tokens_of_1() >= 6:
                gone[0], cut = True, tokens_of_1()
        assert queued >= 10
        assert cut is not None and tokens_of_1() <= cut + 2
        assert not any(isinstance(e, DoneEvent) for e in got[1])
        for i in (0, 2):
            assert _tokens(got[i]) == _alone(whole, reqs[i])
        assert not br.in_flight and br.free == 3
    finally:
        sm.close()


def test_ids_left_on_the_card_join_the_histories_in_order(
    model: Path, workers: dict[str, WorkerProc]
) -> None:
    """The token ids a step leaves on the device (read a step later, all at once) land in each slot's history as
    reading them at once would have: in the order remembered, a later start cutting what lay past it."""
    lm = _load(model, 3, workers["last3"].port, parallel=2)
    sm = lm.model  # type: ignore[attr-defined]
    try:
        sm.histories = {0: [1, 2, 3, 4]}
        sm._unheard = [(0, 2, torch.tensor([5, 6])), (1, 0, torch.tensor([9])), (0, 4, torch.tensor([8])),
                       (0, 3, torch.tensor([7]))]  # fmt: skip
        sm._heard()
        assert sm.histories == {0: [1, 2, 5, 7], 1: [9]} and sm._unheard == []
    finally:
        sm.close()


def test_a_worker_lost_with_groups_out_fails_their_requests_and_the_next_ones_serve(model: Path) -> None:
    """The worker dies while both groups' steps are out: each group's requests fail with the link's error when
    their step is read (none hangs, no answer of the old connection is taken for a new one), and requests after the
    worker is back get their tokens alone."""
    whole = load_model(model, "cpu", "f32")
    worker = start_worker(model, 3, extra=["--parallel", "4"])
    lm = _load(model, 3, worker.port, parallel=4)
    sm = lm.model  # type: ignore[attr-defined]
    try:
        br = BatchRunner(sm, lm.tokenizer, 256, "f32", slots=4, groups=2)  # type: ignore[attr-defined]
        reqs = [
            GenerationRequest(p, max_tokens=40, sampling=GREEDY, ignore_eos=True) for p in _prompts(4, seed=5)
        ]
        failed: list[BaseException] = []
        for r in reqs:
            br.admit(r, lambda e: None, fail=failed.append)
        for _ in range(6):
            br.step()
        assert len(br._pending) == 2  # both groups' steps are out
        port = worker.port
        worker.kill()
        t0 = time.monotonic()
        while br.busy or br.in_flight:
            br.step()
            assert time.monotonic() - t0 < 30
        assert len(failed) == 4 and all(isinstance(e, StageError) for e in failed), failed
        worker = start_worker(model, 3, port=port, extra=["--parallel", "4"])
        got: list[Event] = []
        again = GenerationRequest(PROMPT_AFTER, max_tokens=5, sampling=GREEDY, ignore_eos=True)
        br.admit(again, got.append)
        while br.busy or br.in_flight:
            br.step()
        assert _tokens(got) == _alone(whole, again)
    finally:
        sm.close()
        worker.stop()


PROMPT_AFTER = [3, 14, 15, 92, 65, 35]


def test_a_step_out_on_a_connection_since_renewed_fails_instead_of_waiting() -> None:
    """Another group's step reconnected the link (a new session numbers its requests from 1 again): a step sent
    on the old one fails at once; it neither waits forever nor takes a reply meant for a new request."""
    info = replace(ECHO_INFO, slots=2)
    server = StageServer(info, Echo(ms_per_token=50), server_keys(None, []), "127.0.0.1", 0).start()
    try:
        client = StageClient(
            Endpoint("127.0.0.1", server.port), client_keys(None, None), 64 * 16 * 4, label="w"
        )
        stage = RemoteStage(client, info, lambda chain: None)
        stage.connect()
        cache = replace_slot(1)
        part = BatchPart(torch.zeros(2, dtype=torch.long), cache, 0)
        out = stage.submit_parts(torch.zeros(2, 16), [part])
        stage.connect()  # what ensure() does when it finds the link down
        fresh = stage.submit_parts(torch.ones(2, 16), [part])
        with pytest.raises(StageError, match="renewed while this step was out"):
            stage.collect(out)
        assert torch.equal(stage.collect(fresh), torch.ones(2, 16))
        stage.close()
    finally:
        server.stop()


def replace_slot(slot: int) -> object:
    """A stand-in cache: only its slot number crosses the link."""
    return type("Cache", (), {"slot": slot})()


def test_a_worker_restarted_mid_conversation_gets_each_slot_read_again(model: Path) -> None:
    whole = load_model(model, "cpu", "f32")
    worker = start_worker(model, 3, extra=["--parallel", "3"])
    lm = _load(model, 3, worker.port, parallel=3)
    sm = lm.model  # type: ignore[attr-defined]
    try:
        reqs = [
            GenerationRequest(p, max_tokens=10, sampling=GREEDY, ignore_eos=True) for p in _prompts(3, seed=9)
        ]
        br = BatchRunner(sm, lm.tokenizer, 256, "f32", slots=3, step_tokens=64)  # type: ignore[attr-defined]
        got: list[list[Event]] = [[] for _ in reqs]
        for i, r in enumerate(reqs):
            br.admit(r, got[i].append)
        for _ in range(4):  # the prompts and a few tokens each
            br.step()
        port = worker.port
        worker.stop()
        worker = start_worker(model, 3, port=port, extra=["--parallel", "3"])
        sent = _messages(sm)
        while br.busy:
            br.step()
        for req, events in zip(reqs, got, strict=True):
            assert _tokens(events) == _alone(whole, req)
        # the new worker first got each slot's earlier positions again, one sequence at a time, from position 0
        first: dict[int, int] = {}
        for n, rows in enumerate(sent):
            for r in rows:
                first.setdefault(r[0], n)
        assert sorted(first) == [0, 1, 2]
        assert all(sent[n][0][1] == 0 and len(sent[n]) == 1 for n in first.values())
    finally:
        sm.close()
        worker.stop()


def _echo_session(slots: int, asked: int) -> tuple[StageServer, StageClient]:
    server = StageServer(
        replace(ECHO_INFO, slots=slots), Echo(), server_keys(None, []), "127.0.0.1", 0
    ).start()
    client = StageClient(
        Endpoint("127.0.0.1", server.port), client_keys(None, None), 64 * 16 * 4, label="echo"
    )
    chain = client.connect(replace(ECHO_INFO, slots=asked))
    assert [c.slots for c in chain] == [min(slots, asked)]
    return server, client


def _send(client: StageClient, rows: list[tuple[int, int, int]]) -> None:
    t = sum(r[2] for r in rows)
    x = bytes(t * 16 * 4)
    client.wait(client.submit(x, "f32", (t, 16), rows[0][1], rows))


def test_the_worker_checks_each_slots_positions() -> None:
    server, client = _echo_session(slots=4, asked=3)
    try:
        _send(client, [(0, 0, 5), (2, 0, 2), (1, 0, 1)])
        _send(client, [(1, 1, 1), (0, 5, 1)])  # each slot goes on where it stopped
        with pytest.raises(StageError, match="slot 2, holds positions 0-1 and was asked to go on at 7"):
            _send(client, [(0, 6, 1), (2, 7, 1)])
    finally:
        client.close()
        server.stop()
    server, client = _echo_session(slots=4, asked=3)
    try:
        with pytest.raises(StageError, match="holds 3 slot\\(s\\) for this session, not slot 3"):
            _send(client, [(3, 0, 1)])
    finally:
        client.close()
        server.stop()
    server, client = _echo_session(slots=2, asked=8)  # a worker that holds fewer than asked says how many
    client.close()
    server.stop()


def test_a_worker_restarted_with_fewer_slots_is_refused_naming_the_flag(model: Path) -> None:
    worker = start_worker(model, 3, extra=["--parallel", "3"])
    lm = _load(model, 3, worker.port, parallel=3)
    sm = lm.model  # type: ignore[attr-defined]
    try:
        port = worker.port
        worker.stop()
        worker = start_worker(model, 3, port=port, extra=["--parallel", "1"])
        with pytest.raises(StageError, match="start the workers with --parallel 3"):
            sm.forward(torch.tensor([1, 2, 3]), sm.new_cache(256, "f32"), 0)
    finally:
        sm.close()
        worker.stop()


def test_a_worker_of_a_version_before_slots_serves_one_request_at_a_time(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An earlier worker refuses a hello with a field it does not know (`slots`): the main asks again for one
    sequence and serves one request at a time; a hello for one sequence leaves the field out, so the two work."""
    assert "slots" not in ECHO_INFO.to_wire() and P.StageInfo.from_wire(ECHO_INFO.to_wire()).slots == 1
    on_hello = StageServer._on_hello

    def earlier(self: StageServer, identity: bytes, msg: P.Message) -> None:
        if "slots" in msg.get("info"):  # what a version-1 worker without slots answers
            self._error(
                identity, msg.get("s"), 0, "bad_frame", "stage 3-5: hello info has unknown field 'slots'"
            )
            return
        on_hello(self, identity, msg)

    monkeypatch.setattr(StageServer, "_on_hello", earlier)
    caplog.set_level(logging.INFO)
    info = P.StageInfo("qwen3moe", 6, 1, 1, 1, 1, 1, 3, 6, "h")
    server = StageServer(replace(info, slots=4), Echo(), server_keys(None, []), "127.0.0.1", 0).start()
    try:
        client = StageClient(Endpoint("127.0.0.1", server.port), client_keys(None, None), 1 << 16, label="w")
        stage = RemoteStage(client, replace(info, slots=3), lambda chain: None)
        stage.connect()
        assert [c.slots for c in stage.chain] == [1] and stage.expect.slots == 1
        assert "keeps one sequence (an earlier version of PolyStrata)" in caplog.text
        stage.close()
    finally:
        server.stop()


@pytest.mark.parametrize("groups", [1, 2])
def test_verify_windows_of_slots_cross_the_link_and_roll_back_there(
    model: Path, workers: dict[str, WorkerProc], groups: int
) -> None:
    """--spec with slots through a worker: each window (a token and its drafts) crosses in the step's message,
    the worker's positions past the kept drafts are written again by the next step, and every request gets the
    tokens of the unsplit model alone without drafts."""
    whole = load_model(model, "cpu", "f32")
    lm = _load(model, 3, workers["last3"].port, parallel=3)
    sm = lm.model  # type: ignore[attr-defined]
    try:
        sent = _messages(sm)
        prompts = [[5, 6, 7, 8] * 5, [11, 12, 13] * 6, [9] * 8, [40, 41, 40, 41, 40, 41]]
        reqs = [GenerationRequest(p, max_tokens=30, sampling=GREEDY, ignore_eos=True) for p in prompts]
        br = BatchRunner(sm, lm.tokenizer, 256, "f32", slots=3, step_tokens=12, groups=groups,  # type: ignore[attr-defined]
                         spec=SpecConfig(n=4))  # fmt: skip
        got = _each_as_alone(br, reqs, whole)
        assert sum(next(e for e in ev if isinstance(e, DoneEvent)).timings.drafts_accepted for ev in got) > 0
        assert any(r[2] > 1 for rows in sent[1:] for r in rows if r[1] > 20)  # windows after the prompts
    finally:
        sm.close()


def test_prompt_kernels_are_built_at_load_through_the_worker_and_leave_the_slots_as_they_were(
    model: Path, workers: dict[str, WorkerProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """warm_prompts (a split on a card, before the first request): dummy chunks of each size a step holds go
    through the local stages and the worker, alone and two in a step; afterwards the slots hold nothing, the expert
    counts are as before, and requests get their tokens alone."""
    whole = load_model(model, "cpu", "f32")
    lm = _load(model, 3, workers["last3"].port, parallel=3)
    sm = lm.model  # type: ignore[attr-defined]
    try:
        monkeypatch.setattr(SplitModel, "_builds_kernels", lambda self: True)  # the CPU stands in for a card
        sent = _messages(sm)
        br = BatchRunner(sm, lm.tokenizer, 256, "f32", slots=3, step_tokens=12)  # type: ignore[attr-defined]
        counts = [m.expert_counts.clone() for m in sm.local_models() if m.expert_counts is not None]
        assert br.warm_prompts() == [3, 4, 7, 8, 11, 12]  # the buckets up to 12 tokens and one short of each
        # each size alone, and two in a step while they fit (a lone chunk past pipe_chunk goes in pieces)
        assert [[r[2] for r in rows] for rows in sent][:4] == [[3], [3, 3], [4], [4, 4]]
        assert sum(r[2] for rows in sent for r in rows) == 3 + 4 + 7 + 8 + 11 + 12 + 2 * (3 + 4)
        assert all(s.cache.length == 0 for s in br.slots)
        after = [m.expert_counts for m in sm.local_models() if m.expert_counts is not None]
        assert all(torch.equal(a, b) for a, b in zip(counts, after, strict=True))
        reqs = [
            GenerationRequest(p, max_tokens=4, sampling=GREEDY, ignore_eos=True) for p in _prompts(3, seed=21)
        ]
        _each_as_alone(br, reqs, whole)
    finally:
        sm.close()


def test_groups_default_to_two_only_where_the_main_computes_on_the_cpu() -> None:
    from types import SimpleNamespace

    from engine.serve.serving import auto_groups

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert auto_groups(SimpleNamespace(devices=[cpu, cpu, cpu]), remote=True) == 2
    assert (
        auto_groups(SimpleNamespace(devices=[gpu, cpu, gpu]), remote=True) == 1
    )  # a card's rows cost little
    assert auto_groups(SimpleNamespace(devices=[cpu]), remote=False) == 1
