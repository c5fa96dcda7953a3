"""Per-stage timing and request totals, recorded by the generation worker and read by the HTTP side.

Every record call is cheap (a lock and a few additions) so that it can run once per decode step. A `listener`
receives each record as an event dict (`{"type": "step", "stage": 0, "ms": ..., "t": ...}`) for the live charts;
it is only called while `wants_events()` says someone listens, so no dict is built otherwise.
"""

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EventListener = Callable[[dict[str, Any]], None]

# Weight of the newest value in the "recent" average: about the last 20 values count.
_EMA = 0.1


@dataclass
class RunningStat:
    """count, sum, min, max, last and a recent (exponential) average of a series of values."""

    count: int = 0
    total: float = 0.0
    last: float = 0.0
    low: float = math.inf
    high: float = 0.0
    recent: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        self.last = x
        self.low = min(self.low, x)
        self.high = max(self.high, x)
        self.recent = x if self.count == 1 else self.recent + _EMA * (x - self.recent)

    def to_dict(self, digits: int = 3) -> dict[str, float | int | None]:
        if not self.count:
            return {
                "count": 0,
                "total": 0.0,
                "mean": None,
                "last": None,
                "min": None,
                "max": None,
                "recent": None,
            }
        return {
            "count": self.count,
            "total": round(self.total, digits),
            "mean": round(self.total / self.count, digits),
            "last": round(self.last, digits),
            "min": round(self.low, digits),
            "max": round(self.high, digits),
            "recent": round(self.recent, digits),
        }


@dataclass
class StageStats:
    step_ms: RunningStat
    prompt_chunk_ms: RunningStat
    prompt_chunk_tokens: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    experts_in_vram: int | None = None  # None: no expert cache on this stage (CPU, dense)
    experts_total: int | None = None
    expert_swaps: int = 0
    expert_bytes_moved: int = 0  # copied into VRAM by adaptive swaps and prompt chunks' staging
    experts_on_cpu: int = 0  # missed (token, expert) pairs the CPU computed (--cpu-experts)
    cpu_share: float | None = None  # the CPU's share of a decode step's misses now; None: the CPU takes none


