"""A routing trace on a model's device, replayed in place of the router's choice or recorded from it.

Set up from outside (engine.pipeline.loader.prepare, before the CUDA graphs): STRATA_ROUTE_TRACE=FILE replays a
trace (benchmarks, tests), STRATA_ROUTE_RECORD=N records the first N tokens (`strata-engine profile --trace`). The
router still runs; its choice and weights are then replaced by the trace's (replay) or copied into it (record).
Each layer's next trace row is the tokens it has counted (engine/kernels/route_trace.py), so a replay follows the
trace token by token from the start of the process, prompts and decode alike, wrapping at its end."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import kernels
from engine.experts.trace import RoutingTrace, TraceError, for_model, load_trace
from engine.layers.moe import count_experts
from installer.engine_options import runtime_switches

log = logging.getLogger("strata.engine")


class TraceRoute:
    """One stage's MoE layers' columns of a trace, on its device."""

    def __init__(
        self, ids: torch.Tensor, w: torch.Tensor, layers: list[int], replay: bool, meta: dict
    ) -> None:
        self.ids, self.w = ids, w  # int16 / float32 [N, L, k] on the device
        self.col = {li: j for j, li in enumerate(layers)}
        self.layers = layers
        self.replay = replay
        self.meta = meta
        self.k = ids.shape[2]

    @classmethod
    def replaying(cls, trace: RoutingTrace, device: torch.device) -> TraceRoute:
        ids = torch.from_numpy(np.ascontiguousarray(trace.ids)).to(device)
        w = torch.from_numpy(np.ascontiguousarray(trace.weights)).to(device)
        return cls(ids, w, list(trace.layers), True, trace.meta)

    @classmethod
    def recording(
        cls, tokens: int, layers: list[int], k: int, device: torch.device, meta: dict
    ) -> TraceRoute:
        ids = torch.zeros(tokens, len(layers), k, dtype=torch.int16, device=device)
        w = torch.zeros(tokens, len(layers), k, dtype=torch.float32, device=device)
        return cls(ids, w, layers, False, meta)

    def apply(
        self,
        li: int,
        w: torch.Tensor,
        ids: torch.Tensor,
        counts: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer li's routing (weights, ids [T, k]) -> the trace's (replay) or the same (record), with the
        selections counted into `counts` [E] (counting only the first rows[0] rows where `rows` is given)."""
        col = self.col[li]
        if ids.is_cuda:
            rt = kernels.loaded("route_trace")
            if rt is not None:
                if self.replay:
                    ids = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
                    w = torch.empty(ids.shape, dtype=torch.float32, device=ids.device)
                else:
                    ids, w = ids.contiguous(), w.float().contiguous()
                rt.trace_route(counts, self.ids, self.w, col, ids, w, self.replay, rows)
                return w, ids
        done = int(counts.sum().item()) // self.k  # the CPU (no graphs): read the cursor on the host
        t = ids.shape[0]
        n = self.ids.shape[0]
        at = torch.arange(done, done + t, device=self.ids.device)
        if self.replay:
            ids = self.ids[at % n, col].to(torch.int64).to(ids.device)
            w = self.w[at % n, col].to(w.device)
        else:
            real = t if rows is None else int(rows.item())
            keep = at[: min(real, max(n - done, 0))]
            self.ids[keep, col] = ids[: keep.numel()].to(torch.int16).to(self.ids.device)
            self.w[keep, col] = w[: keep.numel()].float().to(self.w.device)
        count_experts(counts, ids, rows)
        return w, ids

    def recorded(self, counts: torch.Tensor) -> RoutingTrace:
        """What a recording holds so far, as a trace (`counts`: the model's selection counts [n_layer, E])."""
        n_expert = counts.shape[1]
        done = min(int(counts[li].sum().item()) // self.k for li in self.layers)
        if done > self.ids.shape[0]:
            log.warning("the routing trace holds the first %d of %d tokens read", self.ids.shape[0], done)
            done = self.ids.shape[0]
        ids = self.ids[:done].cpu().numpy()
        w = self.w[:done].cpu().numpy()
        return RoutingTrace(ids, w, list(self.layers), n_expert, dict(self.meta, source="recorded"))


def attach(model: Any, env: dict[str, str] | None = None) -> TraceRoute | None:
    """The trace STRATA_ROUTE_TRACE / STRATA_ROUTE_RECORD ask for, set up for `model`'s MoE layers (None when
    neither is set). A model whose family routes another way, or a trace made for another model, is refused."""
    sw = runtime_switches(env)
    if sw.route_trace is None and sw.route_record == 0:
        return None
    cfg = model.cfg
    moe = [i for i, lw in model.layers.items() if getattr(lw, "experts", None) is not None]
    if not moe:
        return None
    if not getattr(model, "traces_routes", False):
        raise TraceError(
            f"routing traces replay softmax top-k routers (Qwen MoE, Mixtral-like); {cfg.arch} routes another way"
        )
    if sw.route_trace is not None:
        trace = load_trace(Path(sw.route_trace))
        mine = for_model(trace, sorted(moe), cfg.n_expert, cfg.n_expert_used)
        log.info(
            "routing replayed from %s (%d tokens, %s)",
            sw.route_trace,
            mine.tokens,
            mine.meta.get("source", "?"),
        )
        return TraceRoute.replaying(mine, model.device)
    meta = {"arch": cfg.arch}
    return TraceRoute.recording(sw.route_record, sorted(moe), cfg.n_expert_used, model.device, meta)


def recorded(models: list[Any]) -> RoutingTrace | None:
    """The trace the models (a split's local stages, or one model) recorded, their layers side by side, up to the
    tokens every one of them has read; None where none records."""
    parts = [
        m.route_trace.recorded(m.expert_counts)
        for m in models
        if getattr(m, "route_trace", None) is not None
        and not m.route_trace.replay
        and m.expert_counts is not None
    ]
    if not parts:
        return None
    n = min(p.tokens for p in parts)
    ids = np.concatenate([p.ids[:n] for p in parts], axis=1)
    w = np.concatenate([p.weights[:n] for p in parts], axis=1)
    layers = [li for p in parts for li in p.layers]
    return RoutingTrace(ids, w, layers, parts[0].n_expert, parts[0].meta)
