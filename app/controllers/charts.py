"""`ChartsController`: the time series behind the live charts, fed by the engine's /events and the GPU samplers.

Per stage: the time of each decode step and of each prompt chunk, split into compute, waiting and transfer where
the engine reports them (every stage of a split; a single stage is all compute). With slots (--parallel): each
shared step's rows and busy slots, the requests waiting for a slot, and each decoding slot's tokens/s. Speed:
tokens/s of each finished request and live decode and prompt rates. Per GPU, this PC's and the worker PCs': SM and memory clock, P-state,
clock-event reasons, utilisation, VRAM.

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
GAP_S = 1.0
"""Steps further apart than this are separate stretches of decoding: the stacked chart drops to zero between them."""


@dataclass(frozen=True)
class StagePoint:
    """One decode step or prompt chunk of one stage: its time split into compute, waiting and transfer (ms)."""

    t: float
    compute: float
    wait: float = 0.0
    transfer: float = 0.0
    tokens: int = 1

    @property
    def ms(self) -> float:
        return self.compute + self.wait + self.transfer


@dataclass(frozen=True)
class BatchPoint:
    """One shared step of the server's slots (--parallel): its token rows and the slots holding a request."""

    t: float
    rows: int
    slots: int


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def stage_point(ev: dict, t: float, tokens: int = 1) -> StagePoint | None:
    """A step or prompt-chunk event as a StagePoint; None without a time. Without a split (`compute_ms` and the
    others absent) the whole time is compute."""
    compute = _num(ev.get("compute_ms"))
    if compute is None:
        ms = _num(ev.get("ms"))
        return None if ms is None else StagePoint(t, ms, 0.0, 0.0, tokens)
    wait, transfer = _num(ev.get("wait_ms")) or 0.0, _num(ev.get("transfer_ms")) or 0.0
    return StagePoint(t, compute, wait, transfer, tokens)


def stage_label(ev: dict) -> str:
    """`layers 0-23 on cuda:0`, or `layers 24-47 at 192.168.1.20:7470` for a worker; empty when not said."""
    layers = ev.get("layers")
    if not layers:
        return ""
    if ev.get("host"):
        return f"layers {layers} at {ev['host']}"
    return f"layers {layers} on {ev['device']}" if ev.get("device") else f"layers {layers}"


