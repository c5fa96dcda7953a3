"""End to end: a worker PC driven from the main PC's window. A node agent (fake NVML: one RTX 2080 Ti) runs as the
second PC, in a network namespace joined to this one by a veth pair (root only), and on loopback. From the app: pair,
tick its card, see the plan, Apply (ship the layers, write the config, start the stage worker, restart the engine;
on loopback with the tuner measuring three splits first), chat through the remote stage; the worker PC goes away (its agent stopped) and the
window says so with the address; it comes back and the engine rejoins it by itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PySide6.QtWidgets import QTextBrowser
from pytestqt.qtbot import QtBot

from app.application import StrataApp
from app.controllers.engine import EngineState
from app.settings import AppSettings, Sampling
from installer.config import read_config
from installer.gpus import GpuInfo, ProbeResult
from tests.app.conftest import chat_once, free_port
from tests.app.fake_nvml import FakeNvml

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HERE_ADDR, PC2_ADDR = "10.217.0.1", "10.217.0.2"
GIB = 1024**3
LOCAL = GpuInfo(0, "GPU-local", "NVIDIA GeForce RTX 3080", 10 * GIB, 9 * GIB, (8, 6), "580.0", sm_count=68,
                max_sm_clock_mhz=1710)  # fmt: skip


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@pytest.fixture(params=["netns", "loopback"])
def second_pc(request: pytest.FixtureRequest) -> Iterator[tuple[list[str], str]]:
    """(the command prefix that runs a program on the second PC, its address): a network namespace (root only),
    or this PC's loopback."""
    if request.param == "loopback":
        yield [], "127.0.0.1"
        return
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip")):
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"sw-{tag}", f"swa{tag}", f"swb{tag}"
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _sh("ip", "link", "set", there, "netns", ns)
        _sh("ip", "addr", "add", f"{HERE_ADDR}/24", "dev", here)
        _sh("ip", "link", "set", here, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{PC2_ADDR}/24", "dev", there)
        _sh("ip", "-n", ns, "link", "set", there, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ["ip", "netns", "exec", ns], PC2_ADDR
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


class Pc2Agent:
    def __init__(self, prefix: list[str], host: str, port: int, data: Path) -> None:
        env = {**os.environ, "STRATA_DATA_DIR": str(data), "PYTHONPATH": str(REPO)}
        cmd = [*prefix, sys.executable, "-m", "tests.app.fake_gpu_node", "serve", "--host", host]
        cmd += ["--port", str(port), "--name", "pc2", "--no-mdns", "--json"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=REPO)  # fmt: skip
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            ev = json.loads(line)
            if ev.get("event") == "ready":
                self.ready: dict[str, Any] = ev
                return
        self.stop()
        raise AssertionError(
            f"the agent did not start: {self.proc.stderr.read() if self.proc.stderr else ''}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the agent stops its workers as it ends
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def test_a_worker_pc_from_pairing_to_a_chat_through_it_and_back_after_it_went_away(
    qtbot: QtBot, tmp_path: Path, second_pc: tuple[list[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.testing.tiny_models import write_tiny_model

    prefix, host = second_pc
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path / "main"))  # the main PC's keys and paired PCs
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path / "config"))
    model = write_tiny_model(tmp_path / "tiny-qwen3moe.gguf", "qwen3moe", qtype="Q8_0", n_layer=8, seed=5)
    port = 17460 + os.getpid() % 1000 * 30 if host == PC2_ADDR else _agent_port()
    agent = Pc2Agent(prefix, host, port, tmp_path / "pc2")
    settings = AppSettings(model=str(model), device="cpu", port=free_port(), max_context=256,
                           sampling=Sampling(temperature=0.0, max_tokens=8), autostart_engine=False)  # fmt: skip
    saved: list[AppSettings] = []
    app = StrataApp(
        settings,
        tray_reason=None,
        nvml=FakeNvml([]),
        probe_fn=lambda: ProbeResult("ok", (LOCAL,)),
        node_command=[sys.executable, "-m", "engine.node.cli"],
        save=saved.append,
        poll_ms=100,
    )
    app.exit_app = lambda: None
    qtbot.addWidget(app.window)
    page = app.window.workers_page
    try:
        app.start()
        # pair from the window: address, code, fingerprint
        page.address.setText(f"{host}:{port}")
        page.code.setText(agent.ready["pairing_code"])
        page.fingerprint.setText(agent.ready["fingerprint"])
        page.pair_button.click()
        qtbot.waitUntil(lambda: any(a.paired and a.cards for a in app.nodes.agents), timeout=30_000)
        pc2 = next(a for a in app.nodes.agents if a.paired)
        assert pc2.reachable and "RTX 2080 Ti" in pc2.gpus[0]

        # tick the worker PC's card: the plan puts the later layers there
        choices = app.plan.choices()
        assert [c.card.pc for c in choices] == ["this PC", "pc2"] and choices[0].chosen
        item = page.plan_cards.item(1)
        item.setCheckState(item.checkState().Checked)
        plan = app.plan.plan
        assert plan is not None and plan.fits, app.plan.problem
        assert [(s.card.pc, s.begin, s.end) for s in plan.stages][0][:2] == ("this PC", 0)
        assert plan.stages[1].card.pc == "pc2" and plan.stages[1].end == 8
        assert page.apply_button.isEnabled() and page.plan_picture.segments[1].title.startswith("pc2 GPU 0")

        # Apply: the layers are shipped, the config written with the worker, the engine started with its stage.
        # On loopback Apply runs the tuner first (its progress and log in the window, its report in a dialog).
        tune = host == "127.0.0.1"
        k = plan.stages[1].begin
        if tune:
            page.tune_check.setChecked(True)
            app.plan.tune_shifts = 1  # the plan's split and one layer either way
            app.plan.tune_args = ["--chunk", "32", "--mix", "24:1", "--answer-tokens", "2"]
        page.apply_button.click()
        if tune:
            qtbot.waitUntil(lambda: "Measuring" in app.plan.busy or bool(app.plan.problem), timeout=30_000)
            assert page.plan_progress.isVisibleTo(page) or app.plan.problem, app.plan.problem
        qtbot.waitUntil(lambda: app.engine.state in (EngineState.READY, EngineState.CRASHED), timeout=240_000)
        assert app.engine.state == EngineState.READY, "\n".join(app.engine.log_tail()) + app.plan.problem
        cfg = read_config(Path(app.settings.config))
        assert saved[-1].config == app.settings.config and not app.settings.model
        files = subprocess.run([sys.executable, "-m", "engine.node.cli", "files", "pc2", "--json"],
                               capture_output=True, text=True, timeout=30, cwd=REPO)  # fmt: skip
        if tune:
            # three splits measured, each once; the fastest is in the config; the shard covers all three
            report = Path(app.plan.report).read_text(encoding="utf-8")
            splits = sorted({int(line.split("|")[1]) for line in report.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()})  # fmt: skip
            assert splits == [k - 1, k, k + 1], report
            assert "Best: split" in report and page.report_button.isVisibleTo(page)
            assert (
                page.report_dialog.isVisible()
                and "Tuning" in page.report_dialog.findChild(QTextBrowser).toPlainText()
            )
            assert any("split" in line for line in app.plan.tune_log) and page.tune_view.isVisibleTo(page)
            (w,) = cfg.workers
            assert (w.host, w.begin, w.end) == (host, w.begin, 8) and w.begin in splits
            assert f"tiny-qwen3moe.L{k - 1}-8.gguf" in files.stdout
            k = w.begin
        else:
            assert [(w.host, w.port, w.begin, w.end) for w in cfg.workers] == [(host, port + 10, k, 8)]
            assert f"tiny-qwen3moe.L{k}-8.gguf" in files.stdout  # the shard, not the whole file
        health = httpx.get(f"{app.engine.api_url.rsplit('/v1', 1)[0]}/health", timeout=10).json()
        assert health["remote_stages"] == [{"address": f"{host}:{cfg.workers[0].port}", "status": "ok"}]

        chat_once(qtbot, app, "Hello")

        # the worker PC goes away: the window says which address and why
        agent.stop()
        qtbot.waitUntil(lambda: app.engine.state == EngineState.DEGRADED, timeout=60_000)
        assert f"{host}:{cfg.workers[0].port}" in app.engine.message
        assert app.window.state_label.text().startswith("Degraded")

        # it comes back (same key, still paired): the app starts its stage again and the engine rejoins it
        agent = Pc2Agent(prefix, host, port, tmp_path / "pc2")
        qtbot.waitUntil(
            lambda: any("restarting the engine" in x for x in app.engine.log_tail(200)), timeout=60_000
        )
        qtbot.waitUntil(lambda: app.engine.state == EngineState.READY, timeout=120_000)
        chat_once(qtbot, app, "Hello again")

        # stop using it: the config loses its workers and the engine runs alone
        page.unuse_button.click()
        qtbot.waitUntil(lambda: not read_config(Path(app.settings.config)).workers, timeout=10_000)
        qtbot.waitUntil(lambda: app.engine.state == EngineState.READY, timeout=120_000)
        health = httpx.get(f"{app.engine.api_url.rsplit('/v1', 1)[0]}/health", timeout=10).json()
        assert "remote_stages" not in health
    finally:
        app.shutdown()
        agent.stop()


def _agent_port() -> int:
    from tests.engine.node.conftest import free_port as free_agent_port

    return free_agent_port()
