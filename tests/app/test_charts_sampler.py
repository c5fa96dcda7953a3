"""ChartsController (series, rates, the clock-drop flag) and GpuSampler (through a fake NVML module)."""

import pytest
from pytestqt.qtbot import QtBot

from app.controllers.charts import ChartsController, ClockFlag, StagePoint, stacked, stage_label, stage_point
from app.controllers.gpu_sampler import GpuSample, GpuSampler, reason_names
from tests.app.fake_nvml import GIB, FakeCard, FakeNvml, steady, two_cards


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def sample(t: float, index: int, sm: int, pstate: int, reasons: int = 0, util: int = 90) -> GpuSample:
    return GpuSample(t, index, f"card {index}", sm, 7001, 1905, 7001, pstate, reasons, util, 6 * GIB, 8 * GIB)


def test_events_become_series_and_rates() -> None:
    clock = Clock()
    c = ChartsController(clock=clock)
    for i in range(20):  # 10 steps per second on two stages for 2 s
        clock.t = 1000.0 + i * 0.1
        c.on_event({"type": "step", "stage": 0, "ms": 10.0 + i})
        c.on_event({"type": "step", "stage": 1, "ms": 20.0})
    c.on_event({"type": "prompt_chunk", "stage": 0, "tokens": 512, "ms": 100.0})
    c.on_event({"type": "request", "prompt_per_second": 900.0, "predicted_per_second": 31.0})
    assert [p.ms for p in c.steps[0]][:3] == [10.0, 11.0, 12.0]
    assert [(p.compute, p.wait, p.transfer) for p in c.steps[0]][0] == (
        10.0,
        0.0,
        0.0,
    )  # one stage: all compute
    assert len(c.steps[1]) == 20
    assert list(c.requests) == [(clock.t, 900.0, 31.0)]
    assert c.busy() and not c.busy(clock.t + 1.0)
    clock.t = 1001.95
    assert c.decode_rate(window_s=1.0) == 10.0  # the last stage's steps at 1001.0 .. 1001.9
    assert c.prompt_rate(window_s=2.0) == 256.0
    c.clear()
    assert not c.steps and not c.requests and c.decode_rate() == 0.0


def test_split_events_keep_compute_waiting_and_transfer() -> None:
    clock = Clock()
    c = ChartsController(clock=clock)
    worker = {"type": "step", "stage": 1, "ms": 5.0, "compute_ms": 5.0, "wait_ms": 0.4, "transfer_ms": 1.6,
              "layers": "24-47", "device": "remote", "host": "192.168.1.20:7470", "tokens": 3}  # fmt: skip
    local = {"type": "step", "stage": 0, "ms": 4.0, "compute_ms": 4.0, "wait_ms": 0.0, "transfer_ms": 0.0,
             "layers": "0-23", "device": "cuda:0", "tokens": 3}  # fmt: skip
    for i in range(10):
        clock.t = 1000.0 + i * 0.1
        c.on_event(local)
        c.on_event({**worker, "compute_ms": 5.0 + i})
    c.on_event({"type": "prompt_chunk", "stage": 1, "tokens": 256, "ms": 30.0, "compute_ms": 30.0,
                "wait_ms": 2.0, "transfer_ms": 8.0, "layers": "24-47", "host": "192.168.1.20:7470"})  # fmt: skip
    assert c.stage_labels == {0: "layers 0-23 on cuda:0", 1: "layers 24-47 at 192.168.1.20:7470"}
    p = c.steps[1][-1]
    assert (p.compute, p.wait, p.transfer, p.ms, p.tokens) == (14.0, 0.4, 1.6, 16.0, 3)
    assert c.chunks[1][-1] == StagePoint(clock.t, 30.0, 2.0, 8.0, 256)
    clock.t = 1000.95
    assert c.decode_rate(window_s=1.0) == 30.0  # 10 steps of 3 tokens (2 drafts kept) in the last second
    med = c.recent_split(1)
    assert med is not None and (med.compute, med.wait, med.transfer, med.tokens) == (9.5, 0.4, 1.6, 10)
    assert c.recent_split(3) is None
    assert stage_point({"type": "step"}, 1.0) is None
    assert stage_label({"layers": "0-5"}) == "layers 0-5" and stage_label({}) == ""


def test_stacked_areas_drop_to_zero_between_stretches() -> None:
    pts = [StagePoint(10.0, 3.0, 1.0, 0.5), StagePoint(10.1, 2.0, 1.0, 0.5), StagePoint(20.0, 4.0, 0.0, 1.0)]
    x, c, cw, total = stacked(pts, now=30.0, gap_s=1.0)
    assert x == pytest.approx([-20.05, -20.0, -19.9, -19.85, -10.05, -10.0, -9.95])
    assert c == [0.0, 3.0, 2.0, 0.0, 0.0, 4.0, 0.0]
    assert cw == [0.0, 4.0, 3.0, 0.0, 0.0, 4.0, 0.0]
    assert total == [0.0, 4.5, 3.5, 0.0, 0.0, 5.0, 0.0]
    live = stacked(pts[-1:], now=20.2, gap_s=1.0)
    assert live[0] == pytest.approx([-0.25, -0.2])  # still decoding: the last point is not closed
    assert stacked([], now=1.0) == ([], [], [], [])


