"""Reading the engine's GET /stats into what the windows show: one `StageView` per stage, the experts held in VRAM,
the last request's timings. Tolerant: a field the engine does not report reads as unknown, never as an error."""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageView:
    index: int
    host: str
    """Empty for this PC."""
    device: str
    begin: int | None
    end: int | None
    """Half-open layer range [begin, end)."""
    experts_in_vram: int | None
    experts_total: int | None
    hits: int | None
    misses: int | None
    step_ms: float | None
    cpu_share: float | None = None
    """The CPU's share of the card's decode misses now (tuned by the engine); None where the CPU takes none."""

    @property
    def hit_rate(self) -> float | None:
        if self.hits is None or self.misses is None or self.hits + self.misses == 0:
            return None
        return self.hits / (self.hits + self.misses)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _ms(v: Any) -> float | None:
    """A step time given as a number or as a summary ({"recent", "mean", "last", ...})."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, dict):
        for key in ("recent", "mean", "last"):
            if isinstance(v.get(key), int | float):
                return float(v[key])
    return None


def _fraction(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1 else None


def stage_views(stats: dict[str, Any]) -> list[StageView]:
    """The stages of GET /stats (engine/serve/protocol.py `StageStats`)."""
    stages = [s for s in stats.get("stages") or [] if isinstance(s, dict)]
    experts = stats.get("experts") if isinstance(stats.get("experts"), dict) else {}
    out = []
    for i, s in enumerate(stages):
        layers = s.get("layers")
        begin = end = None
        if isinstance(layers, list) and len(layers) == 2 and all(_int(x) is not None for x in layers):
            begin, end = int(layers[0]), int(layers[1])
        cache = s.get("expert_cache") if isinstance(s.get("expert_cache"), dict) else {}
        held, total = _int(cache.get("in_vram")), _int(cache.get("total"))
        if total is None and len(stages) == 1 and experts:  # no expert cache (the CPU): the model's own count
            held, total = _int(experts.get("in_vram")), _int(experts.get("routed"))
        index = _int(s.get("stage"))
        out.append(
            StageView(
                index=i if index is None else index,
                host=str(s.get("host") or ""),
                device=str(s.get("device") or "?"),
                begin=begin,
                end=end,
                experts_in_vram=held,
                experts_total=total,
                hits=_int(cache.get("hits")),
                misses=_int(cache.get("misses")),
                step_ms=_ms(s.get("step_ms")),
                cpu_share=_fraction(cache.get("cpu_share")),
            )
        )
    return out


def experts_held(stats: dict[str, Any]) -> tuple[int, int] | None:
    """(routed experts in VRAM, routed experts in all) for the whole model; None for a dense model or unknown."""
    experts = stats.get("experts")
    if isinstance(experts, dict) and _int(experts.get("routed")):
        return int(experts.get("in_vram") or 0), int(experts["routed"])
    views = stage_views(stats)
    if views and all(v.experts_total is not None for v in views):
        total = sum(v.experts_total or 0 for v in views)
        if total:
            return sum(v.experts_in_vram or 0 for v in views), total
    return None


def last_timings(stats: dict[str, Any]) -> dict[str, Any] | None:
    """The last finished request's timings (`LastRequest`: llama-server's timings, its endpoint and outcome)."""
    last = stats.get("last_request")
    return last if isinstance(last, dict) else None


def runs_on(stats: dict[str, Any]) -> str:
    parts = [str(stats[k]) for k in ("device", "arch", "dtype") if stats.get(k)]
    if stats.get("kv_type"):
        parts.append(f"KV {stats['kv_type']}")
    if stats.get("max_context"):
        parts.append(f"context {stats['max_context']}")
    host = stats.get("kv_host_layers")  # --kv-resident: their decode slows as the context fills
    if isinstance(host, list) and host:
        parts.append(f"KV of {len(host)} layer(s) in host RAM")
    if stats.get("n_layer"):
        parts.append(f"{stats['n_layer']} layers")
    return ", ".join(parts) or "–"


def queue_text(stats: dict[str, Any]) -> str:
    q = stats.get("queue")
    if isinstance(q, dict):
        return ", ".join(f"{k} {v}" for k, v in q.items() if isinstance(v, int | float) and k != "max") or "–"
    return f"{q} waiting" if q is not None else "–"


def slots_text(stats: dict[str, Any]) -> str:
    """--parallel: '2 of 4 busy, 3.5 rows a step (1 reading a prompt)'; '1 (one request at a time)' without slots."""
    sl = stats.get("slots")
    if not isinstance(sl, dict):
        return "1 (one request at a time)" if stats.get("status") == "ready" else "–"
    total, busy = sl.get("total"), sl.get("busy")
    text = f"{busy} of {total} busy"
    rows = sl.get("rows_per_step")
    mean = rows.get("recent") if isinstance(rows, dict) else None
    if isinstance(mean, int | float) and busy:
        text += f", {mean:.1f} rows a step"
    each = sl.get("slots")
    reading = (
        sum(1 for x in each if isinstance(x, dict) and x.get("state") == "prompt")
        if isinstance(each, list)
        else 0
    )
    if reading:
        text += f" ({reading} reading a prompt)"
    return text
