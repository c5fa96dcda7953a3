"""A split over processes on loopback: main + worker (2 stages) and main + relay + last worker (3 stages) give the
single-process model's logits bit for bit and its greedy tokens, prompt pieces pipelined over the link included;
the handshake refuses a wrong K or another model with both sides' values; the flags that cannot work are refused."""

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.cli import main as engine_main
from engine.link.client import StageError
from engine.link.startup import check_remote_options, load_split_model
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SplitOptions
from engine.pipeline.stages import SplitModel
from engine.testing.tiny_models import write_tiny_model
from installer.placement import PlacementError
from tests.engine.link.harness import TOKEN, WorkerProc, three_workers

PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180, 3, 8]
PIECE = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("link") / "m.gguf", "qwen3moe", qtype="Q8_0", seed=5, n_layer=6
    )


@pytest.fixture(scope="module")
def workers(model: Path) -> Iterator[dict[str, WorkerProc]]:
    with three_workers(model) as started:
        yield started


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_STAGE_TOKEN", TOKEN)


def _main(model: Path, k: int, port: int, **kw: object) -> SplitModel:
    opts = SplitOptions(device="cpu", layer_split=(k,), remote=f"127.0.0.1:{port}", pipe_chunk=PIECE, **kw)  # type: ignore[arg-type]
    m = load_split_model(model, opts, 256, "f32", "f32").model
    assert isinstance(m, SplitModel)
    return m


def _greedy(m: object, tok: object, chunk: int) -> list[int]:
    r = Runner(m, tok, 256, "f32", chunk)  # type: ignore[arg-type]
    req = GenerationRequest(PROMPT, max_tokens=8, sampling=GREEDY, ignore_eos=True)
    return next(e for e in r.generate(req) if isinstance(e, DoneEvent)).tokens


@pytest.mark.parametrize(("k", "worker"), [(3, "last3"), (2, "relay2")])
def test_remote_split_matches_one_process(
    model: Path, workers: dict[str, WorkerProc], k: int, worker: str, caplog: pytest.LogCaptureFixture
) -> None:
    base = load_model(model, "cpu", "f32")
    caplog.set_level(logging.INFO)
    sm = _main(model, k, workers[worker].port, remote_timing=True)
    try:
        chain = sm.stages[1].chain  # type: ignore[attr-defined]
        assert [(c.begin, c.end) for c in chain] == ([(3, 6)] if k == 3 else [(2, 4), (4, 6)])
        with torch.inference_mode():
            rc, sc = base.model.new_cache(256, "f32"), sm.new_cache(256, "f32")
            ref = torch.cat(
                [base.model.forward(torch.tensor(PROMPT[o : o + PIECE]), rc, o) for o in range(0, 20, PIECE)]
            )
            assert torch.equal(
                sm.forward(torch.tensor(PROMPT[:20]), sc, 0), ref
            )  # five pieces, two in flight
            assert torch.equal(
                sm.forward(torch.tensor([9]), sc, 20), base.model.forward(torch.tensor([9]), rc, 20)
            )
        base2 = load_model(model, "cpu", "f32")
        assert _greedy(sm, base2.tokenizer, 16) == _greedy(base2.model, base2.tokenizer, PIECE)
        text = caplog.text
        assert (
            "remote timing: prompt chunk of 16 token(s) at 0" in text
            and "remote timing: step of 1 token(s)" in text
        )
        assert f"layers {k}-" in text and "compute" in text and "transfer" in text
        assert sm.health() == [(f"127.0.0.1:{workers[worker].port}", "ok")]
    finally:
        sm.close()


def test_tokens_identical_through_a_slow_jittery_link(model: Path, workers: dict[str, WorkerProc]) -> None:
    """2 ms +- 0.5 ms on every chunk each way (userspace: tests/engine/link/test_netns.py shapes a real link with
    netem where the kernel has it)."""
    from tests.engine.link.proxy import CuttableLink

    link = CuttableLink(workers["last3"].port, delay_s=0.002, jitter_s=0.0005)
    try:
        sm = _main(model, 3, link.port)
        base = load_model(model, "cpu", "f32")
        assert _greedy(sm, base.tokenizer, 16) == _greedy(base.model, base.tokenizer, PIECE)
        sm.close()
    finally:
        link.close()


def test_handshake_refuses_another_k_and_another_model(
    model: Path, workers: dict[str, WorkerProc], tmp_path: Path
) -> None:
    with pytest.raises(StageError, match=r"--layer-split 2\).*--stage-begin 3"):
        _main(model, 2, workers["last3"].port)
    other = write_tiny_model(tmp_path / "other.gguf", "qwen3moe", qtype="Q8_0", seed=6, n_layer=6)
    with pytest.raises(StageError, match="model mismatch: the main process's file has header fingerprint"):
        _main(other, 3, workers["last3"].port)


def test_flags_that_cannot_work_are_refused(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for opts, msg in (
        (SplitOptions(remote="h:1"), "needs --layer-split K"),
        (SplitOptions(remote="h:1", layer_split=(2, 4)), "needs --layer-split K"),
        (SplitOptions(remote="h:1", layer_split=(2,), gpus=(0, 1)), "one card"),
        (SplitOptions(remote="h:1", layer_split=(2,), split_device=("0",)), "--split-device"),
        (SplitOptions(remote="h:1", layer_split=(6,)), "between 1 and 5"),
        (SplitOptions(remote="nohostport", layer_split=(2,)), "expected HOST:PORT"),
    ):
        with pytest.raises((PlacementError, ValueError), match=msg):
            check_remote_options(opts, 6)
    base = ["worker", "-m", str(model), "--device", "cpu", "--stage-worker", "0", "--stage-bind", "127.0.0.1"]
    for extra, msg in (
        (["--stage-begin", "0"], "between 1 and 5"),
        (["--stage-begin", "2", "--stage-end", "4"], "--stage-next HOST:PORT"),
        (["--stage-begin", "2", "--stage-next", "127.0.0.1:9"], "give --stage-end"),
        (
            ["--stage-begin", "2", "--max-context", "auto"],
            "--max-context auto: give the worker the positions",
        ),
    ):
        assert engine_main([*base, *extra]) == 2
        assert msg in capsys.readouterr().err


def test_one_main_per_worker_a_second_is_refused_while_the_first_is_connected(
    model: Path, workers: dict[str, WorkerProc]
) -> None:
    """Two mains on one worker would take its session (and KV) from each other at every request; the second is
    refused, naming why, and gets it once the first has gone."""
    import time

    base = load_model(model, "cpu", "f32")
    first = _main(model, 3, workers["last3"].port)
    want = _greedy(first, base.tokenizer, PIECE)
    t0 = time.monotonic()
    with pytest.raises(
        StageError, match="already serves another main process, which is still connected"
    ) as err:
        _main(model, 3, workers["last3"].port)
    assert err.value.code == "busy" and time.monotonic() - t0 < 8
    assert _greedy(first, base.tokenizer, PIECE) == want  # the first kept its session
    first.close()
    second = _main(model, 3, workers["last3"].port)
    assert _greedy(second, base.tokenizer, PIECE) == want
    second.close()
