"""What the server says about itself: /health, /v1/models and /stats (typed: engine/serve/protocol.py), from the
telemetry, the expert caches, the prompt cache and the links to remote stages (/metrics: metrics.py)."""

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from engine.serve.options import ServeOptions
from engine.serve.protocol import Health, Stats
from engine.telemetry import gc_pauses
from engine.telemetry.events import EventHub
from engine.telemetry.stats import RunningStat, Telemetry
from installer.version import __version__

if TYPE_CHECKING:
    from engine.pipeline.batch import BatchRunner
    from engine.pipeline.generate import Runner
    from engine.pipeline.loader import LoadedModel
    from engine.pipeline.prompt_cache import PromptCache
    from engine.serve.jobs import Job
    from engine.serve.stages import StageSlot, StageTimes


# While requests run, /stats' expert figures are this fresh at most: each read waits for the card (a sync per
# request that ended took the server's thread ~3 ms and the overlap of host and card with it).
EXPERTS_EVERY_S = 0.5


class Status:
    """Part of EngineService: reads its state (`status`, `error`), model, runner, queue, telemetry and stages."""

    status: str
    error: str | None
    lm: "LoadedModel | None"
    runner: "Runner | None"
    batch: "BatchRunner | None"
    running: "list[Job]"
    rows: RunningStat
    prompt_cache: "PromptCache | None"
    opts: ServeOptions
    model_name: str
    model_created: int
    kv_type: str | None
    hub: EventHub
    telemetry: Telemetry
    stage_slots: "list[StageSlot]"
    stage_times: "StageTimes | None"
    active: "Job | None"
    _experts_at: float = 0.0  # when _snapshot_experts last read the card

    @property
    def waiting(self) -> int:
        raise NotImplementedError

    def model_names(self) -> set[str]:
        raise NotImplementedError

    @property
    def generating(self) -> int:
        raise NotImplementedError

    def _snapshot_experts(self, force: bool = True) -> None:
        """The expert counts and caches' figures into the telemetry. Reading them waits for the steps queued, so
        while slots are decoding (`force` False) it happens at most every EXPERTS_EVERY_S."""
        now = time.monotonic()
        if not force and now - self._experts_at < EXPERTS_EVERY_S:
            return
        self._experts_at = now
        counts = self.lm.model.expert_counts if self.lm is not None else None
        if counts is not None:
            self.telemetry.set_expert_counts(counts.tolist())
        if self.lm is None:
            return
        # Each card's expert cache (CUDA): experts in VRAM, hits and misses since load, per stage.
        stages = getattr(self.lm.model, "stages", None)
        models = [getattr(st, "model", None) for st in stages] if stages is not None else [self.lm.model]
        for j, m in enumerate(models):
            cache = getattr(m, "expert_cache", None)
            if cache is not None:
                st = cache.stats()
                self.telemetry.set_expert_cache(j, st.hits, st.misses, st.experts_in_vram, st.experts_total,
                                                st.swaps, st.bytes_moved, st.cpu_computed, st.cpu_share)  # fmt: skip

    def links(self) -> list[tuple[str, str]]:
        """(address, status) of each link to a remote stage: "ok", or "down: <why>" since a request failed on it
        (the next request reconnects); empty without remote stages."""
        health = getattr(self.lm.model, "health", None) if self.lm is not None else None
        return [(str(a), str(st)) for a, st in health()] if health is not None else []

    def state(self) -> tuple[str, str | None]:
        """(status, error): loading, ready, error, or degraded while a remote stage is down (requests then fail
        with a 502 naming it; each new request tries to reconnect, and a success makes it ready again)."""
        down = [(a, st) for a, st in self.links() if st != "ok"]
        if self.status == "ready" and down:
            why = "; ".join(f"the remote stage at {a} is {st}" for a, st in down)
            return "degraded", f"{why}: requests fail until it is back (each request tries to reconnect)"
        return self.status, self.error

    def health(self) -> Health:
        status, error = self.state()
        out: dict[str, Any] = {
            "status": status,
            "model": self.model_name,
            "error": error,
            "queue": {"waiting": self.waiting, "active": self.generating},
        }
        links = self.links()
        if links:
            out["remote_stages"] = [{"address": a, "status": st} for a, st in links]
        return Health.model_validate(out)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "created": self.model_created,
            "owned_by": "polystrata",
            "status": self.state()[0],
            # the one model loaded answers requests whatever model name they send
            "aliases": sorted(self.model_names() - {self.model_name}),
            "answers_any_name": True,
        }
        if self.lm is not None:
            c = self.lm.config
            card["meta"] = {
                "arch": c.arch,
                "n_layer": c.n_layer,
                "n_expert": c.n_expert,
                "n_expert_used": c.n_expert_used,
                "n_ctx": self.opts.max_context,
                "n_ctx_train": c.n_ctx_train,
                "n_vocab": c.n_vocab,
                "size": self.lm.path.stat().st_size,
            }
        return card

    def stats(self, experts_detail: bool = False) -> Stats:
        snap = self.telemetry.snapshot()
        counts = snap.pop("expert_counts")
        active = self.active
        status, error = self.state()
        out: dict[str, Any] = {
            "status": status,
            "error": error,
            "model": self.model_name,
            "version": __version__,
            "uptime_s": snap["uptime_s"],
            "queue": {
                "waiting": self.waiting,
                "active": self.generating,
                "max": self.opts.max_queue,
                "active_request": (
                    {
                        "id": active.id,
                        "endpoint": active.endpoint,
                        "prompt_tokens": len(active.req.prompt),
                        "generated": active.generated,
                        "running_s": round(time.perf_counter() - (active.started or active.created), 3),
                    }
                    if active is not None
                    else None
                ),
            },
            "totals": snap["totals"],
            "requests": snap["requests"],
            "last_request": snap["last_request"],
            "events": {"subscribers": self.hub.subscribers, "dropped": self.hub.dropped},
            "gc": gc_pauses.PAUSES.snapshot(),
        }
        lm = self.lm
        if lm is None:
            out["stages"] = snap["stages"]
            return Stats.model_validate(out)
        c = lm.config
        device = str(lm.model.device)
        out.update(
            arch=c.arch,
            device=device,
            dtype=str(lm.model.dtype).removeprefix("torch."),
            kv_type=self.kv_type,
            max_context=self.opts.max_context,
            kv_host_layers=_host_kv_layers(lm.model),
            n_layer=c.n_layer,
        )
        links = dict(self.links())
        for st, slot in zip(snap["stages"], self.stage_slots, strict=False):
            st.update(device=slot.device, layers=[slot.begin, slot.end])
            if slot.remote:
                st.update(host=slot.host, status=links.get(slot.link, "ok"))
            if self.stage_times is not None:
                # step_ms and prompt_chunk_ms are the stage's own compute; its waiting and transfer come apart.
                st.update(self.stage_times.link_stats(slot.index))
        out["stages"] = snap["stages"]
        pc = self.prompt_cache
        if pc is not None:
            s = pc.stats()
            out["prompt_cache"] = dataclasses.asdict(
                s
            )  # the wire model (protocol.PromptCacheStats) checks it
        else:
            out["prompt_cache"] = None
        b = self.batch
        out["slots"] = (
            {
                "total": len(b.slots),
                "busy": b.busy,
                "groups": b.groups,
                "rows_per_step": self.rows.to_dict(),
                "slots": b.slot_report(),
            }
            if b is not None
            else None
        )
        if c.is_moe:
            routed = c.n_layer * c.n_expert
            per_layer = [sum(r) for r in counts] if counts else [0] * c.n_layer
            experts: dict[str, Any] = {
                "n_expert": c.n_expert,
                "n_expert_used": c.n_expert_used,
                "routed": routed,
                # With an expert cache (CUDA) its cards say how many are in VRAM; on the CPU none are.
                "in_vram": sum(st["expert_cache"]["in_vram"] or 0 for st in snap["stages"]),
                "selections_total": sum(per_layer),
                "selections_per_layer": per_layer,
                "cache": [st["expert_cache"] for st in snap["stages"]],
            }
            if experts_detail:
                experts["counts"] = counts
            out["experts"] = experts
        else:
            out["experts"] = None
        return Stats.model_validate(out)


def _host_kv_layers(model: object) -> list[int]:
    """The layers whose KV lives in page-locked host RAM (--kv-resident), over a split's local stages too."""
    stages = getattr(model, "stages", None)
    models = [getattr(st, "model", None) for st in stages] if stages else [model]
    return sorted({i for m in models for i in getattr(m, "kv_host_layers", ())})
