"""Several conversations at once: slots, and a scheduler that runs them through the model in shared steps.

Each slot is one sequence with its own KV cache (a slotted cache: `slots` caches of `max_ctx` positions). A request
is admitted to a free slot (`choose_slot`: the one whose cached tokens share the longest prefix with its prompt, so
a follow-up turn reads only its new tokens; else an empty or the least recently used one), and from then on every
`step` is one forward of the model over all busy slots (continuous batching): one row for each slot that decodes,
and prompt chunks of the slots that read their prompts within the step's token budget (chunked prefill), so a long
prompt never holds the others' decode for more than one step. A finished, failed or cancelled request leaves its
slot at the end of the step it was seen in.

On a GPU the steps overlap the host's work (`overlap`): a step's plain rows draw their tokens on the device
(sampling.draw_rows), the next step reads them from there and is queued before the host reads the tokens back and
turns them into text and events, so the device does not wait for the host between steps. A request that ends on a
token the next step already read loses that row's work; a request whose next token is its last is not fed again.

With verify windows (`spec`, `--spec N`), a decoding slot whose request drafts (copies of its earlier context)
reads its token and the drafts as one part of the step; the model gives every row's logits, the drafts the target
agrees with are kept (engine/pipeline/spec.py's verify, the same rule as one request's windows) and the slot's KV is
cut back after them. Windows need each token on the host to draft from, so steps do not overlap then.

The events each request gets are the single-sequence Runner's (engine/pipeline/generate.py): prompt chunks, tokens
with their text (stop strings held back), the final text and the done event, in the same order, and greedy tokens
are the same as a request served alone (float activations; the tests compare them)."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.layers.kv_cache import KVCache
from engine.models.family_base import BatchPart
from engine.pipeline.cuda_graphs import warm_prompts
from engine.pipeline.drafts import Draft, DraftSource
from engine.pipeline.generate import (
    DoneEvent,
    Event,
    GenerationError,
    GenerationRequest,
    PromptChunkEvent,
    StopMatcher,
    TextEvent,
    Timings,
    TokenEvent,
    check_prompt,
    new_sampler,
    reads_spans,
    reuse_prefix,
    sync_device,
    token_logprob,
)
from engine.pipeline.prompt_cache import PromptCache, common_prefix
from engine.pipeline.sampling import Sampler, draw_rows, rows_on
from engine.pipeline.spec import SpecConfig, draft_sources, rollback, verify
from engine.tokenizer import Tokenizer
from installer.engine_options import runtime_switches

log = logging.getLogger("strata.engine")


@dataclass(frozen=True)
class BatchStep:
    """What one shared step did (the server's telemetry)."""

    index: int
    ms: float
    rows: int  # token rows the forward read
    decode_rows: int  # of those, one a decoding slot
    prompt_tokens: int  # of those, prompt tokens
    busy: int  # slots holding a request
    stages: list[dict[str, object]] | None = None  # a split's stage_report of this step (None: one stage)


@dataclass
class _Request:
    req: GenerationRequest
    emit: Callable[[Event], None]
    cancelled: Callable[[], bool]
    fail: Callable[[BaseException], None]
    prompt: list[int]
    max_new: int
    sampler: Sampler
    stops: StopMatcher
    decoder: object
    eog: set[int]
    timings: Timings
    history: list[int]
    read: int  # prompt tokens in the slot's KV
    out: list[int] = field(default_factory=list)
    token: int | None = None  # decided and emitted, to be read by the next step
    pending: "_Flight | None" = None  # a step that drew its next token on the device, not read yet
    pending_row: int = 0  # its row in that step
    t_prompt: float = 0.0
    t_decode: float = 0.0
    prompt_tok_s: float = 0.0  # the rate its last prompt step read at (0: none yet)
    drafts: DraftSource | None = None  # where its verify windows' drafts come from (--spec), None: no windows
    window: Draft | None = None  # the drafts read after its token in the step in flight
    windows: int = 0  # decode forwards (of a request that drafts)
    proposed: int = 0  # drafted tokens verified
    accepted: int = 0  # of those, kept


@dataclass
class _Pending:
    """A group's step sent to a stage in another process: `finish()` waits for it and gives its logits."""

    finish: Callable[[], torch.Tensor]
    parts: list[BatchPart]
    plan: list[tuple["Slot", _Request, int, int]]
    t0: float


@dataclass
class _Queued:
    """A step of decode rows whose local stages are queued on the device, not sent yet (`_step_remote`):
    `send()` takes their output to the worker and gives the call that finishes the step."""

    send: Callable[[], Callable[[], torch.Tensor]]
    parts: list[BatchPart]
    plan: list[tuple["Slot", _Request, int, int]]
    t0: float


@dataclass
class _Flight:
    """A launched step: its rows, their logits and the plain rows' draws (on the device, and their host copy)."""

    index: int
    plan: list[
        tuple["Slot", _Request, int, int]
    ]  # (slot, request, prompt tokens read, start; 0 tokens: decode)
    logits: torch.Tensor  # each plan row's wanted rows (one; a verify window's every row), in order
    offs: list[int]  # plan row -> its first row in logits
    draws: torch.Tensor | None  # [D] the drawn tokens where they were computed
    host: torch.Tensor | None  # [D] their copy for the host (pinned on a GPU), valid once the step is done
    drawn: dict[int, int]  # plan row -> its place in draws
    timer: tuple[torch.cuda.Event, torch.cuda.Event] | None  # the step's start and end on the device
    t0: float
    rows: int
    decode_rows: int
    busy: int
    clock: object = None  # a split's marks of this step (SplitModel.clock), read once the step is done

    @property
    def deferrable(self) -> bool:
        """Its tokens can wait for the next step: every row is a drawn decode row or a prompt chunk short of the
        prompt's end (a row sampled on the host is read at once, its tokens feed the next step)."""
        return all(
            j in self.drawn if n == 0 else at + n < len(r.prompt) for j, (_, r, n, at) in enumerate(self.plan)
        )


def _timer(model: object) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
    dev = getattr(model, "device", None)
    if not isinstance(dev, torch.device) or dev.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(dev))
    return start, end


