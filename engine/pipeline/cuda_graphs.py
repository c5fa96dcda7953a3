"""The decode step captured in CUDA graphs: one graph per (KV cache, attention span bucket), replayed per token.

A captured step launches its few hundred kernels at once instead of one by one from Python, which is what bounds
batch-1 decode. Positions are device tensors and the span of cache positions a step attends to is rounded up to a
bucket, so one graph serves every position of its bucket."""

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.layers.kv_cache import KVCache

if TYPE_CHECKING:
    from engine.models.decoder import DecoderLM

log = logging.getLogger("strata.engine")
SPAN_BUCKET = 256
MAX_GRAPHS = 48


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor  # [1] long
    pos: torch.Tensor  # [1] long
    out: torch.Tensor  # [1, V] logits


class DecodeGraphs:
    def __init__(self, model: "DecoderLM") -> None:
        self.model = model
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.pool: tuple | None = None
        self.usable = self._capturable()
        if not self.usable:
            log.info("decode runs without CUDA graphs: some expert block types have no fused kernel")

    def _capturable(self) -> bool:
        from engine.layers.moe import fused_moe_available

        m = self.model
        if m.expert_cache is None:
            return True
        c = m.cfg
        return all(
            fused_moe_available(
                le.gate.host.qtype, le.up.host.qtype, le.down.host.qtype, c.n_embd, c.n_ff_exp
            )
            for le in m.expert_cache.layers.values()
        )

    def step(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        span = min(cache.max_ctx, -(-(start + 1) // SPAN_BUCKET) * SPAN_BUCKET)
        key = (id(cache), span)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(tokens, cache, start, span)
            self.graphs[key] = g
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
            g.tok.copy_(tokens.view(1), non_blocking=True)
            g.pos.fill_(start)
        g.graph.replay()
        return g.out.clone()

    def _capture(self, tokens: torch.Tensor, cache: KVCache, start: int, span: int) -> _Graph:
        m = self.model
        dev = m.device
        tok = tokens.view(1).to(dev).clone()
        pos = torch.full((1,), start, dtype=torch.long, device=dev)
        # Warm-up runs compile the kernels; they repeat this step's own KV write, and the usage counters they
        # bump are put back.
        saved = m.expert_counts.clone() if m.expert_counts is not None else None
        saved_hits = m.expert_cache.snapshot_counters() if m.expert_cache is not None else None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                m.forward_at(tok, cache, pos, span)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = m.forward_at(tok, cache, pos, span)
        self.pool = graph.pool()
        if saved is not None:
            m.expert_counts.copy_(saved)
        if saved_hits is not None:
            m.expert_cache.restore_counters(saved_hits)
        return _Graph(graph, tok, pos, out)
