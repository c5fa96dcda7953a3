"""The stages a served model runs on, for /stats, /events, /metrics and /health.

The layout is read from the model once it is loaded: one stage for a plain model, one per local stage of a layer
split, one per worker behind a remote link. After each forward `SplitModel.stage_report()` says each stage's own
time, split into compute, waiting and transfer where it can; waiting and transfer are kept here (`Telemetry` keeps
each stage's own time).
"""

import threading
from dataclasses import dataclass, field
from typing import Any

from engine.telemetry.stats import RunningStat

KINDS = ("step", "prompt_chunk")


@dataclass(frozen=True)
class StageSlot:
    index: int
    begin: int
    end: int  # one past the stage's last layer
    device: str  # "cpu", "cuda:0", or "remote" for a worker
    host: str = ""  # a worker's address
    link: str = ""  # the endpoint of the link that reaches a worker (the key of `SplitModel.health()`)

    @property
    def remote(self) -> bool:
        return bool(self.link)

    @property
    def layers_text(self) -> str:
        return f"{self.begin}-{self.end - 1}"


def stage_layout(model: object, n_layer: int) -> list[StageSlot]:
    """The stages of a loaded model in order (the output head after a remote chain has no layers: not a stage)."""
    stages = getattr(model, "stages", None)
    if stages is None:
        return [StageSlot(0, 0, n_layer, str(getattr(model, "device", "cpu")))]
    out: list[StageSlot] = []
    for st in stages:
        chain = getattr(st, "chain", None)
        if chain is not None and hasattr(st, "ensure"):  # a link: one stage per worker behind it
            for j, c in enumerate(chain):
                # The first worker's address as this side dials it; a relayed one's as it reports itself.
                host = st.label if j == 0 else (c.address or st.label)
                out.append(StageSlot(len(out), c.begin, c.end, "remote", host, st.label))
        elif len(st.layers):
            out.append(StageSlot(len(out), st.layers.start, st.layers.stop, str(st.device)))
    return out


@dataclass
class _LinkTimes:
    wait_ms: RunningStat = field(default_factory=RunningStat)
    transfer_ms: RunningStat = field(default_factory=RunningStat)


class StageTimes:
    """Reads `stage_report()` entries into (stage index, own time, event details) and keeps the workers' waiting
    and transfer times per step and per prompt chunk."""

    def __init__(self, slots: list[StageSlot]) -> None:
        self.slots = slots
        self._by_layers = {s.layers_text: s.index for s in slots}
        self._lock = threading.Lock()
        self._times = {kind: [_LinkTimes() for _ in slots] for kind in KINDS}

    def record(self, kind: str, report: list[dict[str, Any]]) -> list[tuple[int, float, dict[str, Any]]]:
        """One forward's report -> (stage index, own ms, details for its event) per stage it names. A stage's own
        time is its compute where the report splits it into compute, waiting and transfer (every worker; a local
        stage once its device finished), else its host time."""
        out: list[tuple[int, float, dict[str, Any]]] = []
        for r in report:
            i = self._by_layers.get(str(r.get("layers")))
            if i is None:
                continue
            slot = self.slots[i]
            details: dict[str, Any] = {"layers": slot.layers_text, "device": slot.device}
            if slot.remote:
                details["host"] = slot.host
            if "compute_ms" not in r:
                out.append((i, float(r.get("ms", 0.0)), details))
                continue
            compute, wait, transfer = (float(r.get(k, 0.0)) for k in ("compute_ms", "wait_ms", "transfer_ms"))
            with self._lock:
                t = self._times[kind][i]
                t.wait_ms.add(wait)
                t.transfer_ms.add(transfer)
            details.update(
                compute_ms=round(compute, 3), wait_ms=round(wait, 3), transfer_ms=round(transfer, 3)
            )
            out.append((i, compute, details))
        return out

    def link_stats(self, index: int) -> dict[str, Any]:
        """A stage's waiting and transfer times (RunningStat dicts) per step and per prompt chunk."""
        with self._lock:
            out: dict[str, Any] = {}
            for kind in KINDS:
                t = self._times[kind][index]
                out[f"{kind}_wait_ms"] = t.wait_ms.to_dict()
                out[f"{kind}_transfer_ms"] = t.transfer_ms.to_dict()
            return out
