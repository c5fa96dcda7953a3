"""RemoteGpus: the worker PCs' GPU samples in the charts and "Lock clocks", against a real node agent on loopback
(its NVML scripted: the boundary) reached through the real `strata-node` command, and against a stand-in for the
failures."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from pytestqt.qtbot import QtBot

from app.clients.node_client import AgentInfo, NodeClient
from app.controllers.charts import ChartsController
from app.controllers.gpu_sampler import GpuSample
from app.controllers.remote_gpus import RemoteGpus, reason_mask, samples_from
from app.ui.charts_page import ChartsPage
from engine.node.agent import Agent, AgentOptions
from engine.node.client import main_keys
from tests.engine.node.conftest import pair_with
from tests.engine.node.fake_nvml import RTX_3070, RTX_3080, ClockNvml

NODE_CLI = [sys.executable, "-m", "engine.node.cli"]
FAKE_NODE = [sys.executable, str(Path(__file__).with_name("fake_node.py"))]


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


def test_reason_names_become_nvml_bits() -> None:
    assert reason_mask(["gpu_idle"]) == pynvml.nvmlClocksEventReasonGpuIdle
    assert (
        reason_mask(["sw_power_cap", "hw_thermal", "display_clocks", "not-a-reason"])
        == pynvml.nvmlClocksEventReasonSwPowerCap
        | pynvml.nvmlClocksEventReasonHwThermalSlowdown
        | pynvml.nvmlClocksEventReasonDisplayClockSetting
    )
    assert reason_mask(None) == 0


def test_samples_keep_their_spacing_on_this_pcs_clock() -> None:
    facts = {0: {"index": 0, "name": "NVIDIA GeForce RTX 3070", "max_sm_mhz": 1905, "vram_total": 8 << 30}}
    batch = [
        {"index": 0, "t": 1_700_000_000.0, "sm_mhz": 210, "mem_mhz": 405, "pstate": 8, "reasons": ["gpu_idle"],
         "util_gpu": 0, "vram_used": 1 << 30},
        {"index": 0, "t": 1_700_000_000.3, "sm_mhz": 1905, "mem_mhz": 7001, "pstate": None, "reasons": [],
         "util_gpu": 97, "vram_used": None},
    ]  # fmt: skip
    got = samples_from("pc-b", facts, batch, now=42.0)
    assert [round(s.t, 3) for s in got] == [41.7, 42.0]
    first, second = got
    assert (first.pstate, first.reasons, first.sm_mhz, first.util) == (8, 0x1, 210, 0)
    assert (second.pstate, second.vram_used, second.vram_total, second.max_sm_mhz) == (32, 0, 8 << 30, 1905)
    assert first.key == "pc-b:0" and first.label == "pc-b GPU 0 (NVIDIA GeForce RTX 3070)"
    assert samples_from("pc-b", facts, [], 1.0) == []


@pytest.fixture
def gpu_box(tmp_path: Path) -> Iterator[tuple[Agent, ClockNvml]]:
    """A worker PC's agent in this process, paired with this test's main keys (which the CLI reads too)."""
    nv = ClockNvml(cards=[RTX_3080, RTX_3070], lock_error=pynvml.NVML_ERROR_NO_PERMISSION)
    nv.live[1].pstate, nv.live[1].sm_mhz, nv.live[1].reasons = 5, 210, pynvml.nvmlClocksEventReasonGpuIdle
    opts = AgentOptions(
        tmp_path / "gpu-box", "127.0.0.1", 0, "gpu-box", nvml=nv, sample_ms=20, advertise=False
    )
    agent = Agent(opts).start()
    pair_with(agent, main_keys()).client.close()
    yield agent, nv
    agent.close()


def test_worker_pc_gpus_reach_the_charts_and_lock_is_refused_with_what_to_do(
    qtbot: QtBot, gpu_box: tuple[Agent, ClockNvml]
) -> None:
    agent, nv = gpu_box
    client = NodeClient(NODE_CLI)
    remote = RemoteGpus(client)
    charts = ChartsController()
    remote.sampled.connect(charts.on_gpu_samples)
    box = AgentInfo("gpu-box", f"127.0.0.1:{agent.port}", agent.keys.fingerprint, paired=True)
    try:
        remote.watch(
            [box, AgentInfo("pc-c", "10.0.0.9:7460", "FFFF", paired=False)]
        )  # not paired: not followed
        assert list(remote.watches) == [agent.keys.fingerprint]
        qtbot.waitUntil(lambda: {"gpu-box:0", "gpu-box:1"} <= set(charts.gpus), timeout=20000)
        card = charts.gpus["gpu-box:1"][-1]
        assert (card.name, card.pstate, card.sm_mhz, card.reasons, card.max_sm_mhz) == (
            "NVIDIA GeForce RTX 3070", 5, 210, 0x1, 1905
        )  # fmt: skip
        nv.live[1].pstate = 2
        qtbot.waitUntil(lambda: charts.gpus["gpu-box:1"][-1].pstate == 2, timeout=10000)

        with qtbot.waitSignal(remote.clocksDone, timeout=20000) as done:
            remote.set_clocks(card)
        key, ok, text = done.args
        assert key == "gpu-box:1" and ok is False
        assert "NOT locked: no permission to change clocks" in text and "administrator" in text
        assert "nvidia-smi -i 1 -lgc 1524,1905" in text
        assert ("lock_sm", 1, 1524, 1905) in nv.calls

        remote.watch([AgentInfo(box.name, box.address, box.fingerprint, paired=True, included=False)])
        assert remote.watches == {}  # excluded: its stream is stopped
    finally:
        remote.stop()
        client.shutdown()


def test_a_pc_whose_samples_fail_is_named_and_retried(qtbot: QtBot, tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_NODE_LOG", str(log))
    clock = Clock()
    client = NodeClient(FAKE_NODE)
    remote = RemoteGpus(client, clock=clock, retry_s=5.0)
    try:
        with qtbot.waitSignal(remote.problemsChanged, timeout=10000) as got:
            remote.watch([AgentInfo("pc-b", "192.168.1.30:7460", "AAAA-BBBB", paired=True)])
        assert got.args[0] == {
            "pc-b": "no GPU samples from 192.168.1.30:7460: AAAA-BBBB (192.168.1.30:7460) does not answer: "
            "tcp://192.168.1.30:7460 timed out after 10 s"
        }
        assert log.read_text().splitlines() == ["samples AAAA-BBBB --follow --json"]
        qtbot.wait(700)
        assert len(log.read_text().splitlines()) == 1  # not before its time
        clock.t += 5.0
        qtbot.waitUntil(lambda: len(log.read_text().splitlines()) == 2, timeout=5000)
    finally:
        remote.stop()
        client.shutdown()
    assert remote.problems == {}


def test_this_pcs_card_is_locked_here_and_a_gone_pc_is_said(
    qtbot: QtBot, tmp_path: Path, monkeypatch
) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_NODE_LOG", str(log))
    monkeypatch.setenv("FAKE_NODE_ADMIN", "1")
    client = NodeClient(FAKE_NODE)
    remote = RemoteGpus(client)
    local = GpuSample(1.0, 1, "NVIDIA GeForce RTX 3090", 210, 405, 2100, 9751, 8, 1, 90, 1, 2)
    with qtbot.waitSignal(remote.clocksDone, timeout=10000) as done:
        remote.set_clocks(local)
    assert done.args == ["local:1", True, "locked: SM 1680-2100 MHz, memory 9501 MHz"]
    assert log.read_text().splitlines() == ["clocks --here --gpu 1 --lock --json"]
    gone = GpuSample(1.0, 0, "RTX 3070", 210, 405, 1905, 7001, 8, 1, 90, 1, 2, host="pc-z")
    with qtbot.waitSignal(remote.clocksDone, timeout=2000) as done:
        remote.set_clocks(gone)
    assert done.args[:2] == ["pc-z:0", False] and "no longer a paired, included worker PC" in done.args[2]
    client.shutdown()


def test_flagged_card_offers_lock_and_shows_the_answer(qtbot: QtBot) -> None:
    clock = Clock()
    charts = ChartsController(clock=clock)
    page = ChartsPage(charts)
    qtbot.addWidget(page)
    page.show()
    asked: list[tuple[str, bool]] = []
    page.lockRequested.connect(lambda sample, lock: asked.append((sample.key, lock)))
    for i in range(60):  # decoding at 20 steps/s while pc-b's card keeps dropping to P8
        clock.t += 0.05
        charts.on_event({"type": "step", "stage": 0, "ms": 12.0})
        if i % 2 == 0:
            pstate = 8 if i % 4 == 0 else 2
            charts.on_gpu_samples(
                [GpuSample(clock.t, 0, "RTX 3070", 1905 if pstate == 2 else 210, 7001, 1905, 7001, pstate,
                           0x1 if pstate == 8 else 0, 95, 1, 2, host="pc-b")]
            )  # fmt: skip
    page.redraw()
    row = page.gpu_rows["pc-b:0"]
    assert "pc-b:0" in charts.flags
    assert not row.flag.isHidden() and not row.lock_button.isHidden() and row.lock_button.isEnabled()
    row.lock_button.click()
    assert asked == [("pc-b:0", True)] and not row.lock_button.isEnabled()
    assert row.lock_result.text() == "Asking its PC to lock the clocks…"
    page.on_lock_done("pc-b:0", False, "GPU 0 of pc-b: NOT locked: no permission to change clocks; run ...")
    assert row.lock_result.text().startswith("GPU 0 of pc-b: NOT locked") and row.lock_button.isEnabled()
    assert row.lock_button.text() == "Lock clocks"
    row.lock_button.click()  # the agent runs as root now
    page.on_lock_done("pc-b:0", True, "locked: SM 1524-1905 MHz, memory 7001 MHz")
    assert row.lock_result.text() == "Locked: SM 1524-1905 MHz, memory 7001 MHz"
    assert row.lock_button.text() == "Reset clocks"
    row.set_flag(None)  # steady now: the button stays, to give the clocks back
    assert not row.lock_button.isHidden()
    row.lock_button.click()
    assert asked[-1] == ("pc-b:0", False) and row.lock_result.text() == "Asking its PC to reset the clocks…"
    page.on_lock_done("pc-b:0", True, "reset: the driver manages the clocks again")
    assert row.lock_button.isHidden() and row.lock_button.text() == "Lock clocks"
    page.on_remote_problems({"pc-c": "no GPU samples from 10.0.0.9:7460: timed out"})
    assert not page.remote_note.isHidden() and page.remote_note.text() == (
        "pc-c: no GPU samples from 10.0.0.9:7460: timed out"
    )
