"""The next MoE layer's likely misses copied into VRAM while this layer computes (`--expert-prefetch router`).

A decode step that misses experts copies them across PCIe at the layer that chose them (kernels.stage_copy), with
PCIe idle the rest of the step: while the layer's own expert kernels run, while the CPU computes its share of the
misses, and through the next layer's attention. Here, once a layer's misses are staged, a side stream predicts
the next MoE layer's experts and stages the predicted misses into an area of their own; that layer's staging then
starts from tables where those experts read from VRAM, so it copies only what the prediction missed, and the CPU's
share of the misses (cpu_misses.post) counts them as hits.

The prediction (the published "pre-gating" observation: a layer's hidden state changes little from one layer to
the next, so the next layer's router applied to this layer's input ranks the experts it will choose): this layer's
normalised FFN input, rescaled from this layer's norm weights to the next layer's (the same hidden row under the
next norm), through the next layer's router, top-k. Under a replayed routing trace (benchmarks: a random-weight
file's router predicts nothing), STRATA_PREFETCH_TRACE=ACC predicts the trace's own next choices instead, each one
right with probability ACC and otherwise an expert the token does not choose, so that a prediction's accuracy is a
parameter of the measurement.

Two areas alternate by layer: the prediction for layer n+1 is written while layer n reads its own (staged by the
prediction made at layer n-1) from the other. The side stream starts after the layer's own staging launch (its
copies go first on PCIe) and the next layer waits for it before its staging reads the tables; both are stream
events, so a step with prefetches is still one CUDA graph (the fork and the join are edges of the graph). The areas'
VRAM is counted out of the experts' budget (policy.build_expert_cache). Predictions that miss cost PCIe time and
nothing else: a wrong expert is staged and not read; the right one is then copied by the layer as without prefetch,
so the tokens are the same with and without (tests/engine/experts/test_prefetch_gpu.py)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine import kernels

if TYPE_CHECKING:
    from engine.experts.cache import ExpertCache
    from engine.experts.replay import TraceRoute

log = logging.getLogger("strata.engine")
PREFETCH_MODES = ("off", "router")
AREAS = 2  # layer parity: the next layer's area is not the one this layer reads

# (layer, x32 [T, D] float32: the layer's normalised FFN input) -> predicted expert ids [T, k] of the next MoE layer
Predict = Callable[[int, torch.Tensor], torch.Tensor]


class PrefetchError(ValueError):
    """A prefetch that cannot run as asked; the message says what to change."""


def trace_predictions(ids: np.ndarray, n_expert: int, accuracy: float, seed: int = 0) -> np.ndarray:
    """A replayed trace's choices [N, L, k] as a predictor of the given accuracy would give them: each choice kept
    with probability `accuracy`, else replaced by an expert that token does not choose at that layer (drawn
    uniformly, no expert twice in a row). Pure (a seeded generator)."""
    if not 0.0 <= accuracy <= 1.0:
        raise PrefetchError(f"STRATA_PREFETCH_TRACE={accuracy}: give an accuracy between 0 and 1")
    rng = np.random.default_rng(seed)
    out = ids.astype(np.int64)
    n, layers, k = out.shape
    if k >= n_expert:
        return out.copy()
    result = np.empty_like(out)
    rows = np.arange(n)[:, None]
    for j in range(layers):  # a layer at a time: [N, E] random keys, not [N, L, E]
        chosen = out[:, j]  # [N, k]
        keys = rng.random((n, n_expert), dtype=np.float32)
        keys[rows, chosen] = 2.0  # the token's own choices sort last
        others = np.argsort(keys, axis=1)[:, :k]  # k distinct experts it does not choose, in random order
        wrong = rng.random((n, k)) >= accuracy
        wrong[:, n_expert - k :] = False  # (fewer other experts than choices: those slots stay right)
        result[:, j] = np.where(wrong, others, chosen)
    return result


class TracePredictor:
    """Predictions read from a replayed trace (STRATA_PREFETCH_TRACE=ACC): the next layer's row at the token that
    layer reads next (its selection counts over k, as the replay's own cursor), from a table made once."""

    def __init__(
        self, route: TraceRoute, counts: torch.Tensor, n_expert: int, accuracy: float, nxt: dict[int, int]
    ) -> None:
        table = trace_predictions(route.ids.cpu().numpy(), n_expert, accuracy)
        self.table = torch.from_numpy(table).to(route.ids.device)  # int64 [N, L, k]
        self.col, self.k, self.counts, self.nxt = route.col, route.k, counts, nxt

    def __call__(self, li: int, x32: torch.Tensor) -> torch.Tensor:
        nx = self.nxt[li]
        # the token layer nx reads next (a device scalar: no sync). The side stream reads it long before layer
        # nx counts this token; were it late, the prediction would be the next token's: fewer right, same output.
        at = self.counts[nx].sum() // self.k
        rows = (at + torch.arange(x32.shape[0], device=x32.device)) % self.table.shape[0]
        return self.table[rows, self.col[nx]]


class RouterPredictor:
    """The next MoE layer's router on this layer's normalised input, carried to the next layer's norm weights."""

    def __init__(self, model: Any, nxt: dict[int, int]) -> None:
        self.nxt, self.k = nxt, model.cfg.n_expert_used
        self.routers: dict[int, torch.Tensor] = {}
        self.rescale: dict[int, torch.Tensor] = {}
        for li, nx in nxt.items():
            w0 = model.layers[li].ffn_norm.float()
            w1 = model.layers[nx].ffn_norm.float()
            # x = h_hat * w0; the next layer's router reads h_hat * w1 (a zero weight leaves nothing to rescale)
            self.rescale[li] = torch.where(w0 != 0, w1 / torch.where(w0 != 0, w0, 1.0), 0.0).contiguous()
            router = model.expert_cache.layers[nx].router
            self.routers[nx] = router.dequant(torch.float32).contiguous()  # [E, D]

    def __call__(self, li: int, x32: torch.Tensor) -> torch.Tensor:
        nx = self.nxt[li]
        logits = (x32 * self.rescale[li]) @ self.routers[nx].t()  # [T, E]
        return torch.topk(logits, self.k, dim=-1).indices


class Prefetch:
    """One expert cache's next-layer prefetch: two staging areas (by layer parity), a side stream, and the
    prediction."""

    def __init__(
        self, cache: ExpertCache, predict: Predict, nxt: dict[int, int], slots: int, label: str
    ) -> None:
        self.cache, self.predict, self.nxt, self.label = cache, predict, nxt, label
        dev = cache.device
        self.stagers = [
            kernels.stage_copy.Stager(dev, slots, cache.stage_stride, cache.n_expert) for _ in range(AREAS)
        ]
        self.parity = {nx: j % AREAS for j, nx in enumerate(sorted(cache.layers))}
        cuda = dev.type == "cuda"
        self.stream = torch.cuda.Stream(dev) if cuda else None
        self.forks = {li: torch.cuda.Event() for li in nxt} if cuda else {}
        self.joins = {nx: torch.cuda.Event() for nx in nxt.values()} if cuda else {}
        self.first = min(cache.layers)
        self.pending: dict[int, torch.Tensor] = {}  # next layer -> its tables from this step's prediction
        self.issued = 0

    @property
    def area_bytes(self) -> int:
        return sum(s.area.numel() for s in self.stagers)

    def tables(self, li: int) -> torch.Tensor | None:
        """Layer li's tables with this step's prefetched experts in VRAM (the stream waits for their copies), or
        None where nothing was prefetched for it."""
        if li == self.first:  # a step cut short may have left predictions no layer took: not read, dropped
            self.pending.clear()
        tabs = self.pending.pop(li, None)
        if tabs is not None and self.stream is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(self.joins[li])
        return tabs

    def issue(self, li: int, x32: torch.Tensor) -> None:
        """After layer li's own staging was launched: predict the next MoE layer's experts from x32 [T, D] (li's
        normalised FFN input, float32) and stage its predicted misses on the side stream."""
        nx = self.nxt.get(li)
        if nx is None:
            return
        le = self.cache.layers[nx]
        if le.host_tables is None or le.tables is None or le.nbytes is None:
            return  # every expert of that layer is in VRAM
        stager = self.stagers[self.parity[nx]]
        if self.stream is None:
            self.pending[nx] = stager.stage(self.predict(li, x32), le.tables, le.host_tables, le.nbytes)
        else:
            main = torch.cuda.current_stream(self.cache.device)
            self.forks[li].record(main)
            self.stream.wait_event(self.forks[li])
            x32.record_stream(self.stream)  # not reused by the main stream before the side stream has read it
            with torch.cuda.stream(self.stream):
                self.pending[nx] = stager.stage(self.predict(li, x32), le.tables, le.host_tables, le.nbytes)
            self.joins[nx].record(self.stream)
        self.issued += 1


def next_layers(layers: list[int]) -> dict[int, int]:
    """Each MoE layer of a stage -> the next one in the same stage (the last has none). Pure."""
    return dict(itertools.pairwise(sorted(layers)))


def attach(model: Any, mode: str, accuracy: float | None) -> Prefetch | None:
    """Set up `mode`'s prefetch on `model`'s expert cache (None where it has nothing to prefetch: off, no cache, or
    every expert in VRAM). `accuracy`: STRATA_PREFETCH_TRACE's, with a replayed trace. The mode and the flags it
    needs were checked where the cache was built (policy.check_prefetch)."""
    cache = getattr(model, "expert_cache", None)
    if mode == "off" or cache is None or not cache.streams_prompts:
        return None
    nxt = next_layers(list(cache.layers))
    if not nxt:
        return None
    predict: Predict
    route = getattr(model, "route_trace", None)
    if accuracy is not None:
        if route is None or not route.replay or model.expert_counts is None:
            raise PrefetchError(
                "STRATA_PREFETCH_TRACE predicts from a replayed trace: set STRATA_ROUTE_TRACE too"
            )
        predict = TracePredictor(route, model.expert_counts, cache.n_expert, accuracy, nxt)
        how = f"the replayed trace's next choices at accuracy {accuracy:g}"
    else:
        predict = RouterPredictor(model, nxt)
        how = "the next layer's router on this layer's input"
    pf = Prefetch(cache, predict, nxt, cache.stage_slots, how)
    log.info(
        "expert prefetch: %d MoE layers stage their next layer's predicted misses (%s; %.0f MiB of staging)",
        len(nxt), how, pf.area_bytes / (1 << 20),
    )  # fmt: skip
    return pf
