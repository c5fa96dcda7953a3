"""Each local stage's compute, waiting and transfer time in one forward of a split, measured on its own device.

- compute: the stage's layers on its device (every prompt piece together);
- transfer: the hand-offs that bring the stage its input (the copy out of the previous device and into this one);
- waiting: the rest of the stage's span in the forward, from the forward's start to the end of its last compute:
  time its device sat idle because its input had not arrived yet (in a decode step: the stages before it).

So compute + waiting + transfer is how far into the forward the stage finished. On CUDA the points are events on
the stage's stream (a few `record`s per step, no host sync); they are read after the step's own sync and only
when `query()` says they have completed, so reading never waits on a card. On the CPU they are `perf_counter()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class Mark:
    """A point on one device's timeline: a CUDA event on its current stream, or the host clock."""

    __slots__ = ("event", "t")

    def __init__(self, device: torch.device, event: torch.cuda.Event | None = None) -> None:
        """A new mark now; or `event`, one already recorded with timing enabled."""
        if event is not None:
            self.event, self.t = event, 0.0
        elif device.type == "cuda":
            self.event: torch.cuda.Event | None = torch.cuda.Event(enable_timing=True)
            self.event.record(torch.cuda.current_stream(device))
            self.t = 0.0
        else:
            self.event = None
            self.t = time.perf_counter()

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


def span_ms(a: Mark, b: Mark) -> float:
    """Milliseconds from a to b (two marks of one device, both completed)."""
    if a.event is not None and b.event is not None:
        return float(a.event.elapsed_time(b.event))
    return (b.t - a.t) * 1e3


@dataclass
class HopMarks:
    """One hand-off of one piece: the copy out on the sending device, the copy in on the receiving one. A mark left
    None is a copy the path does not make (a CPU-to-CPU hand-off makes none)."""

    out_begin: Mark | None = None
    out_end: Mark | None = None
    in_begin: Mark | None = None
    in_end: Mark | None = None

    def marks(self) -> list[Mark]:
        return [m for m in (self.out_begin, self.out_end, self.in_begin, self.in_end) if m is not None]

    def out_ms(self) -> float:
        if self.out_begin is None or self.out_end is None:
            return 0.0
        return span_ms(self.out_begin, self.out_end)

    def in_ms(self) -> float:
        if self.in_begin is None or self.in_end is None:
            return 0.0
        return span_ms(self.in_begin, self.in_end)


@dataclass
class _StageMarks:
    start: Mark
    compute: list[tuple[Mark, Mark]] = field(default_factory=list)
    hops_in: list[HopMarks] = field(default_factory=list)
    hops_out: list[HopMarks] = field(default_factory=list)


@dataclass(frozen=True)
class StageSplit:
    compute_ms: float
    wait_ms: float
    transfer_ms: float


class ForwardClock:
    """The marks of one forward, one set per stage; each stage's marks are written by the thread that runs it."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.stages = [_StageMarks(Mark(d)) for d in devices]

    def begin(self, s: int) -> Mark:
        return Mark(self.devices[s])

    def end(self, s: int, begin: Mark) -> None:
        self.stages[s].compute.append((begin, Mark(self.devices[s])))

    def hop(self, s: int) -> HopMarks:
        """The marks of one hand-off from stage s to stage s+1 (filled by `Handoff.send`)."""
        h = HopMarks()
        self.stages[s].hops_out.append(h)
        self.stages[s + 1].hops_in.append(h)
        return h

    def split(self, s: int) -> StageSplit | None:
        """Stage s's compute, waiting and transfer in this forward; None while a card has not finished them."""
        st = self.stages[s]
        if not st.compute:
            return None
        marks = [st.start, *(m for pair in st.compute for m in pair)]
        marks += [m for h in st.hops_in for m in h.marks()]
        marks += [m for h in st.hops_out[:-1] for m in h.marks()]
        if not all(m.ready() for m in marks):
            return None
        compute = sum(span_ms(a, b) for a, b in st.compute)
        transfer = sum(h.out_ms() + h.in_ms() for h in st.hops_in)
        # The copies out of earlier pieces lie inside this stage's span; the last one comes after it.
        sending = sum(h.out_ms() for h in st.hops_out[:-1])
        span = span_ms(st.start, st.compute[-1][1])
        wait = max(span - compute - transfer - sending, 0.0)
        return StageSplit(compute, wait, transfer)