# On a pipelined split, a prompt read alone takes a span of several chunks only where the span reads within this
# many seconds (a request that comes in meanwhile waits for it): a card's stages read 8,192 tokens in about that,
# two CPUs a chunk of 2,048 in ~20 s already.
SPAN_WAIT_S = 2.0


class Slot:
    """One sequence's KV cache, the tokens it holds, and the request using it (None: free)."""

    def __init__(self, index: int, cache: KVCache) -> None:
        self.index = index
        self.cache = cache
        self.tokens: list[int] = []
        self.request: _Request | None = None
        self.generated = 0  # tokens of the current request (per-slot rate)
        self.used = 0  # when it last took a request (the admission count): the least recently used gives way


def choose_slot(free: list[Slot], target: list[int], reuse: bool) -> Slot:
    """The free slot for a request whose prompt (less its last token) is `target`. A slot that holds at least half
    of that prompt as a prefix (the next turn, a regenerated answer, the same tools and history with a new
    question) is taken, the longest share first; otherwise an empty slot, then the least recently used one, so
    that a long prefix held in a slot outlives requests that share little or nothing with it."""
    shares = {s.index: common_prefix(s.tokens, target) if reuse else 0 for s in free}
    keeps = [s for s in free if shares[s.index] > 0 and 2 * shares[s.index] >= len(target)]
    if keeps:
        return max(keeps, key=lambda s: (shares[s.index], -s.used))
    empty = [s for s in free if not s.tokens]
    if empty:
        return empty[0]
    return min(free, key=lambda s: s.used)


