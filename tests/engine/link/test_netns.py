"""Two "PCs" on one box (root): the worker in a network namespace behind a veth pair. Tokens through a shaped
link (delay 2 ms +- 0.5 ms, 1% loss, 1% reordering, where the kernel has netem) equal the single-process run; the
link taken down mid-request fails that request within 5 s and the next one, once it is up, succeeds."""

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.link.client import StageError
from engine.link.startup import load_split_model
from engine.pipeline.generate import DoneEvent, GenerationRequest, PromptChunkEvent, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SplitOptions
from engine.testing.tiny_models import write_tiny_model
from tests.engine.link.harness import TOKEN, _env, _start

pytestmark = pytest.mark.netns
PROMPT = [1 + (i * 37) % 400 for i in range(40)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("netns") / "m.gguf", "qwen3moe", qtype="Q8_0", seed=5, n_layer=6
    )


@pytest.fixture
def peer() -> Iterator[object]:
    from tests.engine.link.netns import Peer

    p = Peer.create()
    yield p
    p.close()


def _worker_in(peer: object, model: Path, begin: int) -> object:
    cmd = [*peer.exec_prefix(), sys.executable, "-m", "engine.cli", "worker", "-m", str(model), "--device", "cpu",  # type: ignore[attr-defined]
           "--dtype", "f32", "--stage-worker", "0", "--stage-begin", str(begin), "--stage-bind", peer.peer_addr,  # type: ignore[attr-defined]
           "--max-context", "256"]  # fmt: skip
    return _start(cmd, _env(), r"listening on [\d.]+:(\d+)")


def _greedy(m: object, tok: object, chunk: int, prompt: list[int]) -> list[int]:
    r = Runner(m, tok, 256, "f32", chunk)  # type: ignore[arg-type]
    req = GenerationRequest(prompt, max_tokens=12, sampling=GREEDY, ignore_eos=True)
    return next(e for e in r.generate(req) if isinstance(e, DoneEvent)).tokens


def test_tokens_identical_through_a_shaped_link(
    model: Path, peer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not peer.shape("delay", "2ms", "0.5ms", "loss", "1%", "reorder", "1%"):  # type: ignore[attr-defined]
        pytest.skip("netem: no tc on PATH, or this kernel has no sch_netem qdisc")
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)
    w = _worker_in(peer, model, 3)
    try:
        opts = SplitOptions(device="cpu", layer_split=(3,), remote=f"{peer.peer_addr}:{w.port}", pipe_chunk=4)  # type: ignore[attr-defined]
        lm = load_split_model(model, opts, 256, "f32", "f32")
        base = load_model(model, "cpu", "f32")
        assert _greedy(lm.model, lm.tokenizer, 16, PROMPT) == _greedy(base.model, base.tokenizer, 4, PROMPT)
        lm.model.close()  # type: ignore[attr-defined]
    finally:
        w.stop()  # type: ignore[attr-defined]


def test_link_down_fails_the_request_and_up_serves_the_next(
    model: Path, peer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)
    w = _worker_in(peer, model, 3)
    try:
        opts = SplitOptions(device="cpu", layer_split=(3,), remote=f"{peer.peer_addr}:{w.port}", pipe_chunk=4)  # type: ignore[attr-defined]
        lm = load_split_model(model, opts, 256, "f32", "f32")
        runner = Runner(lm.model, lm.tokenizer, 256, "f32", 16)
        fired: list[float] = []
        with pytest.raises(StageError, match=peer.peer_addr):  # type: ignore[attr-defined]
            for ev in runner.generate(
                GenerationRequest(PROMPT * 2, max_tokens=32, sampling=GREEDY, ignore_eos=True)
            ):
                if isinstance(ev, PromptChunkEvent) and not fired:
                    fired.append(time.monotonic())
                    threading.Thread(target=peer.link, args=(False,)).start()  # type: ignore[attr-defined]
        assert time.monotonic() - fired[0] < 5.0
        runner.reset()
        peer.link(True)  # type: ignore[attr-defined]
        base = load_model(model, "cpu", "f32")
        assert _greedy(lm.model, lm.tokenizer, 16, PROMPT) == _greedy(base.model, base.tokenizer, 4, PROMPT)
        lm.model.close()  # type: ignore[attr-defined]
    finally:
        w.stop()  # type: ignore[attr-defined]
