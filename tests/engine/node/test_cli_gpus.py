"""`strata-node samples` and `strata-node clocks` as the app runs them: a real agent on loopback whose NVML is the
scripted one (the boundary), the commands in this process or as a `--follow` subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from engine.node import cli
from engine.node import gpu as gpu_mod
from engine.node.agent import Agent
from engine.node.client import main_keys
from tests.engine.node.conftest import pair_with
from tests.engine.node.fake_nvml import RTX_3070, RTX_3080, ClockNvml


def two_cards(**kw: object) -> ClockNvml:
    return ClockNvml(cards=[RTX_3080, RTX_3070], **kw)  # type: ignore[arg-type]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc = cli.main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_samples_give_the_cards_then_their_state(
    make_agent: Callable[..., Agent], capsys: pytest.CaptureFixture[str]
) -> None:
    nv = two_cards()
    nv.live[1].pstate, nv.live[1].reasons = 5, pynvml.nvmlClocksEventReasonGpuIdle
    pair_with(make_agent("gpu-box", nvml=nv, sample_ms=20), main_keys()).client.close()
    time.sleep(0.1)
    rc, out = run(capsys, "samples", "gpu-box")
    assert rc == 0 and out["ok"] and out["node"] == "gpu-box"
    assert out["gpus"] == [
        {"index": 0, "name": "NVIDIA GeForce RTX 3080", "max_sm_mhz": 1905, "vram_total": 10240 << 20},
        {"index": 1, "name": "NVIDIA GeForce RTX 3070", "max_sm_mhz": 1905, "vram_total": 8192 << 20},
    ]
    last = {s["index"]: s for s in out["samples"]}
    assert last[1]["pstate"] == 5 and last[1]["reasons"] == ["gpu_idle"] and last[0]["sm_mhz"] == 1905


def test_follow_prints_each_new_batch(make_agent: Callable[..., Agent]) -> None:
    nv = two_cards()
    pair_with(make_agent("gpu-box", nvml=nv, sample_ms=20), main_keys()).client.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.node.cli", "samples", "gpu-box", "--follow", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout is not None
        head = json.loads(proc.stdout.readline())
        assert [g["name"] for g in head["gpus"]] == ["NVIDIA GeForce RTX 3080", "NVIDIA GeForce RTX 3070"]
        first = json.loads(proc.stdout.readline())
        nv.live[0].pstate = 8
        seen = first["next"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            batch = json.loads(proc.stdout.readline())
            assert all(s["seq"] > seen for s in batch["samples"])  # only what is new each time
            seen = batch["next"]
            if any(s["index"] == 0 and s["pstate"] == 8 for s in batch["samples"]):
                break
        else:
            raise AssertionError("the changed P-state never came")
    finally:
        proc.kill()
        proc.wait(10)


def test_locking_a_worker_pcs_clocks(
    make_agent: Callable[..., Agent], capsys: pytest.CaptureFixture[str]
) -> None:
    denied = two_cards(lock_error=pynvml.NVML_ERROR_NO_PERMISSION)
    pair_with(make_agent("no-admin", nvml=denied), main_keys()).client.close()
    rc, out = run(capsys, "clocks", "no-admin", "--gpu", "1", "--lock")
    assert rc == 1 and out["ok"] is False and out["code"] == "not_locked"
    assert (
        out["error"].startswith("GPU 1 of no-admin (127.0.0.1:")
        and "): NOT locked: no permission" in out["error"]
    )
    assert "administrator" in out["error"] and "`nvidia-smi -i 1 -lgc 1524,1905`" in out["error"]

    allowed = two_cards()
    pair_with(make_agent("admin", nvml=allowed), main_keys()).client.close()
    rc, out = run(capsys, "clocks", "admin", "--gpu", "1", "--lock")
    assert rc == 0 and out["clocks"]["locked"] is True
    assert out["clocks"]["detail"] == "locked: SM 1524-1905 MHz, memory 7001 MHz"
    rc, out = run(capsys, "clocks", "admin", "--gpu", "1", "--reset")
    assert rc == 0 and out["clocks"]["locked"] is False
    assert [c for c in allowed.calls if c[1] == 1] == [
        ("lock_sm", 1, 1524, 1905),
        ("lock_mem", 1, 7001, 7001),
        ("reset_sm", 1),
        ("reset_mem", 1),
    ]


def test_locking_this_pcs_clocks(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    nv = two_cards(lock_error=pynvml.NVML_ERROR_NO_PERMISSION)
    monkeypatch.setattr(gpu_mod, "_load", lambda _nvml: nv)
    rc, out = run(capsys, "clocks", "--here", "--gpu", "0", "--lock")
    assert rc == 1 and out["code"] == "not_locked"
    assert out["error"].startswith("GPU 0 of this PC: NOT locked: no permission") and "root" in out["error"]
    nv.lock_error = None
    rc, out = run(capsys, "clocks", "--here", "--gpu", "0", "--lock", "--sm", "1500,1800")
    assert rc == 0 and out["clocks"]["detail"] == "locked: SM 1500-1800 MHz, memory 7001 MHz"
    assert nv.calls[-2:] == [("lock_sm", 0, 1500, 1800), ("lock_mem", 0, 7001, 7001)]
    rc, out = run(capsys, "clocks", "--here", "--gpu", "7", "--lock")
    assert rc == 1 and "GPU 7 does not exist on this PC" in out["error"]
    rc, out = run(capsys, "clocks", "--gpu", "0", "--lock")
    assert rc == 1 and out["code"] == "bad_arguments"


def test_this_pc_without_a_driver(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nv = ClockNvml(cards=[RTX_3080], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(gpu_mod, "_load", lambda _nvml: nv)
    rc, out = run(capsys, "clocks", "--here", "--lock")
    assert rc == 1 and out["code"] == "no_nvml" and "install the NVIDIA driver" in out["error"]
