"""The one generation stream: a generator of typed events that the server, the CLI and the worker all consume."""

import inspect
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from engine.layers.kv_cache import KVCache
from engine.pipeline.constrain import Constraint
from engine.pipeline.mtp import draft_layer_of
from engine.pipeline.prompt_cache import PromptCache, common_prefix
from engine.pipeline.sampling import Sampler, SamplingParams
from engine.pipeline.spec import (
    DraftSource,
    SpecConfig,
    SpecError,
    WindowDecoder,
    draft_sources,
    pipeline_for,
    rollback,
    window_graphs_for,
)
from engine.tokenizer import Tokenizer

log = logging.getLogger("strata.engine")


class GenerationError(ValueError):
    """A request that cannot be served as asked (too long for the context, nothing to read)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (the log-softmax of its raw logits, before any sampling filter)
    and the `top` most likely tokens of that row with theirs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logits [V] of the row that decided `token` -> its TokenLogprob with the `top` most likely."""
    lp = torch.log_softmax(row.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        vals, ids = torch.topk(lp, min(top, lp.shape[-1]))
        best = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(float(lp[token]), best)


@dataclass(frozen=True)
class TokenEvent:
    token: int
    text: str  # the text this token completes (may be empty: part of a UTF-8 character or of a possible stop string)
    logprob: TokenLogprob | None = None  # where the request asked for them (GenerationRequest.logprobs)


@dataclass(frozen=True)
class TextEvent:
    text: str  # text released at the end (held back for a possible stop string, or an unfinished character)


@dataclass(frozen=True)
class PromptChunkEvent:
    start: int
    tokens: int
    ms: float


@dataclass(frozen=True)
class StepEvent:
    index: int  # the decode's forward (verify window) number
    ms: float
    tokens: int = 1  # tokens the step produced (kept drafts and the next token)


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_cached: int = 0  # prompt tokens reused from an earlier request's KV
    prompt_ms: float = 0.0
    generated_tokens: int = 0
    generated_ms: float = 0.0
    drafts_proposed: int = 0  # drafted tokens the model verified (--spec)
    drafts_accepted: int = 0  # of those, kept
    decode_windows: int = 0  # forwards of the decode (one per verify window)
    guessed_windows: int = 0  # windows the front stages read ahead (--pipeline-windows 2)
    guessed_kept: int = 0  # of those, the ones the verification kept

    @property
    def prompt_per_second(self) -> float:
        read = self.prompt_tokens - self.prompt_cached
        return read / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def generated_per_second(self) -> float:
        return self.generated_tokens / (self.generated_ms / 1e3) if self.generated_ms > 0 else 0.0

    @property
    def draft_acceptance(self) -> float:
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: str  # stop | length
    timings: Timings
    tokens: list[int] = field(default_factory=list)


Event = TokenEvent | TextEvent | PromptChunkEvent | StepEvent | DoneEvent


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    cache_prompt: bool = True  # False: read the whole prompt again (no KV reuse)
    logprobs: int | None = None  # each token's log-probability and this many of the likeliest (None: none)
    grammar: str | None = None  # the output follows this grammar (engine.pipeline.constrain.compile_grammar)


class StopMatcher:
    """Holds back text that might be the start of a stop string; reports a completed one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit now, stop reached)"""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [buf.find(s) for s in self.stops if s in buf]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def sync_device(model: object) -> None:
    """Wait for the model's card to finish what was queued (a step's time and its tokens are then real)."""
    dev = model.device  # type: ignore[attr-defined]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def check_prompt(prompt: Sequence[int], max_ctx: int) -> None:
    """Raise GenerationError for a prompt that cannot be read: empty, or as long as the context."""
    if not prompt:
        raise GenerationError("the prompt is empty: give at least one token")
    if len(prompt) >= max_ctx:
        raise GenerationError(
            f"the prompt has {len(prompt)} tokens but the context holds {max_ctx}: "
            "shorten it or start with a larger --max-context"
        )


def new_sampler(req: GenerationRequest, tok: Tokenizer) -> Sampler:
    """The request's sampler, held to its grammar where it has one."""
    if req.grammar is None:
        return Sampler(req.sampling)
    return Sampler(req.sampling, Constraint(req.grammar, tok))


def reuse_prefix(
    cache: KVCache, cached: list[int], prompt: list[int], allow: bool, pc: PromptCache | None
) -> list[int]:
    """Make `cache` (holding `cached`) hold the longest prefix of `prompt[:-1]` that it or a sequence kept in `pc`
    has; -> the tokens it then holds. The last prompt token is always read again, for its logits."""
    target = prompt[:-1]
    live = common_prefix(cached, target) if allow else 0
    if pc is not None:
        entry, n = pc.lookup(target) if allow else (None, 0)
        if entry is not None and n > live:
            # Keep the live sequence before replacing it.
            snap = pc.snapshot(cached, cache)
            pc.restore(entry, n, cache)
            pc.insert(snap)
            return list(entry.tokens[:n])
        if live < len(cached):
            pc.save(cached, cache)
    cache.truncate(live)
    return cached[:live]


def reads_spans(model: object) -> bool:
    """Whether a prompt read alone is faster in spans of several chunks (`model.forward_span`): layer by layer where
    the model streams experts for its chunks, or as one pipeline on a split whose stages read pieces at once."""
    return bool(
        (getattr(model, "layer_major", False) and getattr(model, "streams_experts", False))
        or getattr(model, "pipelines_prompts", False)
    )


class Runner:
    """Runs one sequence at a time through a model with its KV cache, reusing the cached prefix of the last one
    and, with a `PromptCache`, of several recent ones. With `spec` (`--spec N`) it decodes in verify windows of
    drafted tokens (engine/pipeline/spec.py); greedy tokens are the same either way."""

    def __init__(
        self,
        model: "torch.nn.Module | object",
        tokenizer: Tokenizer,
        max_ctx: int,
        kv_type: str,
        prefill_chunk: int = 512,
        prompt_cache: PromptCache | None = None,
        spec: SpecConfig | None = None,
        drafts: Callable[[Sampler], DraftSource | None] | None = None,
        prefill_span: int | None = None,
    ) -> None:
        self.model = model
        # A prompt chunk needs only its last row's logits; models that can skip the others say so.
        self._last_only = "last_only" in inspect.signature(model.forward).parameters
        self.spec = spec or SpecConfig()
        # A request's draft source; by default the ones `spec` names (earlier context, the model's draft layer).
        self.drafts = drafts or (lambda sampler: draft_sources(model, self.spec, sampler, self.cache))
        self.prompt_cache = prompt_cache
        self.tok = tokenizer
        self.max_ctx = max_ctx
        self.prefill_chunk = max(1, prefill_chunk)
        # Prompts read in spans of several chunks (model.forward_span) where that is faster: layer by layer where a
        # model streams experts for its chunks (engine/pipeline/prefill.py, span_tokens: each layer's experts cross
        # PCIe once a span, not once a chunk); as one pipeline on a split whose stages read pieces at once (it
        # empties once a span, not once a chunk).
        self.prefill_span = self.prefill_chunk
        if prefill_span is not None and prefill_span > self.prefill_chunk and reads_spans(model):
            self.prefill_span = prefill_span
            if getattr(model, "pipelines_prompts", False):
                log.info("prompts read through the stages %d tokens at a time, one pipeline each (chunks of %d)",
                         prefill_span, self.prefill_chunk)  # fmt: skip
        self.cache: KVCache = model.new_cache(max_ctx, kv_type)  # type: ignore[attr-defined]
        if self.spec.n > 0 and hasattr(self.cache, "step_states"):
            # Recurrent state (delta-net layers) kept after each row of a window: a rejection goes back exactly.
            self.cache.step_states = self.spec.n + 1
        self.pipe = pipeline_for(model, self.spec, cache=self.cache)
        self.window_graphs = window_graphs_for(model, self.spec) if self.pipe is None else None
        self.cached_tokens: list[int] = []
        if self.spec.n > 0 and drafts is None:
            layer = draft_layer_of(model) if self.spec.draft_layer else None
            if self.spec.need_draft_layer and layer is None:
                raise SpecError(
                    "--mtp 1: the model has no draft layer (its file has no blk.N.nextn.* tensors): "
                    "use --mtp auto or 0"
                )
            names = ["the model's draft layer"] if layer is not None else []
            names += ["earlier context"] if self.spec.suffix else []
            if names:
                log.info("verify windows: up to %d drafts each, from %s", self.spec.n, " and ".join(names))
            else:
                log.info(
                    "verify windows: nothing to draft from (no draft layer, --suffix-draft 0): one token a step"
                )

    def reset(self) -> None:
        """Forget the live sequence (after a failed step its KV may be incomplete)."""
        self.cache.truncate(0)
        self.cached_tokens = []

    def _reuse(self, prompt: list[int], allow: bool) -> int:
        self.cached_tokens = reuse_prefix(self.cache, self.cached_tokens, prompt, allow, self.prompt_cache)
        return len(self.cached_tokens)

    @torch.inference_mode()
    def generate(self, req: GenerationRequest) -> Iterator[Event]:
        prompt = list(req.prompt)
        check_prompt(prompt, self.max_ctx)
        max_new = min(req.max_tokens, self.max_ctx - len(prompt))
        timings = Timings(prompt_tokens=len(prompt))
        common = self._reuse(prompt, req.cache_prompt)
        timings.prompt_cached = common
        sampler = new_sampler(req, self.tok)
        spec_n = 0 if sampler.constraint is not None else self.spec.n  # drafts are checked unconstrained
        source = self.drafts(sampler) if spec_n > 0 else None
        windows = WindowDecoder(
            self.model, self.cache, self.spec, sampler, source, self.pipe, self.window_graphs
        )
        windows.start(self.cached_tokens)
        t0 = time.perf_counter()
        logits = None
        pos = common
        while pos < len(prompt):
            chunk = prompt[pos : pos + self.prefill_span]
            c0 = time.perf_counter()
            ids = torch.tensor(chunk, dtype=torch.long)
            if len(chunk) > self.prefill_chunk:
                logits = self.model.forward_span(ids, self.cache, pos, self.prefill_chunk)  # type: ignore[attr-defined]
            else:
                kw = {"last_only": True} if self._last_only else {}
                logits = self.model.forward(ids, self.cache, pos, **kw)  # type: ignore[attr-defined]
            windows.read(chunk)  # a draft layer takes the chunk's hidden states now, before the next forward
            sync_device(self.model)
            self.cached_tokens.extend(chunk)
            yield PromptChunkEvent(pos, len(chunk), (time.perf_counter() - c0) * 1e3)
            pos += len(chunk)
        assert logits is not None
        timings.prompt_ms = (time.perf_counter() - t0) * 1e3

        history = list(prompt)
        out: list[int] = []
        decoder = self.tok.stream_decoder()
        stops = StopMatcher(req.stop)
        eog = set() if req.ignore_eos else set(self.tok.eog_ids)
        finish = "length"
        stopped_by_string = False
        t1 = time.perf_counter()
        pending = [sampler.sample(logits[-1], history)]  # decided tokens not yet emitted
        rows = [logits[-1]]  # the logits row that decided each of them (the request's logprobs)
        try:
            step = 0
            while True:
                token, row = pending.pop(0), rows.pop(0)
                if token in eog:
                    finish = "stop"
                    break
                out.append(token)
                history.append(token)
                text, hit = stops.feed(decoder.push(token))
                lp = token_logprob(row, token, req.logprobs) if req.logprobs is not None else None
                yield TokenEvent(token, text, lp)
                if hit:
                    finish, stopped_by_string = "stop", True
                    break
                if sampler.finished:  # the grammar is complete
                    finish = "stop"
                    break
                if len(out) >= max_new:
                    break
                if pending:  # kept drafts are emitted one by one before the next window
                    continue
                s0 = time.perf_counter()
                p = len(self.cached_tokens)
                left = max_new - len(out)  # tokens still allowed after this one
                k = min(spec_n, left, self.max_ctx - p - 1)
                w = windows.window(token, p, history, k, room=left - k - 1)
                sync_device(self.model)
                self.cached_tokens.extend([token, *w.accepted])
                pending = [*w.accepted, w.next_token]
                rows = [w.rows[j] for j in range(len(pending))]  # row j decided the token after tokens[j]
                yield StepEvent(step, (time.perf_counter() - s0) * 1e3, len(pending))
                step += 1
            windows.finish()
        finally:
            windows.close()
        # The KV holds positions the request did not emit when it stopped inside a window's kept drafts.
        valid = min(len(self.cached_tokens), len(prompt) + len(out))
        if valid < len(self.cached_tokens):
            rollback(self.model, self.cache, valid)
            del self.cached_tokens[valid:]
        if not stopped_by_string:
            tail, hit = stops.feed(decoder.flush())
            tail += "" if hit else stops.flush()
            if tail:
                yield TextEvent(tail)
        st = windows.stats
        timings.generated_tokens = len(out)
        timings.generated_ms = (time.perf_counter() - t1) * 1e3
        timings.drafts_proposed, timings.drafts_accepted = st.proposed, st.accepted
        timings.decode_windows = st.windows
        timings.guessed_windows, timings.guessed_kept = st.guesses, st.guesses_kept
        yield DoneEvent(finish, timings, out)