def test_stage_gpus_come_from_stats() -> None:
    c = ChartsController()
    c.on_stats({"stages": [{"device": "cuda:0"}, {"device": "cuda:2"}, {"device": "cpu"}]})
    assert c.stage_gpus == {0, 2}


def run_decode(
    c: ChartsController, clock: Clock, states: dict[int, list[tuple[int, int, int]]], seconds: float
):
    """Decode at 20 steps/s while the cards are sampled every 100 ms with the given repeating states."""
    flags: list[list] = []
    c.flagsChanged.connect(flags.append)
    n = 0
    while clock.t < 1000.0 + seconds:
        clock.t += 0.05
        c.on_event({"type": "step", "stage": 0, "ms": 12.0})
        if n % 2 == 0:
            c.on_gpu_samples(
                [sample(clock.t, i, *seq[(n // 2) % len(seq)]) for i, seq in sorted(states.items())]
            )
        n += 1
    return flags


def test_card_that_drops_its_clocks_between_steps_is_flagged() -> None:
    clock = Clock()
    c = ChartsController(clock=clock)
    c.on_stats({"stages": [{"device": "cuda:0"}, {"device": "cuda:1"}]})
    steady_card = [(1905, 2, 0)]
    windows_card = [(1500, 2, 0), (1500, 2, 0), (210, 5, 0x1)]  # P5 at 210 MHz every third sample
    flags = run_decode(c, clock, {0: steady_card, 1: windows_card}, 3.0)
    assert set(c.flags) == {"local:1"}
    flag: ClockFlag = c.flags["local:1"]
    assert flag.worst == "P5, SM 210 MHz, memory 7001 MHz"
    assert 0.3 < flag.dropped / flag.busy < 0.37
    assert "drops its clocks between steps" in flag.text and "nvidia-smi -lgc" in flag.text
    assert flags and flags[-1][0].key == "local:1"


def test_idle_cards_and_cards_without_a_stage_are_not_flagged() -> None:
    clock = Clock()
    c = ChartsController(clock=clock)
    c.on_stats({"stages": [{"device": "cuda:0"}]})
    dropping = [(210, 8, 0x1)]
    run_decode(c, clock, {0: [(1905, 2, 0)], 1: dropping}, 2.0)  # card 1 serves no stage
    assert c.flags == {}
    idle = ChartsController(clock=clock)
    for _ in range(50):  # no steps at all: an idle card in P8 is normal
        clock.t += 0.1
        idle.on_gpu_samples([sample(clock.t, 0, 210, 8, 0x1, util=0)])
    assert idle.flags == {}


def test_flag_clears_once_the_clocks_are_locked() -> None:
    clock = Clock()
    c = ChartsController(clock=clock)
    c.on_stats({"stages": [{"device": "cuda:0"}]})
    run_decode(c, clock, {0: [(1500, 2, 0), (210, 5, 0x1)]}, 2.0)
    assert "local:0" in c.flags
    run_decode(c, clock, {0: [(1500, 2, 0)]}, 40.0)  # 30 s of steady samples push the drops out of the window
    assert c.flags == {}


def test_reason_names() -> None:
    assert reason_names(0) == []
    assert reason_names(0x1 | 0x4 | 0x40) == ["idle", "power cap", "thermal (hardware)"]


def test_sampler_reads_every_card(qtbot: QtBot) -> None:
    nvml = two_cards()
    sampler = GpuSampler(interval_s=0.02, nvml=nvml)
    got: list[list[GpuSample]] = []
    sampler.sampled.connect(got.append)
    sampler.start()
    try:
        qtbot.waitUntil(lambda: len(got) >= 6, timeout=3000)
    finally:
        sampler.stop()
    first = got[0][0]
    assert (first.index, first.name, first.sm_mhz, first.mem_mhz, first.pstate) == (
        0,
        "NVIDIA GeForce RTX 3090",
        1905,
        9501,
        0,
    )
    assert (first.max_sm_mhz, first.vram_used, first.vram_total, first.util) == (2100, 19 * GIB, 24 * GIB, 95)
    pstates = [round_[1].pstate for round_ in got[:6]]
    assert 5 in pstates and 2 in pstates  # the 3070 alternates as scripted
    assert all(r[1].reasons == 0x1 for r in got[:6] if r[1].pstate == 5)
    assert nvml.shutdowns == 1


def test_sampler_without_driver_says_why(qtbot: QtBot) -> None:
    sampler = GpuSampler(nvml=FakeNvml(init_error=RuntimeError("NVML Shared Library Not Found")))
    with qtbot.waitSignal(sampler.unavailable, timeout=3000) as got:
        sampler.start()
    assert (
        got.args[0] == "no NVIDIA driver answers here (NVML Shared Library Not Found): no GPU clocks to show"
    )
    assert sampler.reason == got.args[0]
    sampler.stop()


def test_sampler_with_no_cards(qtbot: QtBot) -> None:
    sampler = GpuSampler(nvml=FakeNvml([]))
    with qtbot.waitSignal(sampler.unavailable, timeout=3000) as got:
        sampler.start()
    assert "reports no GPU" in got.args[0]
    sampler.stop()


def test_sampler_survives_a_card_that_stops_answering(qtbot: QtBot) -> None:
    def broken(n: int) -> tuple[int, int, int, int, int, int]:
        if n > 2:
            raise RuntimeError("GPU is lost")
        return (1500, 7001, 2, 0, 50, GIB)

    sampler = GpuSampler(interval_s=0.01, nvml=FakeNvml([FakeCard("X", 1900, 7001, 8 * GIB, broken)]))
    got: list = []
    sampler.sampled.connect(got.append)
    with qtbot.waitSignal(sampler.unavailable, timeout=3000) as reason:
        sampler.start()
    qtbot.waitUntil(lambda: len(got) >= 1, timeout=1000)
    assert "GPU is lost" in reason.args[0] and "check nvidia-smi" in reason.args[0]
    sampler.stop()
    assert steady(1, 2, 3)(0) == (1, 2, 0, 0, 95, 3)


def test_slots_steps_waiting_and_rates_come_from_events_and_stats() -> None:
    """--parallel: each shared step's rows and busy slots (the first stage's), the requests waiting for a slot and
    each decoding slot's tokens/s (from /stats)."""
    clock = Clock()
    c = ChartsController(clock=clock)
    for i in range(10):  # 10 steps in 1 s: 4 slots busy, a prompt chunk of 12 rows in the fifth
        clock.t = 1000.0 + i * 0.1
        rows = 16 if i == 4 else 4
        c.on_event({"type": "step", "stage": 0, "ms": 8.0, "rows": rows, "slots": 4})
        c.on_event({"type": "step", "stage": 1, "ms": 8.0, "rows": rows, "slots": 4})  # the same step
    c.on_event({"type": "step", "stage": 0, "ms": 8.0})  # a request served alone: no slots
    assert [(b.rows, b.slots) for b in c.batch][:5] == [(4, 4)] * 4 + [(16, 4)]
    assert len(c.batch) == 10
    assert c.rows_per_step(window_s=2.0) == 5.2
    c.on_stats(
        {
            "queue": {"waiting": 3, "active": 4, "max": 64},
            "slots": {
                "total": 4,
                "busy": 4,
                "slots": [
                    {"index": 0, "state": "decode", "tokens": 40, "tokens_per_second": 41.5},
                    {"index": 1, "state": "prompt", "tokens": 12, "tokens_per_second": 0.0},
                    {"index": 2, "state": "idle", "tokens": 0, "tokens_per_second": 0.0},
                    {"index": 3, "state": "decode", "tokens": 90, "tokens_per_second": 39.0},
                ],
            },
        }
    )
    assert list(c.waiting) == [(clock.t, 3)]
    assert c.slot_rates == [(0, 41.5), (3, 39.0)]
    c.clear()
    assert not c.batch and not c.waiting and not c.slot_rates and c.rows_per_step() == 0.0


def test_the_slots_chart_shows_once_the_server_reports_slots(qtbot: QtBot) -> None:
    from app.ui.charts_page import ChartsPage

    clock = Clock()
    c = ChartsController(clock=clock)
    page = ChartsPage(c)
    qtbot.addWidget(page)
    page.show()
    c.on_event({"type": "step", "stage": 0, "ms": 8.0})
    page.redraw()
    assert page.slots_plot.isHidden()  # one request at a time: nothing to chart
    for _ in range(5):
        clock.t += 0.1
        c.on_event({"type": "step", "stage": 0, "ms": 8.0, "rows": 8, "slots": 8})
    c.on_stats(
        {
            "queue": {"waiting": 2},
            "slots": {"slots": [{"index": 5, "state": "decode", "tokens_per_second": 30.0}]},
        }
    )
    page.redraw()
    assert not page.slots_plot.isHidden()
    assert list(page.rows_live.getData()[1]) == [8.0]
    assert list(page.waiting_live.getData()[1]) == [2.0]
    assert "8.0 rows a step" in page.summary.text() and "slot 5 30.0 tok/s" in page.summary.text()
