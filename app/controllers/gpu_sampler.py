"""`GpuSampler`: the local NVIDIA cards' clock state every 100 ms, read through NVML off the GUI thread.

Each round emits `sampled(list[GpuSample])`; where NVML is missing (no NVIDIA driver, no card) it emits
`unavailable(str)` once with the reason and stops. The NVML module can be injected for tests.

The thread never emits Qt signals itself (PySide6 6.8+ corrupts reference counts when Python objects cross threads
through a signal, PYSIDE-3124): it fills a queue that a timer on the GUI thread drains.
"""

import importlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

# NVML's clock-event reason bits (nvmlClocksEventReason*), in the order they matter to a user.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "idle"),
    (0x2, "application clocks"),
    (0x4, "power cap"),
    (0x8, "hardware slowdown"),
    (0x10, "sync boost"),
    (0x20, "thermal (software)"),
    (0x40, "thermal (hardware)"),
    (0x80, "power brake"),
    (0x100, "display clock"),
)


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]


@dataclass(frozen=True)
class GpuSample:
    """One card at one moment. Clocks in MHz, VRAM in bytes; `t` is time.monotonic() of the sample."""

    t: float
    index: int
    name: str
    sm_mhz: int
    mem_mhz: int
    max_sm_mhz: int
    max_mem_mhz: int
    pstate: int
    """0 (fastest) to 15; 32 where the driver does not say."""
    reasons: int
    util: int
    """Percent of the last sample period a kernel ran."""
    vram_used: int
    vram_total: int
    host: str = ""
    """Empty for this PC; the PC's name for cards reported by a node agent."""

    @property
    def key(self) -> str:
        return f"{self.host or 'local'}:{self.index}"

    @property
    def label(self) -> str:
        where = f"{self.host} " if self.host else ""
        return f"{where}GPU {self.index} ({self.name})"

    @property
    def reason_text(self) -> str:
        names = reason_names(self.reasons)
        return ", ".join(names) if names else "none"


def _decode(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _call(fn: Any, *args: Any, default: Any = None) -> Any:
    try:
        return fn(*args)
    except Exception:
        return default


class GpuSampler(QObject):
    sampled = Signal(list)
    unavailable = Signal(str)

    def __init__(self, interval_s: float = 0.1, nvml: Any = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.interval_s = interval_s
        self._nvml = nvml
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[list[GpuSample] | str] = queue.SimpleQueue()
        self._drain = QTimer(self)
        self._drain.setInterval(max(20, int(interval_s * 1000)))
        self._drain.timeout.connect(self.drain)
        self.reason: str | None = None
        """Why there are no samples (set once `unavailable` fired)."""

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()
        self._drain.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._thread = None
        self._drain.stop()
        self.drain()

    def drain(self) -> None:
        """Emit what the thread queued (GUI thread); stops the timer once the thread gave up."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, str):
                self.reason = item
                self.unavailable.emit(item)
            else:
                self.sampled.emit(item)
        if self.reason is not None and not self.running:
            self._drain.stop()

    def _load(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            return importlib.import_module("pynvml")
        except ImportError:
            return None

    def _run(self) -> None:
        nvml = self._load()
        if nvml is None:
            self._give_up("NVML (the nvidia-ml-py package) is not installed: no GPU clocks to show")
            return
        try:
            nvml.nvmlInit()
        except Exception as e:
            self._give_up(f"no NVIDIA driver answers here ({_decode(e)}): no GPU clocks to show")
            return
        try:
            count = int(nvml.nvmlDeviceGetCount())
            if count == 0:
                self._give_up("the NVIDIA driver reports no GPU: no GPU clocks to show")
                return
            devices = []
            for i in range(count):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                devices.append(
                    (
                        i,
                        h,
                        _decode(nvml.nvmlDeviceGetName(h)),
                        int(_call(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_SM, default=0) or 0),
                        int(_call(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_MEM, default=0) or 0),
                    )
                )
            reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
                nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
            )
            while not self._stop.is_set():
                t0 = time.monotonic()
                self._queue.put([self._sample(nvml, reasons_fn, t0, *dev) for dev in devices])
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))
        except Exception as e:
            self._give_up(
                f"reading the GPU clocks failed ({_decode(e)}): the charts stop here; check nvidia-smi"
            )
        finally:
            _call(nvml.nvmlShutdown)

    def _sample(
        self, nvml: Any, reasons_fn: Any, t: float, index: int, h: Any, name: str, max_sm: int, max_mem: int
    ) -> GpuSample:
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        util = _call(nvml.nvmlDeviceGetUtilizationRates, h)
        return GpuSample(
            t=t,
            index=index,
            name=name,
            sm_mhz=int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
            mem_mhz=int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM)),
            max_sm_mhz=max_sm,
            max_mem_mhz=max_mem,
            pstate=int(_call(nvml.nvmlDeviceGetPerformanceState, h, default=32)),
            reasons=int(_call(reasons_fn, h, default=0) or 0) if reasons_fn else 0,
            util=int(getattr(util, "gpu", 0)) if util is not None else 0,
            vram_used=int(mem.used),
            vram_total=int(mem.total),
        )

    def _give_up(self, reason: str) -> None:
        self._queue.put(reason)
