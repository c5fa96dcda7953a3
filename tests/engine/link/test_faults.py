"""A worker killed (SIGKILL), frozen (SIGSTOP) or cut off (its link black-holed) in the middle of a decode step or
of a prompt chunk: the request in flight fails within 5 s with an error naming the stage's address, the next one
after the worker is back succeeds, and 20 such cycles leave no thread or file descriptor behind."""

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.link import protocol as P
from engine.link.client import StageClient, StageError
from engine.link.keys import client_keys
from engine.link.startup import load_split_model
from engine.link.transport import Endpoint
from engine.pipeline.generate import DoneEvent, GenerationRequest, PromptChunkEvent, Runner, TokenEvent
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model
from tests.engine.link.harness import ECHO_INFO, TOKEN, WorkerProc, start_echo, start_worker
from tests.engine.link.proxy import CuttableLink

ENV = {"STRATA_STAGE_TOKEN": TOKEN}
EXPECT = P.StageInfo(**{**ECHO_INFO.to_wire(), "max_tokens": 64})
FAIL_WITHIN_S = 5.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _request(c: StageClient, tokens: int, start: int) -> None:
    payload = os.urandom(tokens * 16 * 4)
    r = c.wait(c.submit(payload, "f32", (tokens, 16), start))
    assert bytes(r.message.payload) == payload


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts file descriptors through /proc")
def test_twenty_kills_stops_and_cuts_fail_fast_and_leak_nothing() -> None:
    faults = ["kill", "stop", "cut"] * 7
    faults = faults[:20]
    worker = start_echo(env={"ECHO_MS_PER_TOKEN": "25"})  # a 1-token step takes 25 ms, a 64-token chunk 1.6 s
    port = worker.port
    link = CuttableLink(port)
    endpoint = Endpoint("127.0.0.1", link.port)
    # threads this test starts must be gone after each cycle (a thread of an earlier test ending meanwhile is not
    # a leak: compare the threads themselves, not their count)
    threads0, fds0 = set(threading.enumerate()), _fds()
    try:
        for i, fault in enumerate(faults):
            c = StageClient(
                endpoint, client_keys(None, None, ENV), 64 * 16 * 4, label=f"the worker at {endpoint}"
            )
            c.connect(EXPECT)
            _request(c, 1, 0)
            tokens = 64 if i % 2 else 1  # mid prompt chunk, or mid decode step
            payload = os.urandom(tokens * 16 * 4)
            seq = c.submit(payload, "f32", (tokens, 16), 1)
            time.sleep(0.01)  # the request is on the worker now
            t0 = time.monotonic()
            if fault == "kill":
                worker.kill()
            elif fault == "stop":
                worker.freeze()
            else:
                link.cut.set()
            with pytest.raises(StageError, match=f"127.0.0.1:{link.port}") as err:
                c.wait(seq)
            took = time.monotonic() - t0
            assert took < FAIL_WITHIN_S, f"cycle {i} ({fault}): failed after {took:.1f} s"
            assert not c.ok and err.value.code == "unreachable"
            c.close()
            if fault == "kill":  # back: restarted on the same port
                worker.stop()
                worker = start_echo(port=port, env={"ECHO_MS_PER_TOKEN": "25"})
            elif fault == "stop":
                worker.thaw()
            else:
                link.cut.clear()
            back = StageClient(endpoint, client_keys(None, None, ENV), 64 * 16 * 4)
            back.connect(EXPECT)
            _request(back, 2, 0)
            back.close()
        time.sleep(0.3)
        new = [t.name for t in threading.enumerate() if t not in threads0]
        assert len(new) <= 1 and all(n.endswith("(_read)") for n in new), (
            new
        )  # a restarted worker's log reader
        assert _fds() <= fds0 + 2 * len(
            link._socks
        )  # the relay's own sockets are the proxy's, not the client's
    finally:
        link.close()
        worker.stop()


# ---------------------------------------------------------------------------------------------------------------
# The main process's chain with the model: the request fails, the next one is served


PROMPT = [1 + (i * 37) % 400 for i in range(96)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("faults") / "m.gguf", "qwen3moe", qtype="Q8_0", seed=5, n_layer=6
    )


@pytest.fixture(scope="module")
def expected(model: Path) -> list[int]:
    base = load_model(model, "cpu", "f32")
    r = Runner(base.model, base.tokenizer, 256, "f32", 4)
    req = GenerationRequest(PROMPT[:12], max_tokens=6, sampling=GREEDY, ignore_eos=True)
    return next(e for e in r.generate(req) if isinstance(e, DoneEvent)).tokens


@pytest.fixture
def worker(model: Path) -> Iterator[WorkerProc]:
    w = start_worker(model, 3)
    yield w
    w.stop()


