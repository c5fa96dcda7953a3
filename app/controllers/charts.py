"""`ChartsController`: the time series behind the live charts, fed by the engine's /events and the GPU sampler.

Per stage: the time of each decode step and of each prompt chunk. Speed: tokens/s of each finished request and a
live decode rate. Per GPU: SM and memory clock, P-state, clock-event reasons, utilisation, VRAM.

It also flags a card that drops its clocks between steps (seed 000: Windows put an idle worker card into P5 between
decode windows, and each window then waited for it): while the engine is decoding, a card that serves a stage and is
seen in P5 or lower, at under 60% of its top SM clock, or with NVML's "idle" reason in at least 10% (and 3) of its
samples over the last 30 s is flagged, with the way to lock its clocks.
"""

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal

from app.controllers.gpu_sampler import GpuSample
from app.controllers.stats import stage_views

WINDOW_S = 60.0
FLAG_WINDOW_S = 30.0
BUSY_GAP_S = 0.5
"""A sample counts as "while decoding" when a step event arrived this recently."""
DROP_PSTATE = 5
DROP_CLOCK_FRACTION = 0.6
FLAG_MIN_SAMPLES = 3
FLAG_MIN_FRACTION = 0.10
IN_USE_UTIL = 10
MAX_POINTS = 4000


@dataclass(frozen=True)
class ClockFlag:
    key: str
    label: str
    dropped: int
    busy: int
    worst: str
    """The lowest state seen, e.g. `P5, SM 210 MHz, memory 810 MHz`."""

    @property
    def text(self) -> str:
        share = self.dropped / max(self.busy, 1)
        return (
            f"{self.label} drops its clocks between steps ({share:.0%} of its samples while decoding, down to "
            f"{self.worst}); lock its clocks: nvidia-smi -lgc <min>,<max> -lmc <mem>,<mem> as administrator"
        )


def _dropped(s: GpuSample) -> bool:
    low_pstate = DROP_PSTATE <= s.pstate <= 15
    low_clock = s.max_sm_mhz > 0 and s.sm_mhz < DROP_CLOCK_FRACTION * s.max_sm_mhz
    return low_pstate or low_clock or bool(s.reasons & 0x1)


def _cuda_index(device: object) -> int | None:
    m = re.fullmatch(r"(?:cuda|CUDA):?(\d+)", str(device))
    return int(m.group(1)) if m else None


class ChartsController(QObject):
    flagsChanged = Signal(list)
    """The list of ClockFlag now raised."""
    gpuUnavailable = Signal(str)

    def __init__(self, clock: Callable[[], float] = time.monotonic, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.clock = clock
        self.t0 = clock()
        self.steps: dict[int, deque[tuple[float, float]]] = {}
        self.chunks: dict[int, deque[tuple[float, float, int]]] = {}
        self.requests: deque[tuple[float, float, float]] = deque(maxlen=MAX_POINTS)
        """(t, prompt tokens/s, decode tokens/s) of each finished request."""
        self.gpus: dict[str, deque[GpuSample]] = {}
        self.gpu_reason: str | None = None
        self.stage_gpus: set[int] = set()
        """CUDA indices of the cards that serve a stage (from /stats), for the clock flag."""
        self.flags: dict[str, ClockFlag] = {}
        self._clock_log: dict[str, deque[tuple[GpuSample, bool, bool]]] = {}
        self._last_step = float("-inf")
        self.events_seen = 0

    # -- inputs ------------------------------------------------------------------------------------------------

    def on_event(self, ev: dict) -> None:
        now = self.clock()
        kind = ev.get("type")
        stage = int(ev.get("stage", 0) or 0)
        self.events_seen += 1
        if kind == "step" and isinstance(ev.get("ms"), int | float):
            self.steps.setdefault(stage, deque(maxlen=MAX_POINTS)).append((now, float(ev["ms"])))
            self._last_step = now
        elif kind == "prompt_chunk" and isinstance(ev.get("ms"), int | float):
            tokens = int(ev.get("tokens", 0) or 0)
            self.chunks.setdefault(stage, deque(maxlen=MAX_POINTS)).append((now, float(ev["ms"]), tokens))
        elif kind == "request":
            timings = ev.get("timings") if isinstance(ev.get("timings"), dict) else ev
            prompt = float(timings.get("prompt_per_second") or 0.0)
            decode = float(timings.get("predicted_per_second") or 0.0)
            self.requests.append((now, prompt, decode))

    def on_stats(self, stats: dict) -> None:
        found = {_cuda_index(v.device) for v in stage_views(stats)}
        self.stage_gpus = {i for i in found if i is not None}

    def on_gpu_samples(self, samples: list[GpuSample]) -> None:
        changed = False
        for s in samples:
            self.gpus.setdefault(s.key, deque(maxlen=int(WINDOW_S * 12))).append(s)
            changed |= self._track_clocks(s)
        if changed:
            self.flagsChanged.emit(list(self.flags.values()))

    def on_gpu_unavailable(self, reason: str) -> None:
        self.gpu_reason = reason
        self.gpuUnavailable.emit(reason)

    def clear(self) -> None:
        self.steps.clear()
        self.chunks.clear()
        self.requests.clear()
        self._clock_log.clear()
        self._last_step = float("-inf")
        if self.flags:
            self.flags.clear()
            self.flagsChanged.emit([])

    # -- derived -----------------------------------------------------------------------------------------------

    def busy(self, at: float | None = None) -> bool:
        return (self.clock() if at is None else at) - self._last_step <= BUSY_GAP_S

    def decode_rate(self, window_s: float = 2.0) -> float:
        """Steps per second of the last stage over the last `window_s` (one token per step without drafts)."""
        if not self.steps:
            return 0.0
        last = self.steps[max(self.steps)]
        cut = self.clock() - window_s
        n = sum(1 for t, _ in reversed(last) if t > cut)
        return n / window_s

    def prompt_rate(self, window_s: float = 2.0) -> float:
        """Prompt tokens per second through the first stage over the last `window_s`."""
        if not self.chunks:
            return 0.0
        first = self.chunks[min(self.chunks)]
        cut = self.clock() - window_s
        return sum(tok for t, _, tok in first if t > cut) / window_s

    def _track_clocks(self, s: GpuSample) -> bool:
        """Update this card's flag from its last 30 s of samples; True when the flag changed."""
        log = self._clock_log.setdefault(s.key, deque())
        busy = self.busy(s.t)
        log.append((s, busy, busy and _dropped(s)))
        while log and log[0][0].t < s.t - FLAG_WINDOW_S:
            log.popleft()
        if self.stage_gpus and not s.host:
            in_use = s.index in self.stage_gpus
        else:  # no split plan known (or a remote card): a card that worked while the engine decoded
            in_use = any(b and x.util >= IN_USE_UTIL for x, b, _ in log)
        busy_n = sum(1 for _, b, _ in log if b)
        drops = [x for x, _, d in log if d]
        if in_use and len(drops) >= max(FLAG_MIN_SAMPLES, FLAG_MIN_FRACTION * busy_n):
            w = max(drops, key=lambda x: (x.pstate if x.pstate <= 15 else -1, -x.sm_mhz))
            flag = ClockFlag(
                s.key, s.label, len(drops), busy_n, f"P{w.pstate}, SM {w.sm_mhz} MHz, memory {w.mem_mhz} MHz"
            )
            changed = self.flags.get(s.key) != flag
            self.flags[s.key] = flag
            return changed
        return self.flags.pop(s.key, None) is not None