def stacked(
    points: list[StagePoint], now: float, gap_s: float = GAP_S
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Points -> (x = seconds before now, compute, compute + waiting, compute + waiting + transfer): the three
    boundaries of a stacked area chart. Between stretches further apart than `gap_s`, and before the first and
    after a last point older than `gap_s`, the area drops to zero instead of bridging the idle time."""
    x: list[float] = []
    c: list[float] = []
    cw: list[float] = []
    total: list[float] = []

    def zero(at: float) -> None:
        x.append(at - now)
        c.append(0.0)
        cw.append(0.0)
        total.append(0.0)

    edge = min(gap_s / 4, 0.05)
    prev: float | None = None
    for p in points:
        if prev is None or p.t - prev > gap_s:
            if prev is not None:
                zero(prev + edge)
            zero(p.t - edge)
        x.append(p.t - now)
        c.append(p.compute)
        cw.append(p.compute + p.wait)
        total.append(p.ms)
        prev = p.t
    if prev is not None and now - prev > gap_s:
        zero(prev + edge)
    return x, c, cw, total


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
            f"{self.worst}). Lock clocks asks its PC to hold them (administrator / root rights needed there), or "
            "lock them yourself: nvidia-smi -lgc <min>,<max> -lmc <mem>,<mem> as administrator"
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
        self.steps: dict[int, deque[StagePoint]] = {}
        self.chunks: dict[int, deque[StagePoint]] = {}
        """Per stage; a chunk's `tokens` is its prompt tokens, a step's the tokens it decided (drafts kept + 1)."""
        self.stage_labels: dict[int, str] = {}
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
        self.batch: deque[BatchPoint] = deque(maxlen=MAX_POINTS)
        """The first stage's shared steps (--parallel): rows and busy slots."""
        self.waiting: deque[tuple[float, int]] = deque(maxlen=MAX_POINTS)
        """(t, requests waiting for a slot) from each /stats poll."""
        self.slot_rates: list[tuple[int, float]] = []
        """(slot, tokens/s of the request it decodes) from the last /stats."""

    # -- inputs ------------------------------------------------------------------------------------------------

    def on_event(self, ev: dict) -> None:
        now = self.clock()
        kind = ev.get("type")
        stage = int(ev.get("stage", 0) or 0)
        self.events_seen += 1
        if kind in ("step", "prompt_chunk") and stage_label(ev):
            self.stage_labels[stage] = stage_label(ev)
        if kind == "step":
            p = stage_point(ev, now, int(_num(ev.get("tokens")) or 1))
            if p is not None:
                self.steps.setdefault(stage, deque(maxlen=MAX_POINTS)).append(p)
                self._last_step = now
            rows, slots = _num(ev.get("rows")), _num(ev.get("slots"))
            if rows is not None and slots is not None and stage == 0:
                self.batch.append(BatchPoint(now, int(rows), int(slots)))
        elif kind == "prompt_chunk":
            p = stage_point(ev, now, int(_num(ev.get("tokens")) or 0))
            if p is not None:
                self.chunks.setdefault(stage, deque(maxlen=MAX_POINTS)).append(p)
        elif kind == "request":
            prompt = float(ev.get("prompt_per_second") or 0.0)
            decode = float(ev.get("predicted_per_second") or 0.0)
            self.requests.append((now, prompt, decode))

    def on_stats(self, stats: dict) -> None:
        found = {_cuda_index(v.device) for v in stage_views(stats)}
        self.stage_gpus = {i for i in found if i is not None}
        q = stats.get("queue")
        waiting = _num(q.get("waiting")) if isinstance(q, dict) else None
        if waiting is not None:
            self.waiting.append((self.clock(), int(waiting)))
        sl = stats.get("slots")
        each = sl.get("slots") if isinstance(sl, dict) else None
        self.slot_rates = [
            (int(x["index"]), float(x.get("tokens_per_second") or 0.0))
            for x in each or ()
            if isinstance(x, dict) and x.get("state") == "decode" and _num(x.get("index")) is not None
        ]

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
        self.stage_labels.clear()
        self.requests.clear()
        self.batch.clear()
        self.waiting.clear()
        self.slot_rates = []
        self._clock_log.clear()
        self._last_step = float("-inf")
        if self.flags:
            self.flags.clear()
            self.flagsChanged.emit([])

    # -- derived -----------------------------------------------------------------------------------------------

    def busy(self, at: float | None = None) -> bool:
        return (self.clock() if at is None else at) - self._last_step <= BUSY_GAP_S

    def decode_rate(self, window_s: float = 2.0) -> float:
        """Tokens per second decided by the last stage's steps over the last `window_s` (one per step without
        drafts; a step that kept k drafts decided k + 1)."""
        if not self.steps:
            return 0.0
        last = self.steps[max(self.steps)]
        cut = self.clock() - window_s
        return sum(p.tokens for p in last if p.t > cut) / window_s

    def prompt_rate(self, window_s: float = 2.0) -> float:
        """Prompt tokens per second through the first stage over the last `window_s`."""
        if not self.chunks:
            return 0.0
        first = self.chunks[min(self.chunks)]
        cut = self.clock() - window_s
        return sum(p.tokens for p in first if p.t > cut) / window_s

    def rows_per_step(self, window_s: float = 2.0) -> float:
        """The mean token rows of the shared steps over the last `window_s` (0: none)."""
        cut = self.clock() - window_s
        rows = [b.rows for b in self.batch if b.t > cut]
        return sum(rows) / len(rows) if rows else 0.0

    def recent_split(self, stage: int, seconds: float = 5.0) -> StagePoint | None:
        """The median compute, waiting and transfer of a stage's steps over the last `seconds` (None: no steps)."""
        cut = self.clock() - seconds
        pts = [p for p in self.steps.get(stage, ()) if p.t >= cut]
        if not pts:
            return None

        def median(xs: list[float]) -> float:
            xs = sorted(xs)
            n = len(xs)
            return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

        return StagePoint(
            pts[-1].t,
            median([p.compute for p in pts]),
            median([p.wait for p in pts]),
            median([p.transfer for p in pts]),
            len(pts),
        )

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