class Telemetry:
    """Thread-safe counters for one engine: requests by endpoint and outcome, tokens, seconds, per-stage timings,
    expert selections. `snapshot()` returns plain data for /stats and /metrics."""

    def __init__(
        self,
        n_stages: int = 1,
        listener: EventListener | None = None,
        wants_events: Callable[[], bool] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._listener = listener
        self._wants = wants_events or (lambda: listener is not None)
        self.started = time.time()
        self.stages = [StageStats(RunningStat(), RunningStat()) for _ in range(max(1, n_stages))]
        self.requests: dict[tuple[str, str], int] = {}
        self.prompt_tokens = 0
        self.prompt_cached_tokens = 0
        self.generated_tokens = 0
        self.prompt_seconds = 0.0
        self.decode_seconds = 0.0
        self.last_request: dict[str, Any] | None = None
        self.expert_counts: list[list[int]] | None = None  # [n_layer][n_expert] selections since load

    def _emit(self, event: dict[str, Any]) -> None:
        if self._listener is not None:
            self._listener(event)

    def step(self, stage: int, ms: float, index: int | None = None) -> None:
        with self._lock:
            self.stages[stage].step_ms.add(ms)
        if self._wants():
            ev: dict[str, Any] = {"type": "step", "stage": stage, "ms": round(ms, 3), "t": time.time()}
            if index is not None:
                ev["index"] = index
            self._emit(ev)

    def prompt_chunk(self, stage: int, tokens: int, ms: float, start: int | None = None) -> None:
        with self._lock:
            st = self.stages[stage]
            st.prompt_chunk_ms.add(ms)
            st.prompt_chunk_tokens += tokens
        if self._wants():
            ev: dict[str, Any] = {
                "type": "prompt_chunk",
                "stage": stage,
                "tokens": tokens,
                "ms": round(ms, 3),
                "t": time.time(),
            }
            if start is not None:
                ev["start"] = start
            self._emit(ev)

    def set_expert_cache(
        self,
        stage: int,
        hits: int,
        misses: int,
        in_vram: int,
        total: int,
        swaps: int = 0,
        bytes_moved: int = 0,
        on_cpu: int = 0,
        cpu_share: float | None = None,
    ) -> None:
        """A stage's expert cache as its card reports it (totals since load; `cpu_share` as it is now)."""
        with self._lock:
            while len(self.stages) <= stage:
                self.stages.append(StageStats(RunningStat(), RunningStat()))
            st = self.stages[stage]
            st.expert_hits, st.expert_misses = hits, misses
            st.experts_in_vram, st.experts_total = in_vram, total
            st.expert_swaps, st.expert_bytes_moved, st.experts_on_cpu = swaps, bytes_moved, on_cpu
            st.cpu_share = cpu_share

    def set_expert_counts(self, counts: list[list[int]] | None) -> None:
        with self._lock:
            self.expert_counts = counts

    def request_done(self, endpoint: str, outcome: str, timings: dict[str, Any] | None = None) -> None:
        """One finished request. `outcome`: ok, cancelled, error, rejected. `timings` as in responses (prompt_n,
        cache_n, prompt_ms, predicted_n, predicted_ms, ...)."""
        with self._lock:
            key = (endpoint, outcome)
            self.requests[key] = self.requests.get(key, 0) + 1
            if timings is not None:
                self.prompt_tokens += int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0))
                self.prompt_cached_tokens += int(timings.get("cache_n", 0))
                self.generated_tokens += int(timings.get("predicted_n", 0))
                self.prompt_seconds += float(timings.get("prompt_ms", 0.0)) / 1e3
                self.decode_seconds += float(timings.get("predicted_ms", 0.0)) / 1e3
                self.last_request = {"endpoint": endpoint, "outcome": outcome, **timings, "t": time.time()}
        if timings is not None and self._wants():
            self._emit(
                {"type": "request", "endpoint": endpoint, "outcome": outcome, **timings, "t": time.time()}
            )

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            stages = [
                {
                    "stage": i,
                    "step_ms": s.step_ms.to_dict(),
                    "prompt_chunk_ms": s.prompt_chunk_ms.to_dict(),
                    "prompt_chunk_tokens": s.prompt_chunk_tokens,
                    "expert_cache": {
                        "in_vram": s.experts_in_vram,
                        "total": s.experts_total,
                        "hits": s.expert_hits,
                        "misses": s.expert_misses,
                        "swaps": s.expert_swaps,
                        "bytes_moved": s.expert_bytes_moved,
                        "computed_on_cpu": s.experts_on_cpu,
                        "cpu_share": s.cpu_share,
                        "hit_rate": (
                            round(s.expert_hits / (s.expert_hits + s.expert_misses), 4)
                            if s.expert_hits + s.expert_misses
                            else None
                        ),
                    },
                }
                for i, s in enumerate(self.stages)
            ]
            requests = [
                {"endpoint": e, "outcome": o, "count": n} for (e, o), n in sorted(self.requests.items())
            ]
            return {
                "uptime_s": round(time.time() - self.started, 3),
                "stages": stages,
                "requests": requests,
                "totals": {
                    "requests": sum(self.requests.values()),
                    "prompt_tokens": self.prompt_tokens,
                    "prompt_cached_tokens": self.prompt_cached_tokens,
                    "generated_tokens": self.generated_tokens,
                    "prompt_seconds": round(self.prompt_seconds, 6),
                    "decode_seconds": round(self.decode_seconds, 6),
                },
                "last_request": dict(self.last_request) if self.last_request else None,
                "expert_counts": [list(r) for r in self.expert_counts] if self.expert_counts else None,
            }
