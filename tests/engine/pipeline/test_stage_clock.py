"""Each local stage's compute, waiting and transfer in one forward of a split (engine.pipeline.stage_clock), against
stages whose own time is known: on the CPU they sleep, on CUDA they spin the card for a measured while."""

import time
from types import SimpleNamespace

import pytest
import torch

from engine.pipeline.stages import SplitModel
from engine.serve.stages import StageSlot, StageTimes

D = 8


class SleepStage:
    """Layers `layers` that take `ms` per call on `device` (host sleep on the CPU, a spinning kernel on CUDA)."""

    def __init__(self, layers: range, device: str, ms: float, cycles: int = 0) -> None:
        self.layers = layers
        self.device = torch.device(device)
        self.label = device
        self.ms = ms
        self.cycles = cycles

    def run(self, x: torch.Tensor, cache: object, start: int) -> torch.Tensor:
        if x.dtype == torch.long:  # the first stage gets token ids
            x = torch.zeros(x.shape[0], D, device=self.device)
        if self.device.type == "cuda":
            torch.cuda._sleep(self.cycles)
        else:
            time.sleep(self.ms / 1e3)
        return x + 1.0  # [T, D]


def _split(stages: list[SleepStage], pipeline: bool = False, pipe_chunk: int = 512) -> SplitModel:
    cfg = SimpleNamespace(n_layer=stages[-1].layers.stop)
    return SplitModel(cfg, stages, pipeline=pipeline, pipe_chunk=pipe_chunk)  # type: ignore[arg-type]


def _by_layers(sm: SplitModel) -> dict[str, dict[str, object]]:
    return {str(r["layers"]): r for r in sm.stage_report()}


def test_serial_step_on_the_cpu() -> None:
    """One step through two stages: the second waits for the whole first stage."""
    sm = _split([SleepStage(range(0, 2), "cpu", 40.0), SleepStage(range(2, 4), "cpu", 15.0)])
    t0 = time.perf_counter()
    sm.forward(torch.tensor([3]), SimpleNamespace(length=0), 0)
    wall = (time.perf_counter() - t0) * 1e3
    r = _by_layers(sm)
    first, second = r["0-1"], r["2-3"]
    assert 40.0 <= first["compute_ms"] < 70.0 and first["wait_ms"] < 5.0 and first["transfer_ms"] == 0.0
    assert 15.0 <= second["compute_ms"] < 45.0 and second["transfer_ms"] == 0.0
    assert abs(second["wait_ms"] - first["compute_ms"]) < 5.0
    total = second["compute_ms"] + second["wait_ms"] + second["transfer_ms"]
    assert total <= wall + 0.5  # the last stage's stack is how far into the forward it finished


def test_pipelined_prompt_pieces_on_the_cpu() -> None:
    """Four pieces: a slow first stage (20 ms a piece) feeds a fast second one (5 ms a piece), which idles between
    pieces: its waiting is the first stage's time less its own, about 4 x 20 + 5 - 4 x 5 = 65 ms."""
    sm = _split(
        [SleepStage(range(0, 2), "cpu", 20.0), SleepStage(range(2, 4), "cpu", 5.0)],
        pipeline=True,
        pipe_chunk=2,
    )
    sm.forward(torch.arange(8), SimpleNamespace(length=0), 0)
    r = _by_layers(sm)
    first, second = r["0-1"], r["2-3"]
    assert 80.0 <= first["compute_ms"] < 130.0 and first["wait_ms"] < 10.0
    assert 20.0 <= second["compute_ms"] < 60.0
    expected_wait = first["compute_ms"] + 5.0 - second["compute_ms"]
    assert abs(second["wait_ms"] - expected_wait) < 15.0


def test_stage_times_carry_the_split_into_events() -> None:
    slots = [
        StageSlot(0, 0, 2, "cuda:0"),
        StageSlot(1, 2, 4, "cuda:1"),
        StageSlot(2, 4, 6, "remote", "10.0.0.2:7470", "l"),
    ]
    times = StageTimes(slots)
    report = [
        {
            "layers": "0-1",
            "where": "cuda:0",
            "ms": 0.4,
            "compute_ms": 3.0,
            "wait_ms": 0.1,
            "transfer_ms": 0.0,
        },
        {"layers": "2-3", "where": "cuda:1", "ms": 0.2},  # its card had not finished: host time only
        {"layers": "4-5", "where": "10.0.0.2:7470", "compute_ms": 5.0, "wait_ms": 0.5, "transfer_ms": 1.5},
    ]
    out = times.record("step", report)
    assert [(i, ms) for i, ms, _ in out] == [(0, 3.0), (1, 0.2), (2, 5.0)]
    assert out[0][2] == {
        "layers": "0-1",
        "device": "cuda:0",
        "compute_ms": 3.0,
        "wait_ms": 0.1,
        "transfer_ms": 0.0,
    }
    assert out[1][2] == {"layers": "2-3", "device": "cuda:1"}
    assert out[2][2]["host"] == "10.0.0.2:7470" and out[2][2]["transfer_ms"] == 1.5
    assert times.link_stats(0)["step_wait_ms"]["last"] == 0.1
    assert times.link_stats(1)["step_wait_ms"]["count"] == 0


def _cycles_for(ms: float) -> int:
    """Spin cycles that take about `ms` on this card (measured with a host clock around a synchronized run)."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    per_ms = 10_000_000 / ((time.perf_counter() - t0) * 1e3)
    return int(per_ms * ms)


@pytest.mark.gpu
@pytest.mark.exclusive  # other processes' kernels time-slice the card and stretch the spins it measures
def test_cuda_step_adds_no_sync_and_splits_on_the_card() -> None:
    """Two stages on one card with the host hand-off between them (what --split-device 0 runs): forward() returns
    while the card still works (nothing waits for it), the split is there once the step's own sync ran, and it
    matches the spin times measured with a host clock."""
    a_ms, b_ms = 30.0, 10.0
    sm = _split(
        [
            SleepStage(range(0, 2), "cuda:0", a_ms, _cycles_for(a_ms)),
            SleepStage(range(2, 4), "cuda:0", b_ms, _cycles_for(b_ms)),
        ]
    )
    assert [h.mode for h in sm.handoffs] == ["host"]
    x = torch.tensor([3])
    # A kernel's first launch loads its module (CUDA's lazy loading), which waits for the card: the stages' own
    # kernels (fill, add) launched once first, as the engine's load and warm-up do for its kernels. Seen with a
    # profiler: the first forward spent 30 of 42 ms in SleepStage.run, the next ones 1.2 ms in all.
    sm.forward(x, SimpleNamespace(length=0), 0)
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sm.forward(x, SimpleNamespace(length=0), 0)
        launched = (time.perf_counter() - t0) * 1e3
        assert launched < a_ms / 2, f"forward() waited {launched:.1f} ms for the card"
        assert "compute_ms" not in _by_layers(sm)["2-3"]  # not finished: nothing is read, nothing waits
        torch.cuda.synchronize(0)  # the step's own sync (generate.sync_device)
        wall = (time.perf_counter() - t0) * 1e3
        r = _by_layers(sm)
        first, second = r["0-1"], r["2-3"]
        assert abs(first["compute_ms"] - a_ms) < 0.2 * a_ms and first["transfer_ms"] == 0.0
        assert abs(second["compute_ms"] - b_ms) < 0.2 * b_ms and 0.0 < second["transfer_ms"] < 2.0
        assert abs(second["wait_ms"] - first["compute_ms"]) < 0.2 * a_ms
        assert second["compute_ms"] + second["wait_ms"] + second["transfer_ms"] <= wall