@pytest.mark.parametrize(("fault", "phase"), [("kill", "decode"), ("stop", "chunk"), ("cut", "chunk")])
def test_main_survives_and_serves_the_next_request(
    model: Path,
    expected: list[int],
    worker: WorkerProc,
    fault: str,
    phase: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)
    link = CuttableLink(worker.port)
    opts = SplitOptions(device="cpu", layer_split=(3,), remote=f"127.0.0.1:{link.port}", pipe_chunk=4)
    lm = load_split_model(model, opts, 256, "f32", "f32")
    runner = Runner(lm.model, lm.tokenizer, 256, "f32", 16)
    fired: list[float] = []

    def inject() -> None:
        fired.append(time.monotonic())
        {"kill": worker.kill, "stop": worker.freeze, "cut": link.cut.set}[fault]()

    try:
        req = GenerationRequest(PROMPT, max_tokens=64, sampling=GREEDY, ignore_eos=True)
        with pytest.raises(StageError, match=f"127.0.0.1:{link.port}"):
            for ev in runner.generate(req):
                if not fired and (
                    (phase == "chunk" and isinstance(ev, PromptChunkEvent))
                    or (phase == "decode" and isinstance(ev, TokenEvent))
                ):
                    threading.Thread(target=inject).start()  # lands while the next forward is in flight
        assert time.monotonic() - fired[0] < FAIL_WITHIN_S
        assert lm.model.health()[0][1].startswith("down: ")
        runner.reset()  # what the server does after a failed request
        if fault == "kill":
            back = start_worker(model, 3, port=worker.port)
            worker.proc, worker.log = back.proc, back.log
        elif fault == "stop":
            worker.thaw()
        else:
            link.cut.clear()
        req = GenerationRequest(PROMPT[:12], max_tokens=6, sampling=GREEDY, ignore_eos=True)
        done = next(e for e in runner.generate(req) if isinstance(e, DoneEvent))
        assert done.tokens == expected
        assert lm.model.health()[0][1] == "ok"
    finally:
        lm.model.close()
        link.close()


def test_a_worker_restarted_between_requests_is_rebuilt(
    model: Path, expected: list[int], worker: WorkerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker restarts while the main is idle: the next request continues the conversation - the main reads
    the earlier positions again through the new worker - with the tokens of an uninterrupted run."""
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)
    opts = SplitOptions(device="cpu", layer_split=(3,), remote=f"127.0.0.1:{worker.port}", pipe_chunk=4)
    lm = load_split_model(model, opts, 256, "f32", "f32")
    runner = Runner(lm.model, lm.tokenizer, 256, "f32", 16)
    try:
        first = GenerationRequest(PROMPT[:8], max_tokens=2, sampling=GREEDY, ignore_eos=True)
        list(runner.generate(first))
        worker.kill()
        back = start_worker(model, 3, port=worker.port)
        worker.proc, worker.log = back.proc, back.log
        time.sleep(1.5)  # the main's socket noticed the restart (heartbeats)
        req = GenerationRequest(
            PROMPT[:12], max_tokens=6, sampling=GREEDY, ignore_eos=True
        )  # extends the first
        done = next(e for e in runner.generate(req) if isinstance(e, DoneEvent))
        assert done.timings.prompt_cached > 0
        assert done.tokens == expected
    finally:
        lm.model.close()
    assert torch.get_num_threads() == 1


@pytest.mark.slow
def test_a_relay_that_loses_the_next_worker_names_it(
    model: Path, expected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three stages: the last worker dies mid-answer; the main's request fails within 5 s with an error naming the
    relay and the lost worker's address; with the last worker back, the next request is served."""
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)
    last = start_worker(model, 4)
    relay = start_worker(model, 2, end=4, nxt=last.port)
    opts = SplitOptions(device="cpu", layer_split=(2,), remote=f"127.0.0.1:{relay.port}", pipe_chunk=4)
    lm = load_split_model(model, opts, 256, "f32", "f32")
    runner = Runner(lm.model, lm.tokenizer, 256, "f32", 16)
    try:
        fired: list[float] = []
        with pytest.raises(StageError, match=rf"could not relay.*127\.0\.0\.1:{last.port}"):
            for ev in runner.generate(
                GenerationRequest(PROMPT, max_tokens=64, sampling=GREEDY, ignore_eos=True)
            ):
                if isinstance(ev, TokenEvent) and not fired:
                    fired.append(time.monotonic())
                    threading.Thread(target=last.kill).start()
        assert time.monotonic() - fired[0] < FAIL_WITHIN_S
        runner.reset()
        back = start_worker(model, 4, port=last.port)
        last.proc, last.log = back.proc, back.log
        req = GenerationRequest(PROMPT[:12], max_tokens=6, sampling=GREEDY, ignore_eos=True)
        assert next(e for e in runner.generate(req) if isinstance(e, DoneEvent)).tokens == expected
    finally:
        lm.model.close()
        relay.stop()
        last.stop()
