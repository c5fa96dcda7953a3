"""Pipeline stages and the in-process layer split (seed 002).

A `SplitModel` chains stages, one per device, each a `DecoderLM` over its contiguous layer range (the first with
the token table, the last with the head); the hidden state crosses from one device to the next once per forward
through a `Handoff`. It offers what `Runner` drives - `forward(tokens, cache, start)`, `new_cache`, `device`,
`dtype` - so the generation loop does not know how many stages there are.

A prompt chunk of more than `pipe_chunk` tokens is read as a pipeline when the stages sit on different devices
(or when asked): it is cut into pieces, one thread per stage, and stage s reads piece c while stage s+1 reads
piece c-1. Every piece runs the same math at the same positions as a forward of that piece alone, so the logits
equal those of an unsplit model fed the same pieces.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.gguf.model_config import ModelConfig
from engine.layers.kv_cache import KVCache
from engine.models.decoder import BatchRows, DecoderLM
from engine.models.family_base import BatchPart, forward_each, scratch_steps
from engine.models.fast_decode import FAST_MAX_ROWS
from engine.models.gated_delta import RecurrentCache
from engine.pipeline.cuda_graphs import (
    PromptGraphs,
    StepGraphs,
    cpu_misses,
    decode_graphs_usable,
    read_prompt_sizes,
)
from engine.pipeline.handoff import Handoff, HandoffMode
from engine.pipeline.stage_clock import ForwardClock

log = logging.getLogger("strata.engine")

_POLL_S = 0.05  # how often a waiting stage thread looks whether another one failed


class Stage(Protocol):
    """One stage of the chain: layers `layers` on `device`. The first takes token ids [T], the others a hidden
    state [T, D] (float32) on their device; the last returns logits [T, V], the others a hidden state."""

    layers: range
    device: torch.device
    label: str

    def run(self, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor: ...


class LocalStage:
    """A `DecoderLM` over one layer range in this process. On CUDA a one-token step (decode) replays a CUDA graph
    of the stage when its model can be captured (the model's own `graphs.usable` says so)."""

    def __init__(
        self, model: DecoderLM, label: str, cuda_graphs: bool = True, head: bool | None = None
    ) -> None:
        self.model = model
        self.layers = model.layer_range
        self.device = model.device
        self.label = label
        # The head runs here unless a later stage runs it (after a remote chain, a `HeadStage` does).
        self.with_head = model.has_head if head is None else head and model.has_head
        # The prompt graphs of the stage's layers (None: its prompt chunks run eagerly) compute what this stage
        # hands on: a model holding the head that a HeadStage runs after a remote chain gets its own, without it
        pg = getattr(model, "prompt_graphs", None)
        self.prompt_graphs: PromptGraphs | None = (
            pg if pg is None or self.with_head == model.has_head else PromptGraphs(model, head=self.with_head)
        )
        self.graphs = (
            StepGraphs(self.body, model.device, model.expert_counts, cpu_misses(model))
            if cuda_graphs and decode_graphs_usable(model) and hasattr(model, "layer_at")
            else None
        )

    @property
    def first(self) -> bool:
        return self.model.has_embed

    @property
    def last(self) -> bool:
        return self.with_head

    takes_last_only = True  # run() takes last_only (SplitModel._run passes it for every stage of a prompt)

    def run(self, x: torch.Tensor, cache: KVCache, start: int, last_only: bool = False) -> torch.Tensor:
        """`last_only`: a prompt chunk, whose other rows' logits nobody reads: the stage with the head computes the
        last row's only, a stage without it hands every row on. Prompt chunks run from the stage's prompt graphs
        where it has them; a stage without the head also takes a piece of more than a verify window's rows as a
        prompt's (a worker is not told)."""
        # Triton launches on the current card, not on its tensors' card: a stage on another card than the main
        # one makes its own current while it runs
        with on_device(self.device):
            t = int(x.shape[0])
            pg = self.prompt_graphs
            if pg is not None and t > 1 and (last_only or (t > _WINDOW_ROWS and not self.with_head)):
                y = pg.step(x.to(self.device), cache, start)
                if y is not None:
                    return y
            if self.graphs is not None and t <= _WINDOW_ROWS:
                return self.graphs.step(x, cache, start)  # a decode step, or a verify window (--spec)
            m = self.model
            h = m.embed(x.to(self.device)) if m.has_embed else x  # [T, D]
            span = start + int(x.shape[0])
            pos = torch.arange(start, span, device=self.device)
            masks = m.step_masks(pos, span)  # once for the stage's layers
            for i in self.layers:
                h = m.layer_at(i, h, cache, pos, span, masks)
            return m.head(h, last_only) if self.with_head else h  # [T or 1, V] or [T, D]

    def run_batch(self, x: torch.Tensor, parts: Sequence[BatchPart]) -> torch.Tensor:
        """Several sequences' rows (token ids [R] for the first stage, else hidden [R, D]) through the stage's
        layers together -> hidden [R, D], or each part's wanted logit rows (BatchPart.logits) from the stage with
        the head."""
        if self.prompt_graphs is not None and all(
            p.tokens.shape[0] > 1 and (p.logits == 1 or not self.with_head) for p in parts
        ):
            # prompt chunks only: each from the prompt graphs (no eager pass over all of them together)
            cuts = list(itertools.accumulate((int(p.tokens.shape[0]) for p in parts), initial=0))
            return torch.cat(
                [
                    self.run(p.tokens if self.first else x[a:b], p.cache, p.start, last_only=True)
                    for p, a, b in zip(parts, cuts, cuts[1:], strict=False)
                ]
            )
        with on_device(self.device):
            m = self.model
            rows = BatchRows(parts, self.device, m.step_masks)
            h = m.embed(rows.tokens) if m.has_embed else x.to(self.device)
            h = m.layers_batch(h, parts, rows, self.layers)
            return m.head(h.index_select(0, rows.last)) if self.with_head else h

    @property
    def takes_rows(self) -> bool:
        """Whether decode rows of several slots sharing one cache run here through the fused decode path (with the
        model's head where this stage runs it; a remote main's first stage gives hidden rows, its head runs after
        the chain)."""
        return bool(getattr(self.model, "fast", False)) and self.device.type == "cuda"

    def run_rows(self, x: torch.Tensor, parts: Sequence[BatchPart]) -> torch.Tensor:
        """One decode row of each part (token ids [P] for the first stage, else hidden [P, D]), the parts' caches
        rows of one shared cache (SplitModel.new_caches) -> hidden [P, D], or logits [P, V] from the stage with
        the head: the fused decode path, from the stage's slot graphs where it has them."""
        with on_device(self.device):
            m = self.model
            shared = parts[0].cache.shared
            assert shared is not None
            pos = torch.tensor([p.start for p in parts])
            base = torch.tensor([p.cache.base for p in parts])
            top = max(p.start for p in parts) + 1
            if m.slot_graphs is not None:
                return m.slot_graphs.step(x, pos, base, shared, top, parts[0].cache.max_ctx, self.with_head)
            dev = self.device
            return m.forward_rows(x.to(dev), shared, pos.to(dev), base.to(dev), top, self.with_head)

    def body(self, x: torch.Tensor, cache: KVCache, pos: torch.Tensor, span: int) -> torch.Tensor:
        """The stage at device positions `pos` and a static span: the capturable form of `run`."""
        m = self.model
        h = m.embed(x) if m.has_embed else x  # [T, D]
        masks = m.step_masks(pos, span)
        for i in self.layers:
            h = m.layer_at(i, h, cache, pos, span, masks)
        return m.head(h) if self.with_head else h


# Verify windows (--spec) on a split's stages run as graphs of their row count, as one-token steps do: run eagerly,
# a window's few hundred launches went one by one (on one H200 --spec 4 on a 2-stage split decoded at half the
# speed of --spec 0; as graphs, at 2.05x it).
_WINDOW_ROWS = 8  # a verify window's most rows (--spec): their graphs are captured per row count


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The card `device` made current for the block (nothing for the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class StageTiming:
    """Host-side time of each stage in the last forward (ms); with CUDA it includes the wait for the hand-off."""

    ms: list[float] = field(default_factory=list)
    tokens: int = 0


class SplitModel:
    """Stages in order; the hand-off between stage s and s+1 is `handoffs[s]`."""

    def __init__(
        self,
        cfg: ModelConfig,
        stages: Sequence[Stage],
        handoff: HandoffMode = "auto",
        pipeline: bool | None = None,
        pipe_chunk: int = 512,
        timing_sink: Callable[[str], None] | None = None,
    ) -> None:
        if not stages:
            raise ValueError("a split needs at least one stage")
        covered = [i for s in stages for i in s.layers]
        if covered != list(range(cfg.n_layer)):
            raise ValueError(
                f"the stages cover layers {[(s.layers.start, s.layers.stop - 1) for s in stages]}, "
                f"not 0-{cfg.n_layer - 1} once each in order"
            )
        self.cfg = cfg
        self.stages = list(stages)
        self.handoffs = [Handoff(a.device, b.device, handoff) for a, b in itertools.pairwise(stages)]
        distinct = len({(s.device.type, s.device.index) for s in stages}) > 1
        # Pieces overlap only where the stages have devices of their own; on one device they would take turns.
        self.pipeline = distinct if pipeline is None else pipeline
        self.pipe_chunk = max(1, pipe_chunk)
        self.layer_range = range(cfg.n_layer)
        self.timing = StageTiming([0.0] * len(self.stages))
        # each local stage's compute, waiting and transfer in the last forward; measure=False: none (a baseline)
        self.clock: ForwardClock | None = None
        self.measure = True
        self.timing_sink = timing_sink
        # With a stage in another process: each slot's token ids at positions 0.., to rebuild what a worker that
        # restarted lost, and the link's session each slot's positions were last sent in
        self.remote = any(hasattr(s, "ensure") for s in self.stages)
        self.histories: dict[int, list[int]] = {}
        self._unheard: list[tuple[int, int, torch.Tensor]] = []  # (slot, start, ids on the card): _remember
        self._session = 0  # counts the new sessions of the remote stages (each one starts empty)
        self._sent_in: dict[int, int] = {}  # slot -> the session that holds its positions
        self._last_only = False  # the current forward's last_only (read by _run)
        self.replay_chunk = 512

    # ---- what Runner and the server read ----

    @property
    def device(self) -> torch.device:
        """Where the logits are (the last stage's device): the sampler and the step's sync look here."""
        return self.stages[-1].device

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self.stages]

    @property
    def dtype(self) -> torch.dtype:
        return self._models()[0].dtype if self._models() else torch.float32

    def _models(self) -> list[DecoderLM]:
        return [s.model for s in self.stages if isinstance(s, LocalStage)]

    def health(self) -> list[tuple[str, str]]:
        """(stage, status) for the stages in other processes: "ok", or "down: <why>" (the server's /health)."""
        return [(s.label, getattr(s, "status", "ok")) for s in self.stages if hasattr(s, "ensure")]

    def check_links(self) -> None:
        """Let each stage in another process notice, between requests, a worker that left (its status says so)."""
        for s in self.stages:
            check = getattr(s, "check", None)
            if check is not None:
                check()

    def close(self) -> None:
        for s in self.stages:
            close = getattr(s, "close", None)
            if close is not None:
                close()

    def local_models(self) -> list[DecoderLM]:
        """The models of the stages in this process (a remote stage's layers live in its worker)."""
        return self._models()

    @property
    def expert_counts(self) -> torch.Tensor | None:
        """[n_layer, n_expert] selections since load, summed over the stages (each counts its own layers)."""
        parts = [m.expert_counts.cpu() for m in self._models() if m.expert_counts is not None]
        if not parts:
            return None
        return torch.stack(parts).sum(0)

    def _rows_ready(self) -> bool:
        """Whether a step's decode rows take every local stage's fused path (a remote stage takes any rows)."""
        local = [st for st in self.stages if isinstance(st, LocalStage)]
        return bool(local) and all(st.takes_rows for st in local) and self._batches()

    def _batches(self) -> bool:
        """Whether several sequences' rows can cross every stage together: each local stage's model runs a
        step of several (the shared decoder), each other stage takes them (`run_parts`)."""
        return all(
            hasattr(st.model, "layers_batch") if isinstance(st, LocalStage) else hasattr(st, "run_parts")
            for st in self.stages
        )

    def new_caches(self, n: int, max_ctx: int, kv_type: str) -> list[KVCache]:
        """The caches of n sequences: where every stage runs the fused decode path, rows of one cache whose layers
        live on their stages' devices (KVCache.split), so that a step's decode rows cross each stage together.
        Each one's `slot` is its index (a remote stage keeps slot s's KV under s)."""
        caches = (
            self.new_cache(n * max_ctx, kv_type).split(n)
            if n > 1 and self._rows_ready()
            else [self.new_cache(max_ctx, kv_type) for _ in range(n)]
        )
        for s, c in enumerate(caches):
            c.slot = s
        return caches

    def warm_rows(self, caches: Sequence[KVCache], most: int | None = None) -> int:
        """Capture the stages' decode rows of 1 .. FAST_MAX_ROWS of these slots (DecoderLM.warm_rows for a split);
        -> the most rows warmed (0: none here). With a remote stage the steps cross to the worker too, at position
        0: it captures its own rows before its first step, so that happens while this server loads, not while the
        first request waits (a main whose stages do not take rows sends one step of every slot's row). `most` is
        not used here: a split's verify windows take the general layer."""
        remote = self.remote and bool(caches) and self._batches()
        local = bool(caches) and caches[0].shared is not None and self._rows_ready()
        if not remote and not local:
            return 0
        n = min(len(caches), FAST_MAX_ROWS)
        with scratch_steps(self._models(), caches):
            for t in range(1, n + 1) if local else [n]:
                self.forward_batch([BatchPart(torch.zeros(1, dtype=torch.long), c, 0) for c in caches[:t]])
        if remote:
            heads = max((st.warm_head(n) for st in self.stages if hasattr(st, "warm_head")), default=0)
            log.info("remote stage: steps of up to %d rows sent, the worker's decode rows are warm%s", n,
                     f"; the head's of 1-{heads} rows captured" if heads else "")  # fmt: skip
        return n if local else 0

    def warm_prompts(self, caches: Sequence[KVCache], most: int) -> list[int]:
        """cuda_graphs.warm_prompts through every stage (a remote worker's too, through the link: on one H200,
        eight requests' first round over a remote stage took 8 s where the next took 1.6) -> the sizes read ([]
        where no stage is on a GPU)."""
        if not caches or not self._builds_kernels() or self._prompts_graphed():
            return []
        return read_prompt_sizes(self, self._models(), caches, most)

    def _builds_kernels(self) -> bool:
        """Whether a stage here builds kernels as shapes first come (Triton, on a GPU)."""
        return any(isinstance(st, LocalStage) and st.device.type == "cuda" for st in self.stages)

    def new_cache(self, max_ctx: int, kv_type: str) -> KVCache:
        """One KV cache object whose layers live on their stages' devices. A family with recurrent states
        (qwen3next) gets its own cache class, merged from the stages' caches: each state stays on its stage's
        device (a remote stage keeps its layers' states in its own process)."""
        parts = [m.new_cache(max_ctx, kv_type) for m in self._models()]
        if parts and hasattr(parts[0], "merge"):
            for p in parts[1:]:
                parts[0].merge(p)  # type: ignore[attr-defined]
            return parts[0]
        c = self.cfg
        cache = KVCache(
            range(0), max_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, kv_type, self.stages[0].device
        )
        for part in parts:
            cache.layers.update(part.layers)
        return cache

    # ---- the forward ----

    def forward(
        self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [T] -> logits [T, V] on the last stage's device ([1, V], the last row's, with `last_only`: a
        prompt chunk); the cache then holds start+T positions."""
        t = int(tokens.shape[0])
        self._last_only = last_only
        self.clock = ForwardClock(self.devices) if self.measure else None  # a replay below counts in it
        self._resync([BatchPart(tokens, cache, start)])

        def step(x: torch.Tensor, at: int, last: bool) -> torch.Tensor:
            self._last_only = last
            if self.pipeline and len(self.stages) > 1 and int(x.shape[0]) > self.pipe_chunk:
                return self._pipelined(x, cache, at)
            return self._serial(x, cache, at)

        # qwen3next: the states' bookkeeping, as the model's own forward does
        if isinstance(cache, RecurrentCache):
            logits = cache.forward(tokens, start, step, last_only, self.replay_chunk)
        else:
            logits = step(tokens, start, last_only)
        cache.length = start + t
        self._remember([BatchPart(tokens, cache, start)])
        self.timing.tokens = t
        if self.timing_sink is not None:
            self.timing_sink(self._timing_line(t, start))
        return logits

    @property
    def pipelines_prompts(self) -> bool:
        """Whether a long prompt flows through the stages in pieces (stages on different devices or PCs)."""
        return bool(self.pipeline) and len(self.stages) > 1

    def forward_span(self, tokens: torch.Tensor, cache: KVCache, start: int, chunk: int) -> torch.Tensor:
        """A prompt span of several chunks as one pipelined forward -> the last row's logits [1, V]. The pipeline
        empties only at the span's end, where chunk by chunk it emptied at each chunk's: a chunk of n pieces costs
        n + 1 piece-times on two stages, a span of 4n costs 4n + 1. The pieces are `pipe_chunk` tokens either way
        (`chunk` is the single-model reader's argument, unused here)."""
        return self.forward(tokens, cache, start, last_only=True)

    def forward_batch(self, parts: Sequence[BatchPart]) -> torch.Tensor:
        """Several sequences in one step -> each part's wanted logit rows in order (its last row; a verify window's
        every row): the rows of all the parts go through each stage together and cross each hand-off as one
        tensor (a remote stage's as one message). A chain with recurrent state, or a family that runs one sequence
        at a time, runs a forward per part."""
        if not self._batches() or any(isinstance(p.cache, RecurrentCache) for p in parts):
            return forward_each(self, parts)
        self._resync(parts)
        # decode rows of slots that share one cache: the fused path of every stage, up to FAST_MAX_ROWS a pass
        rows = [j for j, p in enumerate(parts) if p.tokens.shape[0] == 1 and p.cache.shared is not None]
        rows = rows if self._rows_ready() else []
        out: list[torch.Tensor | None] = [None] * len(parts)
        for at in range(0, len(rows), FAST_MAX_ROWS):
            js = rows[at : at + FAST_MAX_ROWS]
            logits = self._through_stages([parts[j] for j in js], fused=True)
            for n, j in enumerate(js):
                out[j] = logits[n : n + 1]
        rest = [parts[j] for j, o in enumerate(out) if o is None]
        # a prompt chunk alone: forward (its pieces pipelined over the stages); prompt chunks of several slots each
        # from the stages' prompt graphs where every stage has them (as one model's forward_batch does), else
        # together through the eager layers
        each = len(rest) == 1 or (
            self._prompts_graphed() and all(p.tokens.shape[0] > 1 and p.logits == 1 for p in rest)
        )
        if each and rest:
            got = forward_each(self, rest)
        elif rest:
            got = self._through_stages(rest, fused=False)
        self._remember([parts[j] for j in rows] + ([] if each else rest))
        n = 0
        for j, o in enumerate(out):
            if o is None:
                out[j] = got[n : n + parts[j].logits]
                n += parts[j].logits
        return torch.cat(out)  # type: ignore[arg-type]

    def _prompts_graphed(self) -> bool:
        """Whether every stage is in this process and runs prompt chunks from its prompt graphs."""
        return all(isinstance(st, LocalStage) and st.prompt_graphs is not None for st in self.stages)

    def warm_prompt_graphs(self, most: int, kv_type: str) -> list[int]:
        """Capture each local stage's prompt graphs of chunks up to `most` tokens and build their attention
        kernels (PromptGraphs.warm), so that no request waits for a capture -> the sizes captured. Stages on
        different devices also read a long prompt in `pipe_chunk` pieces."""
        most = max(most, self.pipe_chunk) if self.pipelines_prompts else most
        sizes: set[int] = set()
        for st in self.stages:
            pg = st.prompt_graphs if isinstance(st, LocalStage) else None
            if pg is not None:
                with on_device(st.device):
                    sizes.update(pg.warm(most, kv_type))
        return sorted(sizes)

    @property
    def pipelines_groups(self) -> bool:
        """Whether `launch_batch` returns before the step is done: a stage in another process computes while
        this one goes on (BatchRunner's groups of slots)."""
        return self.remote and self._batches()

    def launch_batch(self, parts: Sequence[BatchPart]) -> Callable[[], torch.Tensor]:
        """`forward_batch` in two halves: the stages up to the first remote one run now and its message goes out;
        the returned call waits for the answer, runs the stages after it and gives each part's wanted logit rows.
        Between the two this process is free to run another group of slots (whose rows the worker then takes
        after these)."""
        return self.launch_local(parts)()

    def launch_local(self, parts: Sequence[BatchPart]) -> Callable[[], Callable[[], torch.Tensor]]:
        """`launch_batch` one call earlier: the stages up to the first remote one are queued on the device and
        this returns without waiting for them; the returned call takes their output to the host and sends it
        (-> launch_batch's `finish`). Between the two the host is free for other work while the card computes
        (BatchRunner queues a step's local layers before it hands its tokens to the server)."""
        r = next(i for i, st in enumerate(self.stages) if hasattr(st, "submit_parts"))
        self._resync(parts)
        fused = (
            len(parts) <= FAST_MAX_ROWS
            and self._rows_ready()
            and all(p.tokens.shape[0] == 1 and p.cache.shared is not None for p in parts)
        )
        x = torch.cat([p.tokens.to(self.stages[0].device, non_blocking=True) for p in parts])
        clock = self.clock = ForwardClock(self.devices) if self.measure else None
        for s in range(r):  # the last hand-off (to the host: it waits for the stages) is the send's
            x = self._stage_rows(s, x, parts, fused, handoff=s < r - 1)

        def send() -> Callable[[], torch.Tensor]:
            self.clock = clock
            y = self.handoffs[r - 1].send(x, clock.hop(r - 1) if clock is not None else None)  # to the host
            sent = self.stages[r].submit_parts(y, parts)  # type: ignore[attr-defined]
            self._heard()  # the card has nothing queued now (the hand-off waited for it): a read costs no wait

            def finish() -> torch.Tensor:
                self.clock = clock  # stage_report tells of this step (another group's may have run since)
                y = self.stages[r].collect(sent)  # type: ignore[attr-defined]
                if r < len(self.handoffs):
                    y = self.handoffs[r].send(y)
                for s in range(r + 1, len(self.stages)):
                    y = self._stage_rows(s, y, parts, fused)
                for p in parts:
                    p.cache.length = p.start + int(p.tokens.shape[0])
                self._remember(parts)
                return y

            return finish

        return send

    def _stage_rows(
        self, s: int, x: torch.Tensor, parts: Sequence[BatchPart], fused: bool, handoff: bool = True
    ) -> torch.Tensor:
        """Stage s on a step's rows of several sequences, then its hand-off (unless not `handoff`)."""
        t0 = time.perf_counter()
        st, clock = self.stages[s], self.clock
        begin = clock.begin(s) if clock is not None and isinstance(st, LocalStage) else None
        if isinstance(st, LocalStage):
            x = st.run_rows(x, parts) if fused else st.run_batch(x, parts)
        else:  # a remote stage (one message), or the head after it
            x = st.run_parts(x, parts)  # type: ignore[attr-defined]
        if clock is not None and begin is not None:
            clock.end(s, begin)
        if handoff and s < len(self.handoffs):
            x = self.handoffs[s].send(x, clock.hop(s) if clock is not None and begin is not None else None)
        self.timing.ms[s] = (time.perf_counter() - t0) * 1e3
        return x

    def _through_stages(self, parts: Sequence[BatchPart], fused: bool) -> torch.Tensor:
        """The parts' rows through each stage together, crossing each hand-off as one tensor -> each part's
        wanted logit rows. `fused`: one decode row a part, the slots' caches rows of one (run_rows)."""
        dev = self.stages[0].device  # type: ignore[union-attr]
        x = torch.cat([p.tokens.to(dev, non_blocking=True) for p in parts])  # some may be drawn on a device
        # each stage's own device time in the step (stage_report; the host's is only its launches on a card)
        self.clock = ForwardClock(self.devices) if self.measure else None
        for s in range(len(self.stages)):
            x = self._stage_rows(s, x, parts, fused)
        for p in parts:
            p.cache.length = p.start + int(p.tokens.shape[0])
        self.timing.tokens = int(x.shape[0])
        return x

    # ---- stages in other processes (engine/link) ----

    def _reconnect(self) -> bool:
        """Stages that keep their own state elsewhere (`ensure()`): connected, and True when one of them started a
        new session and so holds no positions."""
        lost = False
        for st in self.stages:
            ensure = getattr(st, "ensure", None)
            if ensure is not None:
                lost = bool(ensure()) or lost
        return lost

    def _resync(self, parts: Sequence[BatchPart]) -> None:
        """Before a step with a remote stage: connected, and each part's earlier positions held by the worker's
        session (a worker that restarted, or a new session, holds none: they are read again)."""
        if not self.remote:
            return
        if self._reconnect():
            self._session += 1
        for p in parts:
            if p.start > 0 and self._sent_in.get(p.cache.slot, 0) != self._session:
                self._replay(p.cache, p.start)
            self._sent_in[p.cache.slot] = self._session

    def _remember(self, parts: Sequence[BatchPart]) -> None:
        """Each part's token ids at their positions (what `_replay` reads again); only with a remote stage. Ids
        still on the card (drawn by the step before) are read later, in one read (`_heard`): `launch_local`'s send
        reads them once the card has nothing else queued. Read here, each part's read waited for the head and the
        draws just queued behind it."""
        if not self.remote:
            return
        self._unheard += [(p.cache.slot, p.start, p.tokens) for p in parts]
        if not any(p.tokens.is_cuda for p in parts) or len(self._unheard) > 256:  # steps that send none
            self._heard()

    def _heard(self) -> None:
        """The ids `_remember` left on the card into `histories`, in the order remembered (one read for them
        all)."""
        if not self._unheard:
            return
        held, self._unheard = self._unheard, []
        flat = [t.reshape(-1) for _, _, t in held]
        one = len({t.device for t in flat}) == 1
        ids = torch.cat(flat).tolist() if one else [v for t in flat for v in t.tolist()]
        at = 0
        for slot, start, t in held:
            n = int(t.numel())
            h = self.histories.setdefault(slot, [])
            del h[start:]
            h.extend(int(v) for v in ids[at : at + n])
            at += n

    def _replay(self, cache: KVCache, start: int) -> None:
        """A remote stage came back empty: read positions 0..start-1 of cache's sequence again (the local stages
        write the same KV)."""
        self._heard()
        history = self.histories.get(cache.slot, [])
        if len(history) < start:
            raise RuntimeError(
                f"a remote stage lost positions 0-{start - 1} and this process cannot read them again: retry the request"
            )
        log.info("remote stage reconnected: reading %d positions again", start)
        tokens = torch.tensor(history[:start])
        last_only = self._last_only
        self._last_only = True  # nobody reads the logits
        try:
            for o in range(0, start, self.replay_chunk):
                self._serial(tokens[o : o + self.replay_chunk], cache, o)
        finally:
            self._last_only = last_only

    def stage_report(self, clock: ForwardClock | None = None) -> list[dict[str, object]]:
        """Each stage's own time in the last forward (a prompt chunk or a step), for the timing lines and the
        server's event stream: local stages `{"layers", "where", "ms"}` (host time) plus, once their devices have
        finished the forward, `"compute_ms", "wait_ms", "transfer_ms"` (stage_clock); each worker behind a link
        `{"layers", "where", "compute_ms", "wait_ms", "transfer_ms"}`. `clock`: the device marks of an earlier
        forward (its `self.clock` then), for a step read after later ones were launched."""
        out: list[dict[str, object]] = []
        for s, (st, ms) in enumerate(zip(self.stages, self.timing.ms, strict=True)):
            if hasattr(st, "last_timing"):
                out.extend(_hops(st))
            elif len(st.layers):
                r: dict[str, object] = {
                    "layers": f"{st.layers.start}-{st.layers.stop - 1}",
                    "where": st.label,
                    "ms": ms,
                }
                marks = clock if clock is not None else self.clock
                split = marks.split(s) if marks is not None else None
                if split is not None:
                    r.update(
                        compute_ms=split.compute_ms, wait_ms=split.wait_ms, transfer_ms=split.transfer_ms
                    )
                out.append(r)
        return out

    def _timing_line(self, tokens: int, start: int) -> str:
        parts = []
        for r in self.stage_report():
            if "ms" in r:
                parts.append(f"layers {r['layers']} on {r['where']} {r['ms']:.1f} ms")
            else:
                parts.append(
                    f"layers {r['layers']} at {r['where']}: compute {r['compute_ms']:.1f} ms, waiting "
                    f"{r['wait_ms']:.1f} ms, transfer {r['transfer_ms']:.1f} ms"
                )
        kind = "step" if tokens == 1 else "prompt chunk"
        return f"remote timing: {kind} of {tokens} token(s) at {start}: " + "; ".join(parts)

    def _serial(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        x = tokens
        clock = self.clock
        for s in range(len(self.stages)):
            t0 = time.perf_counter()
            begin = clock.begin(s) if clock is not None else None
            x = self._run(s, x, cache, start)
            if clock is not None and begin is not None:
                clock.end(s, begin)
            if s < len(self.handoffs):
                x = self.handoffs[s].send(x, clock.hop(s) if clock is not None else None)
            self.timing.ms[s] = (time.perf_counter() - t0) * 1e3
        return x

    def _pipelined(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        n = len(self.stages)
        pieces = [
            (start + o, tokens[o : o + self.pipe_chunk])
            for o in range(0, int(tokens.shape[0]), self.pipe_chunk)
        ]
        # links[s] carries (piece index, hidden state) from stage s to stage s+1
        links: list[queue.Queue[tuple[int, torch.Tensor]]] = [queue.Queue(maxsize=2) for _ in range(n - 1)]
        outs: list[torch.Tensor | None] = [None] * len(pieces)
        errors: list[BaseException] = []
        failed = threading.Event()
        inference = torch.is_inference_mode_enabled()
        clock = self.clock

        def put(q: queue.Queue[tuple[int, torch.Tensor]], item: tuple[int, torch.Tensor]) -> bool:
            while not failed.is_set():
                try:
                    q.put(item, timeout=_POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        def get(
            q: queue.Queue[tuple[int, torch.Tensor]], timeout: float = _POLL_S
        ) -> tuple[int, torch.Tensor] | None:
            while True:
                try:
                    return q.get(timeout=timeout)
                except queue.Empty:
                    if failed.is_set() or timeout < _POLL_S:
                        return None

        def run(s: int) -> None:
            stage, busy = self.stages[s], 0.0
            t_start = time.perf_counter()
            try:
                with torch.inference_mode(inference):  # a mode of the calling thread only
                    pipe = getattr(stage, "pipe", None)
                    if pipe is not None and s > 0:
                        order = iter(range(len(pieces)))

                        def take(timeout: float) -> tuple[int, torch.Tensor] | None:
                            item = get(links[s - 1], timeout)
                            return None if item is None else (pieces[item[0]][0], item[1])

                        def give(y: torch.Tensor) -> bool:
                            c = next(order)
                            if s < n - 1:
                                return put(links[s], (c, self.handoffs[s].send(y)))
                            outs[c] = y
                            return True

                        pipe(take, give, len(pieces), failed.is_set, cache.slot)
                        busy = time.perf_counter() - t_start
                        return
                    for c, (pos, piece) in enumerate(pieces):
                        if s == 0:
                            x = piece
                        else:
                            item = get(links[s - 1])
                            if item is None:
                                return
                            x = item[1]
                        t0 = time.perf_counter()
                        begin = clock.begin(s) if clock is not None else None
                        y = self._run(s, x, cache, pos)
                        if clock is not None and begin is not None:
                            clock.end(s, begin)
                        if s < n - 1:
                            y = self.handoffs[s].send(y, clock.hop(s) if clock is not None else None)
                            busy += time.perf_counter() - t0
                            if not put(links[s], (c, y)):
                                return
                        else:
                            outs[c] = y
                            busy += time.perf_counter() - t0
            except BaseException as e:
                errors.append(e)
                failed.set()
            finally:
                self.timing.ms[s] = busy * 1e3

        threads = [
            threading.Thread(target=run, args=(s,), name=f"strata-stage-{s}", daemon=True)
            for s in range(1, n)
        ]
        for th in threads:
            th.start()
        run(0)
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        assert all(o is not None for o in outs)
        if self._last_only:
            last = outs[-1]
            assert last is not None
            return last[-1:]  # [1, V]
        return torch.cat([o for o in outs if o is not None])  # [T, V]

    def _run(self, s: int, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """Stage s on x; the last stage computes only the last row's logits where the forward asked for that."""
        stage = self.stages[s]
        if self._last_only and getattr(stage, "takes_last_only", False):
            return stage.run(x, cache, start, last_only=True)  # type: ignore[call-arg]
        if self._last_only and s == len(self.stages) - 1:
            return stage.run(x, cache, start)[-1:]
        return stage.run(x, cache, start)

    def describe(self) -> list[str]:
        """Per stage: `layers 0 to 21 on CPU: 5632 of 5632 routed experts in RAM (7.2 GiB)`. A stage with an
        expert cache (CUDA) logs its own line when the cache is filled."""
        return [line for s in self.stages if (line := _describe(s))]


def _describe(stage: Stage) -> str | None:
    if not isinstance(stage, LocalStage) or getattr(stage.model, "expert_cache", None) is not None:
        return None
    m = stage.model
    a, b = stage.layers.start, stage.layers.stop - 1
    where = "VRAM" if stage.device.type == "cuda" else "RAM"
    text = f"layers {a} to {b} on {stage.label}"
    experts = [lw.experts for lw in m.layers.values() if lw.experts is not None]
    if experts:
        n = len(experts) * m.cfg.n_expert
        nbytes = sum(e.gate.nbytes + e.up.nbytes + e.down.nbytes for e in experts)
        text += f": {n} of {n} routed experts in {where} ({nbytes / 1024**3:.1f} GiB)"
    extra = [w for w, on in (("the token table", m.has_embed), ("the head", m.has_head)) if on]
    if extra:
        text += ("; " if experts else ": ") + " and ".join(extra)
    return text


def _hops(stage: object) -> list[dict[str, object]]:
    """A remote stage's hops from its last reply: each worker's compute and waiting time, and the transfer time
    (the round trip less what the stages behind the link spent)."""
    out: list[dict[str, object]] = []
    before = float(getattr(stage, "last_rtt_ms", 0.0))
    for t in getattr(stage, "last_timing", []):

        def num(key: str, t: dict[str, object] = t) -> float:
            v = t.get(key, 0.0)
            return float(v) if isinstance(v, int | float) else 0.0

        out.append(
            {
                "layers": str(t.get("st")),
                "where": str(t.get("at")),
                "compute_ms": num("c"),
                "wait_ms": num("w"),
                "transfer_ms": max(before - num("x"), 0.0),
            }
        )
        before = num("r")
    return out
