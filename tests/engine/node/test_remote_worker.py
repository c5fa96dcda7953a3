"""A worker started by an agent serves the remote stage of a real main process (`strata-engine generate`).
A relay chain of workers on two agents, started from a tuned config, is in test_tuner.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.node.agent import Agent
from engine.node.client import NodeClient, main_key_file
from engine.node.shipper import ship
from engine.testing.tiny_models import write_tiny_model
from tests.engine.node.conftest import Paired, pair_with

pytestmark = pytest.mark.slow
N_LAYER = 4
PROMPT = "the survey ship left the harbour"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("remote") / "models"
    d.mkdir()
    return write_tiny_model(d / "tiny.gguf", "qwen3moe", qtype="Q8_0", n_layer=N_LAYER, seed=5)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Main and workers each compute with one thread: three processes share a small CI box."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _generate(model: Path, *extra: str) -> str:
    argv = [sys.executable, "-m", "engine.cli", "generate", "--model", str(model), "--prompt", PROMPT]
    argv += [
        "-n",
        "12",
        "--device",
        "cpu",
        "--prefill",
        "4",
        *extra,
    ]  # chunks of 4: the prompt crosses in pieces
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.fixture(scope="module")
def reference(model: Path) -> str:
    return _generate(model)


def _wait_listening(c: NodeClient, wid: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = {x["id"]: x for x in c.workers()}[wid]
        if w["state"] == "listening":
            return w
        assert w["state"] == "starting", c.logs(wid)["lines"]
        time.sleep(0.1)
    raise AssertionError(f"worker {wid} did not listen: {c.logs(wid)['lines']}")


def _main_flags(p: Paired, split: int, w: dict) -> list[str]:
    return [
        "--layer-split",
        str(split),
        "--remote-stage",
        f"127.0.0.1:{w['port']}",
        f"--remote-stage-key={w['public_key']}",
        "--stage-key",
        str(main_key_file(p.keys)),
    ]


def test_worker_started_by_an_agent_serves_the_remote_stage(
    model: Path, reference: str, make_agent: Callable[..., Agent]
) -> None:
    p = pair_with(make_agent("pc1", model_dirs=(model.parent,)))
    w = p.client.start_worker(model=model.name, begin=2, flags=["--device", "cpu"], timing=True)
    _wait_listening(p.client, w["id"])
    assert _generate(model, *_main_flags(p, 2, w)) == reference
    lines = p.client.logs(w["id"])["lines"]
    assert any("layers 2-3" in line for line in lines)
    stopped = p.client.stop_worker(w["id"])
    assert stopped["state"] == "stopped"
    p.client.close()


def test_worker_on_a_shipped_shard_serves_the_remote_stage(
    model: Path, reference: str, make_agent: Callable[..., Agent]
) -> None:
    p = pair_with(make_agent("pc1"))
    res = ship(p.client, model, 2, None)
    w = p.client.start_worker(model=res.name, begin=2, flags=["--device", "cpu"])
    _wait_listening(p.client, w["id"])
    try:
        assert _generate(model, *_main_flags(p, 2, w)) == reference
    finally:
        p.client.close()
