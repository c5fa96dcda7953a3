"""Decode steps captured in CUDA graphs: one graph per (KV cache, attention span bucket), replayed per token.

A captured step launches its few hundred kernels at once instead of one by one from Python, which is what bounds
batch-1 decode. Positions are device tensors and the span of cache positions a step attends to is rounded up to a
bucket, so one graph serves every position of its bucket. The same machinery serves a whole model (token in,
logits out) and a pipeline stage (hidden state in, hidden state or logits out)."""

import gc
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from engine.experts.backends import grouped_available
from engine.layers.kv_cache import KVCache
from engine.models.family_base import BatchPart, scratch_steps
from engine.models.fast_decode import fused_experts

if TYPE_CHECKING:
    from engine.experts.cpu_misses import CpuMisses
    from engine.models.decoder import DecoderLM

log = logging.getLogger("strata.engine")
SPAN_BUCKET = 256
MAX_GRAPHS = 48
G = TypeVar("G")

# body(inp, cache, pos, span) -> out: one step from a static input buffer, capturable
StepBody = Callable[[torch.Tensor, KVCache, torch.Tensor, int], torch.Tensor]


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: tuple | None, stream: torch.cuda.Stream) -> Iterator[None]:
    """A capture on `stream` (a stream of the stage's own card; torch's default capture stream belongs to the card
    current when it was first made) into `pool`. Not `torch.cuda.graph`: that empties the allocator's device and
    pinned-host caches at every capture, which made a prompt chunk's set of ~50 captures take ~8 s in a serving
    process. A holder keeps the last graph it captured into a pool (`keeper`) as long as it keeps the pool's
    handle: without torch's emptying, a pool whose graphs are all gone cannot be captured into again (torch
    asserts). Garbage collection stays off during the capture: a dead model in a reference cycle (an earlier load)
    would otherwise free its pinned host memory in the middle of it, a CUDA call that a capturing stream forbids.
    Other threads' calls do not break it (thread_local capture; the suite's pipelined-pieces test on one card,
    stage threads at work beside a capture, failed with cudaErrorStreamCaptureInvalidated under global mode)."""
    gc.disable()
    try:
        torch.cuda.synchronize(stream.device)
        with torch.cuda.stream(stream):
            # another thread's wait or allocation (a stage thread's hand-off) is no longer this capture's end
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()
    finally:
        gc.enable()


@contextmanager
def posts_of(cpu: "CpuMisses | None") -> Iterator[list[int]]:
    """The mailboxes a capture posts to (--cpu-experts), in order: the host answers those after each replay."""
    if cpu is None:
        yield []
        return
    with cpu.recording() as posts:
        yield posts


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
    posts: tuple[int, ...] = ()  # the CPU's mailboxes the step posts to (--cpu-experts), in order


class StepGraphs:
    """Graphs of one step function on one device. `counts` (the model's expert selection counts) are restored
    after the warm-up runs that precede a capture."""

    def __init__(
        self,
        body: StepBody,
        device: torch.device,
        counts: torch.Tensor | None = None,
        cpu: "CpuMisses | None" = None,
    ) -> None:
        self.body = body
        self.device = device
        self.counts = counts
        self.cpu = cpu  # --cpu-experts: the host computes its share of each replayed step's misses
        self.graphs: GraphTable[_Graph] = GraphTable()
        self.pool: tuple | None = None
        self.keeper: torch.cuda.CUDAGraph | None = None  # keeps the pool (capturing)

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
        out = g.out.clone()  # the next replay overwrites the graph's output
        if self.cpu is not None:
            self.cpu.serve_posts(g.posts)  # the host's share of the step's missed experts
        return out

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
        with posts_of(self.cpu) as posts, capturing(graph, self.pool, side):
            out = self.body(buf, cache, pos, span)
        self.pool, self.keeper = graph.pool(), graph
        if saved is not None and self.counts is not None:
            self.counts.copy_(saved)
        return _Graph(graph, buf, offsets, pos, out, tuple(posts))