class BatchRunner:
    """Runs up to `slots` sequences through `model` in shared steps (`step`), each admitted with `admit`. One thread
    drives it: admit and step from the same thread (the server's worker)."""

    def __init__(
        self,
        model: object,
        tokenizer: Tokenizer,
        max_ctx: int,
        kv_type: str,
        slots: int,
        step_tokens: int = 512,
        prompt_cache: PromptCache | None = None,
        prefill_span: int | None = None,
        overlap: bool | None = None,
        groups: int = 1,
        spec: SpecConfig | None = None,
    ) -> None:
        """`overlap`: read a step's tokens while the next one runs (default: on a GPU, where the device works
        apart from the host; off with verify windows). `groups`: with a stage in another process (the model's
        `pipelines_groups`), the slots take turns in that many groups, each group's step going out before the
        previous group's answer is read, so that this process and the worker compute at once (slot i is in
        group i % groups). `spec`: verify windows of up to `spec.n` drafts copied from each request's earlier
        context (the model's draft layer drafts for one request at a time: Runner)."""
        if slots < 1:
            raise ValueError(f"--parallel {slots}: give at least 1")
        if not hasattr(model, "forward_batch"):
            raise TypeError(f"{type(model).__name__} cannot run several sequences in one step")
        self.model = model
        self.tok = tokenizer
        self.max_ctx = max_ctx
        # Rows one step reads at most: every decoding slot's row, then prompt tokens up to this budget.
        self.step_tokens = max(slots, step_tokens)
        self.prompt_cache = prompt_cache
        # A slot reading its prompt alone reads spans of several chunks (Runner's prefill_span): layer by layer where
        # the model streams its experts for prompt chunks (each layer's experts cross PCIe once a span), and as one
        # pipeline on a split whose stages read pieces at once (it empties once a span). A request that comes in
        # meanwhile waits for the span, so on a split a span is taken only where it reads within `SPAN_WAIT_S` at
        # the rate the request's last chunk read (a card's stages, not a CPU's); with one slot a request that comes
        # in waits for the slot anyway, and spans start at once, as the Runner's do.
        self.span = (
            prefill_span
            if prefill_span is not None and prefill_span > self.step_tokens and reads_spans(model)
            else None
        )
        self._span_by_rate = bool(getattr(model, "pipelines_prompts", False)) and slots > 1
        many = getattr(
            model, "new_caches", None
        )  # a model's slots may share one cache (DecoderLM.new_caches)
        caches = (
            many(slots, max_ctx, kv_type)
            if many is not None
            else [model.new_cache(max_ctx, kv_type) for _ in range(slots)]  # type: ignore[attr-defined]
        )
        self.slots = [Slot(i, c) for i, c in enumerate(caches)]
        self._admitted = 0
        self.spec = spec if spec is not None and spec.n > 0 and spec.suffix else None
        if self.spec is not None:
            for c in caches:  # a cache with recurrent state keeps the states a window's rollback returns to
                if hasattr(c, "step_states"):
                    c.step_states = self.spec.n + 1  # type: ignore[attr-defined]
        dev = getattr(model, "device", None)
        on_gpu = isinstance(dev, torch.device) and dev.type == "cuda"
        if self.spec is not None:
            overlap = False  # a window drafts from its token, which must be on the host
        self.overlap = overlap if overlap is not None else on_gpu and runtime_switches().step_overlap
        self._flight: _Flight | None = None
        self.groups = max(1, min(groups, slots)) if getattr(model, "pipelines_groups", False) else 1
        self._pending: dict[int, _Pending] = {}  # group -> its step, sent, not read yet (groups > 1)
        self._queued: _Queued | None = None  # the next step's local stages, on the device (_step_remote)
        self._turn = 0  # the group whose step is read and launched next
        self.steps = 0
        self._order: list[
            Slot
        ] = []  # busy slots in admission order (prompt chunks go first come, first served)

    def warm(self) -> int:
        """Capture the decode steps of every row count the slots can take (compiling their kernels) before the
        first request, so that no request waits for a capture; -> the most rows warmed (0: nothing to warm)."""
        warm = getattr(self.model, "warm_rows", None)
        if warm is None:
            return 0
        caches = [s.cache for s in self.slots]
        # with verify windows a step holds up to a window's rows a slot
        return warm(caches, len(caches) * (self.spec.n + 1)) if self.spec is not None else warm(caches)

    def warm_prompts(self) -> list[int]:
        """Build the prompt path's kernels of every chunk size a step can hold before the first request, where
        the model has no prompt graphs to capture (cuda_graphs.warm_prompts) -> the sizes read."""
        return warm_prompts(self.model, [s.cache for s in self.slots], self.step_tokens)

    # ---- admission ------------------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return sum(1 for s in self.slots if s.request is None)

    @property
    def busy(self) -> int:
        return len(self.slots) - self.free

    def admit(
        self,
        req: GenerationRequest,
        emit: Callable[[Event], None],
        cancelled: Callable[[], bool] = lambda: False,
        fail: Callable[[BaseException], None] | None = None,
    ) -> Slot:
        """Give `req` a free slot; its events go to `emit` as the steps make them. Raises GenerationError for a
        request that cannot be served (nothing is admitted), RuntimeError when no slot is free."""
        prompt = list(req.prompt)
        check_prompt(prompt, self.max_ctx)
        free = [s for s in self.slots if s.request is None]
        if not free:
            raise RuntimeError("no free slot: admit when `free` says one is")
        target = prompt[:-1]
        slot = choose_slot(free, target, req.cache_prompt)
        self._admitted += 1
        slot.used = self._admitted
        slot.tokens = reuse_prefix(slot.cache, slot.tokens, prompt, req.cache_prompt, self.prompt_cache)
        sampler = new_sampler(req, self.tok)
        r = _Request(
            req=req,
            emit=emit,
            cancelled=cancelled,
            fail=fail or (lambda e: None),
            prompt=prompt,
            max_new=min(req.max_tokens, self.max_ctx - len(prompt)),
            sampler=sampler,
            stops=StopMatcher(req.stop),
            decoder=self.tok.stream_decoder(),
            eog=set() if req.ignore_eos else set(self.tok.eog_ids),
            timings=Timings(prompt_tokens=len(prompt), prompt_cached=len(slot.tokens)),
            history=list(prompt),
            read=len(slot.tokens),
            t_prompt=time.perf_counter(),
        )
        if self.spec is not None and sampler.constraint is None:  # drafts are checked unconstrained
            r.drafts = draft_sources(self.model, self.spec, sampler)
            if r.drafts is not None:
                r.drafts.reset(prompt)
        slot.request, slot.generated = r, 0
        self._order.append(slot)
        return slot

    # ---- one step -------------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """A step was launched whose tokens the host has not read yet (`overlap`): the next `step` reads them."""
        return self._flight is not None or bool(self._pending) or self._queued is not None

    @torch.inference_mode()
    def step(self) -> list[BatchStep]:
        """Launch one forward over the busy slots and read the tokens of the steps that are done: with `overlap`,
        a step of decode rows is read while the next one runs (its tokens feed the next step on the device), so
        the host's work on each token (its text, stop strings, the events) hides behind the device's. -> the
        steps read in this call ([] when no slot had work, or a step failed: its requests were told through
        `fail`). With groups, each call reads one group's step and sends its next one."""
        sent = {slot for p in self._pending.values() for slot, _, _, _ in p.plan}
        if self._queued is not None:  # its rows' KV is written here and goes to the worker in this call
            sent |= {slot for slot, _, _, _ in self._queued.plan}
        for slot in list(self._order):  # a slot whose step is out leaves once that step is read
            if slot.request is not None and slot.request.cancelled() and slot not in sent:
                self._leave(slot)
        if self.groups > 1:
            return self._step_group()
        prev, self._flight = self._flight, None
        if self._queued is not None:
            return self._step_remote(prev, self._queued)
        parts, plan = self._plan()
        if parts and self._sends_first(parts):
            q = self._queue(parts, plan)
            if q is not None:
                return self._step_remote(prev, q)
            return self._read(prev) if prev is not None else []
        done: list[BatchStep] = []
        flight = self._launch(parts, plan) if parts else None
        if prev is not None:
            done += self._read(prev)
        if flight is not None:
            if self.overlap and flight.deferrable:
                self._flight = flight
            else:
                done += self._read(flight)
        return done

    def _sends_first(self, parts: list[BatchPart]) -> bool:
        """Whether `_step_remote` takes this step: one group with a stage in another process, `overlap`, and decode
        rows only (prompt chunks keep forward_batch's pieces pipelined over the link)."""
        return (
            self.overlap
            and bool(getattr(self.model, "pipelines_groups", False))
            and all(p.tokens.shape[0] == 1 and p.logits == 1 for p in parts)
        )

    def _queue(self, parts: list[BatchPart], plan: list[tuple[Slot, _Request, int, int]]) -> "_Queued | None":
        """The step's local stages queued on the device (launch_local) -> the step to send, or None where that
        failed (its requests are told)."""
        t0 = time.perf_counter()
        try:
            send = self.model.launch_local(parts)  # type: ignore[attr-defined]
        except Exception as e:
            log.exception("a step of %d sequences failed", len(plan))
            self._fail([(s, r) for s, r, _, _ in plan], e)
            return None
        return _Queued(send, parts, plan, t0)

    def _step_remote(self, prev: "_Flight | None", q: _Queued) -> list[BatchStep]:
        """A step of decode rows through a stage in another process, with `overlap`: its local stages were queued
        on the device (by the call before, or just now), it goes out, the previous step's tokens are read while
        the worker computes it, then its answer is taken and the rest of the step queued, its own tokens read by
        the next call. Before returning, the next step's local stages are queued behind it (its rows are this
        step's draws, still on the device), so that the card computes them while the caller hands the tokens out;
        each call then waits for the device only for the worker. The host's work on each token hides behind the
        worker's compute, where `forward_batch` waited for the answer first. The step is whole before this
        returns, so a slot its read frees is in no step still out."""
        self._queued = None
        done: list[BatchStep] = []
        finish = self._send(q.send, q.plan)
        if finish is None:
            return self._read(prev) if prev is not None else done
        if prev is not None:
            done += self._read(prev)
        logits = self._take(finish, q.plan)
        if logits is None:
            return done
        f = self._launch(q.parts, q.plan, logits, q.t0)
        if f is None:
            return done
        if not f.deferrable:
            return done + self._read(f)
        self._flight = f
        parts, plan = self._plan()
        # a request cancelled meanwhile leaves at the next call (a queued step would keep its slot)
        if parts and self._sends_first(parts) and not any(r.cancelled() for _, r, _, _ in plan):
            self._queued = self._queue(parts, plan)
        return done

    def _send(
        self, send: Callable[[], Callable[[], torch.Tensor]], plan: list[tuple[Slot, _Request, int, int]]
    ) -> Callable[[], torch.Tensor] | None:
        """A queued step's message out (`send`) -> the call that finishes it, or None where it failed (its requests
        are told)."""
        try:
            return send()
        except Exception as e:
            log.exception("a step of %d sequences failed", len(plan))
            self._fail([(s, r) for s, r, _, _ in plan], e)
            return None

    def _take(
        self, finish: Callable[[], torch.Tensor], plan: list[tuple[Slot, _Request, int, int]]
    ) -> torch.Tensor | None:
        """launch_batch's second half (the worker's answer, the stages after it) -> the step's logits, or None where
        it failed (its requests are told)."""
        try:
            return finish()
        except Exception as e:
            log.exception("a step of %d sequences failed", len(plan))
            self._fail([(s, r) for s, r, _, _ in plan], e)
            return None

    def _step_group(self) -> list[BatchStep]:
        """Read the turn's group's step (waiting for the worker's answer), then send that group's next step."""
        g, done = self._turn, []
        self._turn = (g + 1) % self.groups
        pend = self._pending.pop(g, None)
        if pend is not None:
            logits = self._take(pend.finish, pend.plan)
            if logits is not None:
                f = self._launch(pend.parts, pend.plan, logits, pend.t0)
                if f is not None:
                    done += self._read(f)
        parts, plan = self._plan(g)
        if parts:
            t0 = time.perf_counter()
            finish = self._send(lambda: self.model.launch_batch(parts), plan)  # type: ignore[attr-defined]
            if finish is not None:
                self._pending[g] = _Pending(finish, parts, plan, t0)
        return done

    def _plan(
        self, group: int | None = None
    ) -> tuple[list[BatchPart], list[tuple[Slot, _Request, int, int]]]:
        """This step's rows (of the slots of `group` only, with groups): (slot, request, prompt tokens read, where
        they start; 0 tokens: a decode row)."""
        parts: list[BatchPart] = []
        plan: list[tuple[Slot, _Request, int, int]] = []
        mine = self._order if group is None else [s for s in self._order if s.index % self.groups == group]
        for slot in mine:
            r = slot.request
            if r is None:
                continue
            if r.token is not None:
                tokens = [r.token, *self._draft(slot, r)]
                parts.append(
                    BatchPart(torch.tensor(tokens), slot.cache, len(slot.tokens), logits=len(tokens))
                )
            elif r.pending is not None and len(r.out) + 1 < r.max_new:
                # its token is still on the device, in the step that drew it (a request's last token is read
                # back but not fed again)
                at = r.pending.drawn[r.pending_row]
                parts.append(BatchPart(r.pending.draws[at : at + 1], slot.cache, len(slot.tokens)))
            else:
                continue
            plan.append((slot, r, 0, len(slot.tokens)))
        budget = self.step_tokens - sum(int(p.tokens.shape[0]) for p in parts)
        for slot in mine:
            r = slot.request
            if budget <= 0:
                break
            if r is None or r.token is not None or r.pending is not None or r.read >= len(r.prompt):
                continue
            n = min(len(r.prompt) - r.read, budget)
            parts.append(BatchPart(torch.tensor(r.prompt[r.read : r.read + n]), slot.cache, r.read))
            plan.append((slot, r, n, r.read))
            budget -= n
        if len(plan) == 1 and plan[0][2] > 0 and self.span is not None:
            # one prompt and nothing else to run: a span of it (layer by layer, or one pipeline)
            slot, r, n, at = plan[0]
            span = self.span
            if self._span_by_rate:
                span = min(span, max(n, int(r.prompt_tok_s * SPAN_WAIT_S)))
            n = min(len(r.prompt) - at, span)
            parts, plan = [BatchPart(torch.tensor(r.prompt[at : at + n]), slot.cache, at)], [(slot, r, n, at)]
        return parts, plan

    def _draft(self, slot: Slot, r: _Request) -> list[int]:
        """The drafts to read after r's token in this step (its verify window), as many as the request and the
        context leave room for; [] when it does not draft or nothing earlier matches."""
        r.window = None
        if r.drafts is None or self.spec is None:
            return []
        k = min(self.spec.n, r.max_new - len(r.out), self.max_ctx - len(slot.tokens) - 1)
        draft = r.drafts.propose([r.token], k) if k > 0 else None  # type: ignore[list-item]
        if draft is None or not draft.tokens:
            return []
        r.window = draft
        return list(draft.tokens)

    def _launch(
        self,
        parts: list[BatchPart],
        plan: list[tuple[Slot, _Request, int, int]],
        logits: torch.Tensor | None = None,
        t0: float | None = None,
    ) -> "_Flight | None":
        """Queue the step on the device, and its plain rows' draws with it; the slots' bookkeeping moves on (what
        each slot's KV will hold), the events wait for `_read`. `logits`: the step ran already (a group's)."""
        t0 = time.perf_counter() if t0 is None else t0
        timer = _timer(self.model) if logits is None else None
        try:
            if logits is None and len(parts) == 1 and parts[0].tokens.shape[0] > self.step_tokens:
                p = parts[0]
                logits = self.model.forward_span(p.tokens, p.cache, p.start, self.step_tokens)  # type: ignore[attr-defined]
            elif logits is None:
                logits = self.model.forward_batch(parts)  # type: ignore[attr-defined]
            for _, r, n, at in plan:  # grammars compute their next masks while the device runs the step
                if n == 0 or at + n == len(r.prompt):
                    r.sampler.prepare(logits.device)
            offs = [0]
            for p in parts[:-1]:
                offs.append(offs[-1] + p.logits)
            rows = [
                j for j, (_, r, n, _) in enumerate(plan) if n == 0 and r.sampler.plain and r.window is None
            ]
            draws = None
            if rows:  # decode rows come first: usually a slice, never a list index (that waits for the step)
                at = [offs[j] for j in rows]
                sub = (
                    logits[: len(rows)]
                    if at[-1] == len(rows) - 1
                    else logits.index_select(0, rows_on(at, logits.device))
                )
                draws = draw_rows([plan[j][1].sampler for j in rows], sub)
        except Exception as e:  # every request of the step fails; the slots are cleared, the runner goes on
            log.exception("a step of %d sequences failed", len(parts))
            self._fail([(s, r) for s, r, _, _ in plan], e)
            return None
        host = None
        if draws is not None:
            host = torch.empty(draws.shape, dtype=draws.dtype, pin_memory=draws.is_cuda)
            host.copy_(draws, non_blocking=True)
        if timer is not None:
            timer[1].record(torch.cuda.current_stream(logits.device))
        n_rows = sum(p.tokens.shape[0] for p in parts)
        decode = sum(1 for _, _, n, _ in plan if n == 0)
        f = _Flight(self.steps, plan, logits, offs, draws, host, {j: i for i, j in enumerate(rows)}, timer, t0,
                    n_rows, decode, self.busy, getattr(self.model, "clock", None))  # fmt: skip
        self.steps += 1
        for j, (slot, r, n, at) in enumerate(plan):
            if n == 0:
                if r.token is not None:  # read on the host: in the slot's tokens from now on
                    slot.tokens.append(r.token)
                    if r.drafts is not None and r.window is None:  # a window's token is committed verified
                        r.drafts.commit([r.token])
                    r.token = None
                if r.window is not None:  # the KV holds the drafts too, until the window is verified
                    slot.tokens.extend(r.window.tokens)
                if j in f.drawn:
                    r.pending, r.pending_row = f, j
            else:
                slot.tokens.extend(r.prompt[at : at + n])
                r.read = at + n
        return f

    def _read(self, f: "_Flight") -> list[BatchStep]:
        """Wait for step `f` and give its requests their tokens and events, in the order the steps ran."""
        try:
            if f.timer is not None:
                f.timer[1].synchronize()
            else:
                sync_device(self.model)
            drawn = f.host.tolist() if f.host is not None else []
            ms = (time.perf_counter() - f.t0) * 1e3
            if f.timer is not None and f.logits.device == self.model.device:  # type: ignore[attr-defined]
                ms = f.timer[0].elapsed_time(
                    f.timer[1]
                )  # the device's own time (the host may have been away)
        except Exception as e:
            log.exception("a step of %d sequences failed", len(f.plan))
            self._fail([(s, r) for s, r, _, _ in f.plan], e)
            return []
        for j, (slot, r, n, at) in enumerate(f.plan):
            if slot.request is not r:  # it left (cancelled, failed, or ended on an earlier token)
                continue
            row = f.offs[j]
            if n == 0:
                if r.drafts is not None:
                    r.windows += 1
                if r.window is not None:
                    self._verify(slot, r, at, f.logits[row : row + len(r.window.tokens) + 1])
                    continue
                later = r.pending is not None and r.pending is not f  # a later step already read its token
                if r.pending is f:
                    r.pending = None
                i = f.drawn.get(j)
                token = drawn[i] if i is not None else r.sampler.sample(f.logits[row], r.history)
                self._decided(slot, token, f.logits[row], fed=later)
                continue
            r.emit(PromptChunkEvent(at, n, ms))
            r.prompt_tok_s = n / max(ms, 1e-3) * 1e3
            if at + n == len(r.prompt):  # the prompt is read: its last row's logits give the first token
                now = time.perf_counter()
                r.timings.prompt_ms = (now - r.t_prompt) * 1e3
                r.t_decode = now
                self._decided(slot, r.sampler.sample(f.logits[row], r.history), f.logits[row], fed=False)
        report = getattr(self.model, "stage_report", None)
        stages = report(f.clock) if report is not None else None
        return [BatchStep(f.index, ms, f.rows, f.decode_rows, f.rows - f.decode_rows, f.busy, stages)]

    def _verify(self, slot: Slot, r: _Request, at: int, rows: torch.Tensor) -> None:
        """r's verify window, read at position `at` (its token, then its drafts): keep the drafts the target agrees
        with, cut the slot's KV back after them, and decide each kept token and the next one in order."""
        draft, r.window = r.window, None
        assert draft is not None and r.drafts is not None
        v = verify(rows, draft, r.sampler, r.history)  # r.history ends with the window's token
        kept = list(draft.tokens[: v.accepted])
        del slot.tokens[at + 1 :]  # the kept drafts come back in as they are decided (fed)
        rollback(self.model, slot.cache, at + 1 + len(kept))
        r.drafts.commit([slot.tokens[at], *kept])
        r.proposed += len(draft.tokens)
        r.accepted += len(kept)
        for j, token in enumerate([*kept, v.token]):
            self._decided(slot, token, rows[j], fed=j < len(kept))
            if slot.request is not r:  # it ended on this token: the KV keeps what the slot's tokens say
                if slot.cache.length > len(slot.tokens):
                    rollback(self.model, slot.cache, len(slot.tokens))
                return

    def _fail(self, rows: list[tuple[Slot, _Request]], e: BaseException) -> None:
        for slot, r in rows:
            if slot.request is r:
                r.fail(e)
                slot.tokens = []
                slot.cache.truncate(0)
                self._leave(slot)

    def _decided(self, slot: Slot, token: int, row: torch.Tensor, fed: bool) -> None:
        """A token was sampled for slot's request: emit it, or end the request (end of generation, a stop string,
        its length). `fed`: a later step already read it (it is then in the slot's KV)."""
        r = slot.request
        assert r is not None
        if token in r.eog:
            self._done(slot, "stop", stopped_by_string=False)
            return
        r.out.append(token)
        r.history.append(token)
        slot.generated += 1
        text, hit = r.stops.feed(r.decoder.push(token))  # type: ignore[attr-defined]
        lp = token_logprob(row, token, r.req.logprobs) if r.req.logprobs is not None else None
        r.emit(TokenEvent(token, text, lp))
        if hit:
            self._done(slot, "stop", stopped_by_string=True)
        elif r.sampler.finished:  # the grammar is complete
            self._done(slot, "stop", stopped_by_string=False)
        elif len(r.out) >= r.max_new:
            self._done(slot, "length", stopped_by_string=False)
        elif fed:
            slot.tokens.append(token)
        else:
            r.token = token  # read by the next step

    def _done(self, slot: Slot, finish: str, stopped_by_string: bool) -> None:
        r = slot.request
        assert r is not None
        if not stopped_by_string:
            tail, hit = r.stops.feed(r.decoder.flush())  # type: ignore[attr-defined]
            tail += "" if hit else r.stops.flush()
            if tail:
                r.emit(TextEvent(tail))
        t = r.timings
        t.generated_tokens = len(r.out)
        t.generated_ms = (time.perf_counter() - r.t_decode) * 1e3 if r.t_decode else 0.0
        t.decode_windows = r.windows if r.drafts is not None else max(0, len(r.out) - 1)
        t.drafts_proposed, t.drafts_accepted = r.proposed, r.accepted
        r.emit(DoneEvent(finish, t, list(r.out)))
        self._leave(slot)

    def _leave(self, slot: Slot) -> None:
        slot.request = None
        if slot in self._order:
            self._order.remove(slot)

    # ---- what it says about itself --------------------------------------------------------------------------

    def slot_report(self) -> list[dict[str, object]]:
        """Per slot: idle, prompt (reading its prompt) or decode; the tokens its KV holds; the request's rate."""
        out = []
        now = time.perf_counter()
        for s in self.slots:
            r = s.request
            state = "idle" if r is None else ("prompt" if r.read < len(r.prompt) else "decode")
            rate = (
                s.generated / (now - r.t_decode) if r is not None and r.t_decode and now > r.t_decode else 0.0
            )
            out.append({"index": s.index, "state": state, "tokens": len(s.tokens), "tokens_per_second": rate})
        return out


__all__ = ["BatchRunner", "BatchStep", "GenerationError", "Slot"]
