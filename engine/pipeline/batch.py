"""Several conversations at once: slots, and a scheduler that runs them through the model in shared steps.

Each slot is one sequence with its own KV cache (a slotted cache: `slots` caches of `max_ctx` positions). A request
is admitted to a free slot (the one whose cached tokens share the longest prefix with its prompt, so a follow-up
turn reads only its new tokens), and from then on every `step` is one forward of the model over all busy slots
(continuous batching): one row for each slot that decodes, and prompt chunks of the slots that read their prompts
within the step's token budget (chunked prefill), so a long prompt never holds the others' decode for more than
one step. A finished, failed or cancelled request leaves its slot at the end of the step it was seen in.

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
    reuse_prefix,
    sync_device,
    token_logprob,
)
from engine.pipeline.prompt_cache import PromptCache, common_prefix
from engine.pipeline.sampling import Sampler, sample_rows
from engine.tokenizer import Tokenizer

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
    t_prompt: float = 0.0
    t_decode: float = 0.0


class Slot:
    """One sequence's KV cache, the tokens it holds, and the request using it (None: free)."""

    def __init__(self, index: int, cache: KVCache) -> None:
        self.index = index
        self.cache = cache
        self.tokens: list[int] = []
        self.request: _Request | None = None
        self.generated = 0  # tokens of the current request (per-slot rate)


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
    ) -> None:
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
        # A slot reading its prompt alone reads spans of several chunks layer by layer where the model streams its
        # experts for prompt chunks (Runner's prefill_span): each layer's experts cross PCIe once a span.
        self.span = (
            prefill_span
            if prefill_span is not None
            and prefill_span > self.step_tokens
            and getattr(model, "layer_major", False)
            and getattr(model, "streams_experts", False)
            else None
        )
        many = getattr(
            model, "new_caches", None
        )  # a model's slots may share one cache (DecoderLM.new_caches)
        caches = (
            many(slots, max_ctx, kv_type)
            if many is not None
            else [model.new_cache(max_ctx, kv_type) for _ in range(slots)]  # type: ignore[attr-defined]
        )
        self.slots = [Slot(i, c) for i, c in enumerate(caches)]
        self.steps = 0
        self._order: list[
            Slot
        ] = []  # busy slots in admission order (prompt chunks go first come, first served)

    def warm(self) -> int:
        """Capture the decode steps of every row count the slots can take (compiling their kernels) before the
        first request, so that no request waits for a capture; -> the most rows warmed (0: nothing to warm)."""
        warm = getattr(self.model, "warm_rows", None)
        return warm([s.cache for s in self.slots]) if warm is not None else 0

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
        slot = max(free, key=lambda s: common_prefix(s.tokens, target) if req.cache_prompt else 0)
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
        slot.request, slot.generated = r, 0
        self._order.append(slot)
        return slot

    # ---- one step -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> BatchStep | None:
        """One forward over the busy slots; None when no slot had work (or the step failed: its requests were
        told through `fail`)."""
        for slot in list(self._order):
            if slot.request is not None and slot.request.cancelled():
                self._leave(slot)
        parts: list[BatchPart] = []
        plan: list[tuple[Slot, int]] = []  # (slot, prompt tokens read; 0: a decode row)
        for slot in self._order:
            r = slot.request
            if r is not None and r.token is not None:
                parts.append(BatchPart(torch.tensor([r.token]), slot.cache, len(slot.tokens)))
                plan.append((slot, 0))
        decode_rows = len(parts)
        budget = self.step_tokens - decode_rows
        for slot in self._order:
            r = slot.request
            if budget <= 0:
                break
            if r is None or r.token is not None or r.read >= len(r.prompt):
                continue
            n = min(len(r.prompt) - r.read, budget)
            parts.append(BatchPart(torch.tensor(r.prompt[r.read : r.read + n]), slot.cache, r.read))
            plan.append((slot, n))
            budget -= n
        if not parts:
            return None
        alone = len(plan) == 1 and plan[0][1] > 0 and self.span is not None
        if alone:  # one prompt and nothing else to run: a span of it, layer by layer
            slot, r = plan[0][0], plan[0][0].request
            assert r is not None and self.span is not None
            n = min(len(r.prompt) - r.read, self.span)
            parts, plan = (
                [BatchPart(torch.tensor(r.prompt[r.read : r.read + n]), slot.cache, r.read)],
                [(slot, n)],
            )
        t0 = time.perf_counter()
        try:
            if alone and parts[0].tokens.shape[0] > self.step_tokens:
                p = parts[0]
                logits = self.model.forward_span(p.tokens, p.cache, p.start, self.step_tokens)  # type: ignore[attr-defined]
            else:
                logits = self.model.forward_batch(parts)  # type: ignore[attr-defined]
            sync_device(self.model)
        except Exception as e:  # every request of the step fails; the slots are cleared, the runner goes on
            log.exception("a step of %d sequences failed", len(parts))
            for slot, _ in plan:
                if slot.request is not None:
                    slot.request.fail(e)
                    slot.tokens = []
                    slot.cache.truncate(0)
                    self._leave(slot)
            return None
        ms = (time.perf_counter() - t0) * 1e3
        # the decode rows' tokens together (one wait for the device), where their samplers allow
        rows_at = [j for j, (_, n) in enumerate(plan) if n == 0]
        pre = dict(
            zip(
                rows_at,
                sample_rows([plan[j][0].request.sampler for j in rows_at], logits[rows_at]),
                strict=True,
            )
        )  # type: ignore[union-attr]
        for j, (slot, n) in enumerate(plan):
            r = slot.request
            assert r is not None
            if n == 0:
                assert r.token is not None
                slot.tokens.append(r.token)
                got = pre[j]
                self._decided(slot, r.sampler.sample(logits[j], r.history) if got is None else got, logits[j])
                continue
            slot.tokens.extend(r.prompt[r.read : r.read + n])
            r.emit(PromptChunkEvent(r.read, n, ms))
            r.read += n
            if r.read == len(r.prompt):  # the prompt is read: its last row's logits give the first token
                now = time.perf_counter()
                r.timings.prompt_ms = (now - r.t_prompt) * 1e3
                r.t_decode = now
                self._decided(slot, r.sampler.sample(logits[j], r.history), logits[j])
        rows = sum(p.tokens.shape[0] for p in parts)
        st = BatchStep(self.steps, ms, rows, decode_rows, rows - decode_rows, self.busy)
        self.steps += 1
        return st

    def _decided(self, slot: Slot, token: int, row: torch.Tensor) -> None:
        """A token was sampled for slot's request: emit it, or end the request (end of generation, a stop string,
        its length)."""
        r = slot.request
        assert r is not None
        r.token = None
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
        t.decode_windows = max(0, len(r.out) - 1)
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
