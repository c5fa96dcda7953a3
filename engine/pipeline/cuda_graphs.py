"""Decode steps captured in CUDA graphs: one graph per (KV cache, attention span bucket), replayed per token.

A captured step launches its few hundred kernels at once instead of one by one from Python, which is what bounds
batch-1 decode. Positions are device tensors and the span of cache positions a step attends to is rounded up to a
bucket, so one graph serves every position of its bucket. The same machinery serves a whole model (token in,
logits out) and a pipeline stage (hidden state in, hidden state or logits out)."""

import gc
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from engine.layers.kv_cache import KVCache

if TYPE_CHECKING:
    from engine.models.decoder import DecoderLM

log = logging.getLogger("strata.engine")
SPAN_BUCKET = 256
MAX_GRAPHS = 48
G = TypeVar("G")

# body(inp, cache, pos, span) -> out: one step from a static input buffer, capturable
StepBody = Callable[[torch.Tensor, KVCache, torch.Tensor, int], torch.Tensor]


@contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, pool: tuple | None, stream: torch.cuda.Stream | None = None
) -> Iterator[None]:
    """`torch.cuda.graph` with no garbage collection inside: a dead model in a reference cycle (an earlier load)
    would otherwise free its pinned host memory in the middle of the capture, a CUDA call that a capturing stream
    forbids, and the capture would fail. `stream`: capture on it (a stream of the stage's own card; torch's
    default capture stream belongs to the card current when it was first made)."""
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    finally:
        gc.enable()


class GraphTable(Generic[G]):
    """Captured graphs by (KV cache, span bucket), the least recently used dropped past MAX_GRAPHS. A cache's graphs
    go when the cache does: they write into its tensors, and a later cache could be given the same id()."""

    def __init__(self) -> None:
        self.graphs: OrderedDict[tuple[int, Hashable], G] = OrderedDict()
        self._watched: set[int] = set()

    def get(self, cache: KVCache, span: Hashable) -> G | None:
        g = self.graphs.get((id(cache), span))
        if g is not None:
            self.graphs.move_to_end((id(cache), span))
        return g

    def put(self, cache: KVCache, span: Hashable, g: G) -> None:
        cid = id(cache)
        if cid not in self._watched:
            self._watched.add(cid)
            weakref.finalize(cache, self._forget, cid)
        self.graphs[(cid, span)] = g
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)

    def _forget(self, cid: int) -> None:
        self._watched.discard(cid)
        for key in [k for k in self.graphs if k[0] == cid]:
            del self.graphs[key]

    def __len__(self) -> int:
        return len(self.graphs)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inp: torch.Tensor  # [T] token ids, or [T, D] hidden state
    offsets: torch.Tensor  # [T] long: 0..T-1
    pos: torch.Tensor  # [T] long: start + offsets
    out: torch.Tensor


class StepGraphs:
    """Graphs of one step function on one device. `counts` (the model's expert selection counts) are restored
    after the warm-up runs that precede a capture."""

    def __init__(self, body: StepBody, device: torch.device, counts: torch.Tensor | None = None) -> None:
        self.body = body
        self.device = device
        self.counts = counts
        self.graphs: GraphTable[_Graph] = GraphTable()
        self.pool: tuple | None = None

    def step(self, inp: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """The step for the T = inp.shape[0] rows at positions start..start+T-1 (one graph per row count)."""
        t = int(inp.shape[0])
        span = min(cache.max_ctx, -(-(start + t) // SPAN_BUCKET) * SPAN_BUCKET)
        g = self.graphs.get(cache, (span, t))
        if g is None:
            g = self._capture(inp, cache, start, span)
            self.graphs.put(cache, (span, t), g)
        else:
            g.inp.copy_(inp.view(g.inp.shape), non_blocking=True)
            torch.add(g.offsets, start, out=g.pos)
        g.graph.replay()
        return g.out.clone()  # the next replay overwrites the graph's output

    def _capture(self, inp: torch.Tensor, cache: KVCache, start: int, span: int) -> _Graph:
        dev = self.device
        buf = inp.to(dev).clone()
        offsets = torch.arange(int(inp.shape[0]), dtype=torch.long, device=dev)
        pos = offsets + start
        # Warm-up runs compile the kernels; they repeat this step's own KV write, and the selection counts they
        # bump (which the expert cache's hit rates derive from) are put back.
        saved = self.counts.clone() if self.counts is not None else None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.body(buf, cache, pos, span)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.pool, side):
            out = self.body(buf, cache, pos, span)
        self.pool = graph.pool()
        if saved is not None and self.counts is not None:
            self.counts.copy_(saved)
        return _Graph(graph, buf, offsets, pos, out)


def capturable(model: "DecoderLM") -> bool:
    """Whether the model's decode step has no host synchronisation (every expert type has a fused kernel)."""
    from engine.layers.moe import fused_moe_available

    if model.expert_cache is None:
        return True
    c = model.cfg
    return all(
        fused_moe_available(le.gate.host.qtype, le.up.host.qtype, le.down.host.qtype, c.n_embd, c.n_ff_exp)
        for le in model.expert_cache.layers.values()
    )


class DecodeGraphs(StepGraphs):
    """The whole model's decode step: token id in, logits out."""

    def __init__(self, model: "DecoderLM") -> None:
        super().__init__(model.forward_at, model.device, None)
        self.model = model
        self.usable = capturable(model)
        if not self.usable:
            log.info("decode runs without CUDA graphs: some expert block types have no fused kernel")

    def step(self, inp: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        self.counts = self.model.expert_counts  # created after the graphs object
        return super().step(inp, cache, start)
