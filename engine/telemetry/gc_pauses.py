"""Python's garbage collector as the server sees it: how long its collections held every thread.

A loaded model leaves millions of objects (tensors, kernels, graphs, the tokenizer's tables) that a full collection
walks: one of those in the middle of a request would hold every client at once. The server freezes what the load made
(`freeze_loaded`: the collector never walks it again) and counts each generation's collections and pauses for
/stats, so a stall that remains shows there."""

import gc
import threading
import time
from dataclasses import dataclass, field


@dataclass
class GcPauses:
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    ms_total: float = 0.0
    ms_max: float = 0.0
    _t0: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        with self._lock:
            self.collections[min(int(info.get("generation", 0)), 2)] += 1
            self.ms_total += ms
            self.ms_max = max(self.ms_max, ms)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "collections": list(self.collections),
                "pause_ms_total": round(self.ms_total, 3),
                "pause_ms_max": round(self.ms_max, 3),
                "frozen_objects": gc.get_freeze_count(),
            }


PAUSES = GcPauses()


def watch() -> GcPauses:
    """Count the process's collections from now on (once per process) -> the counter."""
    if PAUSES not in gc.callbacks:
        gc.callbacks.append(PAUSES)
    return PAUSES


def freeze_loaded() -> tuple[int, float]:
    """Collect once, then move every object alive into the permanent generation, which collections skip (what a
    load made lives as long as the model) -> (objects frozen, milliseconds it took). An earlier freeze in this
    process (another model's load) is undone first, so that what of it is dead can go."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), (time.perf_counter() - t0) * 1e3


def unfreeze() -> None:
    """The model is leaving: what its load froze may be collected again."""
    gc.unfreeze()
