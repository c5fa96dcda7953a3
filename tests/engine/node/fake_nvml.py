"""A scripted NVML with live state and clock locking, built on the installer tests' fake cards.

Constants and errors are nvidia-ml-py's own (`pynvml.NVMLError(code)`), so the agent sees what the library raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

from tests.installer.fake_nvml import FakeCard, FakeNvml


@dataclass
class LiveState:
    sm_mhz: int = 1905
    mem_mhz: int = 7001
    max_mem_mhz: int = 7001
    pstate: int = 2
    reasons: int = 0
    util_gpu: int = 37
    util_mem: int = 12
    temp_c: int = 61
    power_mw: int = 180_500


@dataclass
class ClockNvml(FakeNvml):
    """FakeNvml plus clocks, P-state, clock-event reasons, utilisation and locked clocks."""

    live: list[LiveState] = field(default_factory=list)
    lock_error: int | None = None  # e.g. NVML_ERROR_NO_PERMISSION
    mem_lock_error: int | None = None
    calls: list[tuple] = field(default_factory=list)

    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_ERROR_NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    nvmlClocksEventReasonGpuIdle = pynvml.nvmlClocksEventReasonGpuIdle
    nvmlClocksEventReasonApplicationsClocksSetting = pynvml.nvmlClocksEventReasonApplicationsClocksSetting
    nvmlClocksEventReasonSwPowerCap = pynvml.nvmlClocksEventReasonSwPowerCap
    nvmlClocksEventReasonHwSlowdown = pynvml.nvmlClocksEventReasonHwSlowdown
    nvmlClocksEventReasonSyncBoost = pynvml.nvmlClocksEventReasonSyncBoost
    nvmlClocksEventReasonSwThermalSlowdown = pynvml.nvmlClocksEventReasonSwThermalSlowdown
    nvmlClocksEventReasonHwThermalSlowdown = pynvml.nvmlClocksEventReasonHwThermalSlowdown
    nvmlClocksEventReasonHwPowerBrakeSlowdown = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    nvmlClocksEventReasonDisplayClockSetting = pynvml.nvmlClocksEventReasonDisplayClockSetting

    def __post_init__(self) -> None:
        while len(self.live) < len(self.cards):
            self.live.append(LiveState())

    def _live(self, h: SimpleNamespace) -> LiveState:
        return self.live[h.i]

    def nvmlDeviceGetMaxClockInfo(self, h: SimpleNamespace, kind: int) -> int:
        if kind == pynvml.NVML_CLOCK_MEM:
            return self._live(h).max_mem_mhz
        return super().nvmlDeviceGetMaxClockInfo(h, kind)

    def nvmlDeviceGetClockInfo(self, h: SimpleNamespace, kind: int) -> int:
        return self._live(h).sm_mhz if kind == pynvml.NVML_CLOCK_SM else self._live(h).mem_mhz

    def nvmlDeviceGetPerformanceState(self, h: SimpleNamespace) -> int:
        return self._live(h).pstate

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: SimpleNamespace) -> int:
        return self._live(h).reasons

    def nvmlDeviceGetUtilizationRates(self, h: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._live(h).util_gpu, memory=self._live(h).util_mem)

    def nvmlDeviceGetTemperature(self, h: SimpleNamespace, sensor: int) -> int:
        return self._live(h).temp_c

    def nvmlDeviceGetPowerUsage(self, h: SimpleNamespace) -> int:
        return self._live(h).power_mw

    def nvmlDeviceSetGpuLockedClocks(self, h: SimpleNamespace, lo: int, hi: int) -> None:
        self.calls.append(("lock_sm", h.i, lo, hi))
        if self.lock_error is not None:
            raise pynvml.NVMLError(self.lock_error)

    def nvmlDeviceSetMemoryLockedClocks(self, h: SimpleNamespace, lo: int, hi: int) -> None:
        self.calls.append(("lock_mem", h.i, lo, hi))
        if self.mem_lock_error is not None:
            raise pynvml.NVMLError(self.mem_lock_error)

    def nvmlDeviceResetGpuLockedClocks(self, h: SimpleNamespace) -> None:
        self.calls.append(("reset_sm", h.i))
        if self.lock_error is not None:
            raise pynvml.NVMLError(self.lock_error)

    def nvmlDeviceResetMemoryLockedClocks(self, h: SimpleNamespace) -> None:
        self.calls.append(("reset_mem", h.i))
        if self.mem_lock_error is not None:
            raise pynvml.NVMLError(self.mem_lock_error)


RTX_3080 = FakeCard(
    "NVIDIA GeForce RTX 3080", 10240, (8, 6), cores=8704, max_sm_clock=1905, pcie=(4, 8, 4, 16)
)
RTX_3070 = FakeCard(
    "NVIDIA GeForce RTX 3070", 8192, (8, 6), cores=5888, max_sm_clock=1905, pcie=(3, 16, 4, 16)
)