def capturable(model: "DecoderLM") -> bool:
    """Whether the model's decode step has no host synchronisation: every expert type has a fused kernel (the
    CPU's share of misses, --cpu-experts, goes through mailboxes the device polls: no host sync either)."""
    return fused_experts(model)


def decode_graphs_usable(model: object) -> bool:
    """Whether the model is on a card and its decode steps replay CUDA graphs (the loader set `graphs.usable`)."""
    dev = getattr(model, "device", None)
    own = getattr(model, "graphs", None)
    return getattr(dev, "type", None) == "cuda" and own is not None and bool(getattr(own, "usable", False))


def cpu_misses(model: object) -> "CpuMisses | None":
    ec = getattr(model, "expert_cache", None)
    return getattr(ec, "cpu_misses", None)


class DecodeGraphs(StepGraphs):
    """The whole model's decode step: token id in, logits out."""

    def __init__(self, model: "DecoderLM") -> None:
        super().__init__(model.forward_at, model.device, None, cpu_misses(model))
        self.model = model
        self.usable = capturable(model)
        if not self.usable:
            log.info("decode runs without CUDA graphs: some expert block types have no fused kernel")

    def step(self, inp: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        self.counts = self.model.expert_counts  # created after the graphs object
        return super().step(inp, cache, start)

    def _capture(self, inp: torch.Tensor, cache: KVCache, start: int, span: int) -> _Graph:
        # Capturing runs the step three times (warm-up and capture); a recurrent state (Qwen3-Next's
        # RecurrentCache) must see it once, so the states are put back after the capture and the replay that
        # follows applies the step.
        snapshot = getattr(cache, "snapshot", None)
        saved = snapshot() if snapshot is not None else None
        g = super()._capture(inp, cache, start, span)
        if saved is not None:
            cache.restore_states(saved)  # type: ignore[attr-defined]
        return g


@dataclass
class _SlotGraph:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor  # [T] token ids
    pos: torch.Tensor  # [T] long: each row's position
    base: torch.Tensor  # [T] long: where each row's sequence starts in the shared cache
    out: torch.Tensor  # [T, V] logits
    posts: tuple[int, ...] = ()  # the CPU's mailboxes the step posts to (--cpu-experts), in order


class SlotGraphs:
    """Decode rows of several sequences whose caches are rows of one shared cache (KVCache.split): one graph per
    (span bucket, row count) serves every combination of slots, since the token ids, the positions and where each
    sequence's rows start are the graph's inputs (DecoderLM.decode_rows)."""

    def __init__(self, model: "DecoderLM") -> None:
        self.model = model
        self.cpu = cpu_misses(model)  # the host answers the steps' requests, as in StepGraphs
        self.graphs: GraphTable[_SlotGraph] = GraphTable()
        self.pool: tuple | None = None
        self.keeper: torch.cuda.CUDAGraph | None = None  # keeps the pool (capturing)

    def step(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        base: torch.Tensor,
        shared: KVCache,
        top: int,
        limit: int,
        head: bool = True,
    ) -> torch.Tensor:
        """tok, pos, base [T] (host) with every position below `top`, each sequence at most `limit` long ->
        logits [T, V] (hidden rows [T, D] with `head` False: DecoderLM.forward_rows)."""
        t = int(tok.shape[0])
        span = min(limit, -(-top // SPAN_BUCKET) * SPAN_BUCKET)
        g = self.graphs.get(shared, (span, t, head))
        if g is None:
            g = self._capture(tok, pos, base, shared, span, head)
            self.graphs.put(shared, (span, t, head), g)
        else:
            for dst, src in ((g.tok, tok), (g.pos, pos), (g.base, base)):
                dst.copy_(src, non_blocking=True)
        g.graph.replay()
        out = g.out.clone()
        if self.cpu is not None:
            self.cpu.serve_posts(g.posts)
        return out

    def _capture(
        self, tok: torch.Tensor, pos: torch.Tensor, base: torch.Tensor, shared: KVCache, span: int, head: bool
    ) -> _SlotGraph:
        m, dev = self.model, self.model.device
        bufs = [x.to(dev).clone() for x in (tok, pos, base)]
        counts = m.expert_counts
        saved = counts.clone() if counts is not None else None  # the warm-up runs' selections are put back
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile; they repeat this step's own KV writes
                m.forward_rows(bufs[0], shared, bufs[1], bufs[2], span, head)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with posts_of(self.cpu) as posts, capturing(graph, self.pool, side):
            out = m.forward_rows(bufs[0], shared, bufs[1], bufs[2], span, head)
        self.pool, self.keeper = graph.pool(), graph
        if saved is not None and counts is not None:
            counts.copy_(saved)
        return _SlotGraph(graph, *bufs, out, tuple(posts))


class HeadGraphs:
    """The output head of 1 .. `most` rows (hidden [T, D] -> logits [T, V]) as CUDA graphs, one per row count. A
    remote main runs its head after the worker's answer, on every step's critical path, where its eager launches
    (the norm, the head's GEMV or MMA for the row count) took ~0.3 ms of host time a step at 8 clients (sampled, one
    H100). The graphs share one pool and one output buffer, so that 16 of them hold one [16, V] float32 buffer
    (9.7 MB for Qwen3's vocabulary) rather than one a row count."""

    def __init__(self, model: "DecoderLM", most: int) -> None:
        self.model = model
        c, dev = model.cfg, model.device
        self.x = torch.zeros(most, c.n_embd, dtype=torch.float32, device=dev)
        self.out = torch.zeros(most, c.n_vocab, dtype=torch.float32, device=dev)
        self.sets: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: tuple | None = None
        self.keeper: torch.cuda.CUDAGraph | None = None  # keeps the pool (capturing)

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """The head of x's rows from the graph of their count (None: none captured for it; run it eagerly)."""
        t = int(x.shape[0])
        g = self.sets.get(t)
        if g is None:
            return None
        self.x[:t].copy_(x, non_blocking=True)
        g.replay()
        return self.out[:t].clone()  # the next replay overwrites the buffer

    def warm(self, most: int) -> int:
        """Capture the row counts 1 .. most (at most the buffers' rows) -> how many there are."""
        for t in range(1, min(most, self.x.shape[0]) + 1):
            if t not in self.sets:
                self.sets[t] = self._capture(t)
        return len(self.sets)

    def _capture(self, t: int) -> torch.cuda.CUDAGraph:
        m, dev = self.model, self.model.device
        x, out = self.x[:t], self.out[:t]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile the row count's kernels
                out.copy_(m.head(x))
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.pool, side):
            out.copy_(m.head(x))
        self.pool, self.keeper = graph.pool(), graph
        return graph


# Prompt chunks of 2-1,024 tokens run as the graphs of the smallest of these sizes that holds them, padded (a graph
# launches ~1,600 kernels that took longer to issue from Python than to run). Each size is at most 1.5x the one
# below: at most a third of a padded chunk's rows are pads.
PROMPT_BUCKETS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def warm_prompts(model: object, caches: Sequence[KVCache], most: int) -> list[int]:
    """Build the prompt path's Triton kernels before the first request, where no prompt graphs are captured at
    load (an expert cache that does not hold every expert; a remote stage): read dummy chunks of the sizes a step
    holds (PROMPT_BUCKETS up to `most` tokens and one token short of each, since Triton builds a kernel per tile
    height and per whether a length is a multiple of 16), alone and two in a step where there are two caches.
    The caches and the expert counts are left as they were. Without it the first requests of each new length
    waited for the builds (one H200, an expert cache at 5.3 GB: first tokens after 3.55, 1.27 and 1.14 s, then
    0.09 s). -> the sizes read ([] where nothing builds kernels: the CPU, or prompt graphs already warm)."""
    own = getattr(model, "warm_prompts", None)
    if own is not None:  # a layer split warms each of its stages (SplitModel.warm_prompts)
        return own(caches, most)
    device = getattr(model, "device", None)
    if (
        not caches
        or device is None
        or device.type != "cuda"
        or getattr(model, "prompt_graphs", None) is not None
    ):
        return []
    return read_prompt_sizes(model, [model], caches, most)


def read_prompt_sizes(
    model: object, models: Sequence[object], caches: Sequence[KVCache], most: int
) -> list[int]:
    """`warm_prompts`'s dummy chunks through `model.forward_batch` (`models`: whose expert counts to restore)."""
    sizes = sorted({s for b in PROMPT_BUCKETS if b <= most for s in (b - 1, b) if s > 1} | {min(most, 4096)})
    with scratch_steps(models, caches):
        for t in sizes:
            if t > caches[0].max_ctx:
                break
            model.forward_batch([BatchPart(torch.zeros(t, dtype=torch.long), caches[0], 0)])  # type: ignore[attr-defined]
            if len(caches) > 1 and 2 * t <= most:
                model.forward_batch(  # type: ignore[attr-defined]
                    [BatchPart(torch.zeros(t, dtype=torch.long), c, 0) for c in caches[:2]]
                )
    return sizes


def prompt_bucket(t: int) -> int | None:
    """The captured size a chunk of t tokens runs as; None: eagerly (one token, or more than the largest)."""
    if t < 2:
        return None
    return next((b for b in PROMPT_BUCKETS if b >= t), None)


@dataclass
class _PromptGraph:
    graphs: list[
        torch.cuda.CUDAGraph
    ]  # a layer's pieces: embed + attn_in(0), attn_out_ffn(i) + attn_in(i+1), ..
    tok: torch.Tensor  # [B] token ids (a stage without the token table: the hidden rows it is handed, [B, D])
    offsets: torch.Tensor  # [B] long: 0..B-1
    rows: torch.Tensor  # [B] long: the chunk's row each row copies (itself, or a pad's original)
    pos: torch.Tensor  # [B] long: start + rows
    real: torch.Tensor  # [1] long: the chunk's own rows (the others are pads), whose expert selections count
    last: torch.Tensor  # [1] long: the chunk's last row, whose logits come out
    h: torch.Tensor  # [B, D] float32: the residual stream between pieces
    q: torch.Tensor  # [B, H, Dk]
    k: torch.Tensor  # [B, Hkv, Dk]
    v: torch.Tensor  # [B, Hkv, Dv]
    a: torch.Tensor  # [B, H * Dv]: the attention's output, written between the pieces
    out: torch.Tensor  # [1, V]: the last row's logits (without the head: every row's hidden state, [B, D])


class PromptGraphs:
    """A prompt chunk's layers as CUDA graphs, with the attention between them run eagerly: a 512-token chunk of
    Qwen3-30B-A3B launches ~1,600 kernels, which took longer to issue from Python (~50 ms on an H200's host) than to
    run (~29 ms). The graphs hold everything but the attention (norms, projections, RoPE, router, grouped experts,
    residual adds), so they depend on the chunk's size only: not on the KV cache, its position or its span.

    A chunk of t tokens runs as the graphs of its bucket (prompt_bucket): the rows past t repeat the chunk's first
    rows (same tokens, same positions, and after each attention the same outputs), so they compute what real rows
    do and change nothing: the attention reads and writes the KV cache for the t real rows only, only those rows'
    expert selections are counted, and the logits are row t-1's. A server captures every bucket at load (`warm`),
    so that no request waits for a capture whatever its prompt's length; elsewhere a bucket is captured the second
    time it is seen (the first runs eagerly, which also builds its kernels). All buckets share one memory pool:
    their temporaries live only while a piece runs. Only chunks whose last row's logits are wanted (a prompt) take
    this path. A stage of a layer split has its own (LocalStage.run): one without the token table is handed hidden
    rows [T, D] in place of token ids, and one without the head hands every real row's hidden state on [T, D]
    (run eagerly, a split's prompts had cost its server more host time than the steps between them: on one H100,
    8 clients' prompts took 1.3 s of a split's generating thread's 3.7, 0.23 s of one stage's 2.6)."""

    def __init__(self, model: "DecoderLM", head: bool | None = None) -> None:
        """`head` False: hand every row's hidden state on though the model holds the head (a remote main's first
        stage, whose head runs after the chain)."""
        self.model = model
        self.head = model.has_head if head is None else head and model.has_head
        self.seen: set[int] = set()
        self.failed: set[int] = set()  # sizes whose capture ran out of VRAM: they stay eager
        self.sets: dict[int, _PromptGraph] = {}
        self.pool: tuple | None = None
        self.keeper: torch.cuda.CUDAGraph | None = None  # keeps the pool (capturing)
        self.stream = torch.cuda.Stream(model.device)

    @staticmethod
    def usable(model: "DecoderLM") -> bool:
        """Whether every piece can be captured: the experts (if any) all in VRAM with grouped kernels for their
        block types; prompt chunks of layers with experts in host memory stage them from the host first."""
        ec = model.expert_cache
        if model.cfg.is_moe and ec is None:
            return False
        if ec is None:
            return True
        c = model.cfg
        return all(
            le.host_tables is None
            and grouped_available(
                le.gate.host.qtype, le.up.host.qtype, le.down.host.qtype, c.n_embd, c.n_ff_exp
            )
            for le in ec.layers.values()
        )

    def warm(self, most: int, kv_type: str | None = None) -> list[int]:
        """Capture the buckets of chunks up to `most` tokens now (a server, at load) -> the sizes captured. With
        `kv_type`, also build the attention kernels that run between the pieces (attend_warm)."""
        done = []
        for b in PROMPT_BUCKETS:
            if b not in self.sets and b not in self.failed and self._add(b):
                done.append(b)
            if b >= most:
                break
        if kv_type is not None:
            self.attend_warm(min(most, PROMPT_BUCKETS[-1]), kv_type)
        return done

    def attend_warm(self, most: int, kv_type: str) -> None:
        """Run the eager attention of every layer once for each kernel a prompt chunk of up to `most` tokens can
        need, on a scratch cache: the flash kernel is built per tile height (16/32/64/128 rows) and per whether
        the chunk's length and its span are multiples of 16 (Triton specializes those), and a server's first
        prompt of a new kind otherwise waited ~0.7 s for that build."""
        m, c, dev = self.model, self.model.cfg, self.model.device
        sizes = sorted({t for hi in (16, 32, 64, 128) for t in (hi - 1, hi) if 8 < t <= most})
        if not sizes:
            return
        cache = m.new_cache(max(sizes) + 2, kv_type)
        dt = m.dtype
        for t in sizes:
            for start in (0, 1):
                pos = torch.arange(start, start + t, device=dev)
                q = torch.zeros(t, c.n_head, c.head_dim_k, dtype=dt, device=dev)
                k = torch.zeros(t, c.n_head_kv, c.head_dim_k, dtype=dt, device=dev)
                v = torch.zeros(t, c.n_head_kv, c.head_dim_v, dtype=dt, device=dev)
                masks = m.step_masks(pos, start + t)
                for i in m.layer_range:
                    m.attn_core(i, q, k, v, cache, pos, start + t, masks)
        torch.cuda.synchronize(dev)

    def step(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor | None:
        """The last row's logits [1, V] of tokens [T] (device) at positions start..start+T-1, or None where this
        chunk runs eagerly (a size outside the buckets, or a bucket seen for the first time). A stage without the
        token table takes hidden rows [T, D] as `tokens`; one without the head gives hidden rows [T, D]."""
        t = int(tokens.shape[0])
        b = prompt_bucket(t)
        if b is None or b in self.failed:
            return None
        g = self.sets.get(b)
        if g is None:
            if b not in self.seen:
                self.seen.add(b)
                return None
            if not self._add(b):
                return None
            g = self.sets[b]
        m = self.model
        torch.remainder(g.offsets, t, out=g.rows)
        if m.has_embed:
            torch.index_select(tokens.view(t), 0, g.rows, out=g.tok)
        else:
            torch.index_select(tokens.to(g.tok.dtype), 0, g.rows, out=g.tok)
        torch.add(g.rows, start, out=g.pos)
        g.real.fill_(t)
        g.last.fill_(t - 1)
        span = start + t
        masks = m.step_masks(g.pos[:t], span)
        for n, i in enumerate(m.layer_range):
            g.graphs[n].replay()
            a = m.attn_core(i, g.q[:t], g.k[:t], g.v[:t], cache, g.pos[:t], span, masks)
            torch.index_select(a, 0, g.rows, out=g.a)  # the pads' rows repeat their originals'
        g.graphs[-1].replay()
        return (g.out if self.head else g.out[:t]).clone()  # the next replay overwrites it

    def _add(self, b: int) -> bool:
        """Capture bucket b's set; False (and the size stays eager) where the card has no room for it."""
        try:
            self.sets[b] = self._capture(b)
            return True
        except torch.OutOfMemoryError as e:  # a full card: the chunk runs eagerly, as it did before
            self.failed.add(b)
            torch.cuda.empty_cache()
            log.warning("prompt chunks of %d tokens run without CUDA graphs (%s)", b, str(e).splitlines()[0])
            return False

    def _pieces(self, g: _PromptGraph) -> list[Callable[[], None]]:
        """The chunk's captured pieces, each writing its results into g's buffers."""
        m = self.model
        layers = list(m.layer_range)

        def into(i: int, h: torch.Tensor) -> None:
            hf, q, k, v = m.attn_in(i, h, g.pos)
            g.h.copy_(hf)
            g.q.copy_(q)
            g.k.copy_(k)
            g.v.copy_(v)

        def first() -> None:
            into(layers[0], m.embed(g.tok) if m.has_embed else g.tok)

        def between(prev: int, nxt: int) -> Callable[[], None]:
            return lambda: into(nxt, m.attn_out_ffn(prev, g.h, g.a))

        def last() -> None:
            h = m.attn_out_ffn(layers[-1], g.h, g.a)
            g.out.copy_(m.head(h.index_select(0, g.last), last_only=True) if self.head else h)

        return [first, *(between(a, b) for a, b in pairwise(layers)), last]

    def _capture(self, b: int) -> _PromptGraph:
        m, c, dev = self.model, self.model.cfg, self.model.device
        dt = m.dtype
        offsets = torch.arange(b, dtype=torch.long, device=dev)
        g = _PromptGraph(
            graphs=[],
            tok=(
                torch.zeros(b, dtype=torch.long, device=dev)
                if m.has_embed
                else torch.zeros(b, c.n_embd, dtype=torch.float32, device=dev)
            ),
            offsets=offsets,
            rows=offsets.clone(),
            pos=offsets.clone(),
            real=torch.full((1,), b, dtype=torch.long, device=dev),
            last=torch.full((1,), b - 1, dtype=torch.long, device=dev),
            h=torch.zeros(b, c.n_embd, dtype=torch.float32, device=dev),
            q=torch.zeros(b, c.n_head, c.head_dim_k, dtype=dt, device=dev),
            k=torch.zeros(b, c.n_head_kv, c.head_dim_k, dtype=dt, device=dev),
            v=torch.zeros(b, c.n_head_kv, c.head_dim_v, dtype=dt, device=dev),
            a=torch.zeros(b, c.n_head * c.head_dim_v, dtype=dt, device=dev),
            out=(
                torch.zeros(1, c.n_vocab, dtype=torch.float32, device=dev)
                if self.head
                else torch.zeros(b, c.n_embd, dtype=torch.float32, device=dev)
            ),
        )
        pieces = self._pieces(g)
        # A warm-up pass on the capture stream (cuBLAS sets up its workspace for a stream at first use); the
        # selection counts it bumps, which the expert cache's hit rates derive from, are put back.
        counts = m.expert_counts
        saved = counts.clone() if counts is not None else None
        m.counted_rows = g.real
        try:
            self.stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self.stream):
                for p in pieces:
                    p()
            torch.cuda.current_stream(dev).wait_stream(self.stream)
            for p in pieces:  # one pool for every piece of every size: a piece's temporaries die when it ends
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, self.pool, self.stream):
                    p()
                self.pool, self.keeper = graph.pool(), graph
                g.graphs.append(graph)
        finally:
            m.counted_rows = None
        if saved is not None and counts is not None:
            counts.copy_(saved)
        log.debug("prompt chunks of up to %d tokens: %d graphs captured", b, len(g.graphs))
        return g
