"""A fake NVML module (the subset of pynvml the GPU sampler calls), with scripted clock states per card."""

import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
GIB = 1024**3


@dataclass
class FakeCard:
    name: str
    max_sm: int
    max_mem: int
    vram_total: int
    state: Callable[[int], tuple[int, int, int, int, int, int]]
    """Sample number -> (sm MHz, mem MHz, P-state, reasons bitmask, util %, VRAM used bytes)."""


def steady(
    sm: int, mem: int, used: int, util: int = 95
) -> Callable[[int], tuple[int, int, int, int, int, int]]:
    return lambda _n: (sm, mem, 0, 0, util, used)


def dropping(
    sm: int, mem: int, used: int, every: int = 3
) -> Callable[[int], tuple[int, int, int, int, int, int]]:
    """Every `every`-th sample the card sits in P5 at low clocks with the idle reason (seed 000's Windows card)."""

    def state(n: int) -> tuple[int, int, int, int, int, int]:
        if n % every == 0:
            return (210, 810, 5, 0x1, 3, used)
        return (sm, mem, 2, 0, 80, used)

    return state


class FakeNvml:
    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVML_CLOCK_MEM = NVML_CLOCK_MEM

    def __init__(self, cards: list[FakeCard] | None = None, init_error: Exception | None = None) -> None:
        self.cards = cards or []
        self.init_error = init_error
        self.samples = [0] * len(self.cards)
        self.lock = threading.Lock()
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.cards[h].name.encode()

    def nvmlDeviceGetMaxClockInfo(self, h: int, kind: int) -> int:
        return self.cards[h].max_sm if kind == NVML_CLOCK_SM else self.cards[h].max_mem

    def _state(self, h: int) -> tuple[int, int, int, int, int, int]:
        return self.cards[h].state(self.samples[h])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        # The memory query is the first of each round: advance this card's sample counter here.
        with self.lock:
            self.samples[h] += 1
        used = self._state(h)[5]
        return SimpleNamespace(
            used=used, total=self.cards[h].vram_total, free=self.cards[h].vram_total - used
        )

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        sm, mem, *_ = self._state(h)
        return sm if kind == NVML_CLOCK_SM else mem

    def nvmlDeviceGetPerformanceState(self, h: int) -> int:
        return self._state(h)[2]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._state(h)[3]

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._state(h)[4], memory=40)


def two_cards() -> FakeNvml:
    """An RTX 3090 that holds its clocks and an RTX 3070 that drops them between steps."""
    return FakeNvml(
        [
            FakeCard("NVIDIA GeForce RTX 3090", 2100, 9751, 24 * GIB, steady(1905, 9501, 19 * GIB)),
            FakeCard("NVIDIA GeForce RTX 3070", 1905, 7001, 8 * GIB, dropping(1500, 7001, 6 * GIB)),
        ]
    )
