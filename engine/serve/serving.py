"""The server's logic: the model loaded in the background, one FIFO queue, one worker thread that runs one
generation at a time on the model, and the OpenAI responses (whole or streamed) built from its events.

The event loop never waits on the model: requests are tokenized in a thread, the worker pushes what it produces to
each request's asyncio queue, and a request whose client went away is taken out of the queue or stopped between
two steps of its generation.
"""

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from engine.serve.errors import APIError
from engine.serve.protocol import (
    EVENT,
    ChatCompletionRequest,
    CompletionRequest,
    Health,
    Stats,
    new_id,
    now,
    template_message,
    timings_dict,
    usage_dict,
)
from engine.serve.stages import StageSlot, StageTimes, stage_layout
from engine.telemetry.events import EventHub
from engine.telemetry.prometheus import CONTENT_TYPE, Family, render, summary
from engine.telemetry.stats import RunningStat, StageStats, Telemetry
from installer.version import __version__

if TYPE_CHECKING:
    from engine.experts.profile import ProfileRecorder
    from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
    from engine.pipeline.loader import LoadedModel
    from engine.pipeline.split import SplitOptions

log = logging.getLogger("strata.serve")

FINGERPRINT = f"polystrata-{__version__}"
METRICS_CONTENT_TYPE = CONTENT_TYPE
# Names a chat template receives from us; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "source"}
_SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")

Receive = Callable[[], Awaitable[dict[str, Any]]]


def model_id(file_name: str) -> str:
    """`Qwen3-30B-A3B-Q4_K_M-00001-of-00002.gguf` -> `Qwen3-30B-A3B-Q4_K_M`."""
    stem = file_name[: -len(".gguf")] if file_name.lower().endswith(".gguf") else file_name
    return _SPLIT_SUFFIX.sub("", stem)


@dataclass(frozen=True)
class ServeOptions:
    model: Path | None = None  # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    kv: str = "auto"
    max_context: int = 4096
    prefill: int | None = None  # prompt chunk in tokens; None: --prefill auto (split.prefill_chunk)
    prompt_cache_mib: int = 2048
    max_queue: int = 64
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = 16 << 20
    threads: int = 0  # torch intra-op threads; 0: torch's default
    spec: int = 0  # --spec N: drafted tokens per verify window (engine/pipeline/spec.py)
    suffix_draft: bool = True  # --suffix-draft: drafts copied from earlier context
    mtp: str = "auto"  # --mtp auto|1|0: drafts from the model's own draft layer
    pipeline_windows: int = 0  # --pipeline-windows 2 (a layer split only)
    split: "SplitOptions | None" = None  # the layer-split flags; None: the whole model on `device`
    profile_every_s: float = 300.0  # --profile-every: save the usage profile this often (and at shutdown)


@dataclass
class Job:
    """One request waiting for or holding the model.

    The worker thread appends what it produces; the request's coroutine takes everything ready at once. The
    loop is woken once per batch, not once per token, so a fast model does not flood it with wake-ups."""

    endpoint: str  # chat | completions
    req: "GenerationRequest"
    stream: bool
    loop: asyncio.AbstractEventLoop
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: new_id("req"))
    created: float = field(default_factory=time.perf_counter)
    started: float | None = None
    generated: int = 0
    _items: list[tuple[Any, ...]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _signalled: bool = False

    def push(self, *item: Any) -> None:
        """From the worker thread: hand an item to the request's coroutine (a gone loop cancels the job)."""
        with self._lock:
            self._items.append(item)
            if self._signalled:
                return
            self._signalled = True
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:
            self.cancelled.set()

    async def take(self) -> list[tuple[Any, ...]]:
        """In the loop: everything pushed so far (waits for at least one item)."""
        while True:
            with self._lock:
                self._signalled = False
                self._ready.clear()
                if self._items:
                    batch, self._items = self._items, []
                    return batch
            await self._ready.wait()


@dataclass
class Result:
    text: str
    done: "DoneEvent"
    queued_ms: float


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _profile_recorder(lm: "LoadedModel", split: "SplitOptions", every_s: float) -> "ProfileRecorder | None":
    """What serving adds to the model file's usage profile (MoE models, unless --no-profile)."""
    if not split.use_profile or not lm.config.is_moe:
        return None
    from engine.experts.profile import ProfileRecorder, model_counts, profile_location

    path, ident = profile_location(lm.gguf, lm.config, split.profile)
    return ProfileRecorder(path, ident, lm.config.n_expert_used, lambda: model_counts(lm.model), every_s)


class EngineService:
    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.status = "loading"
        self.error: str | None = None
        self.lm: LoadedModel | None = None
        self.runner: Runner | None = None
        self.kv_type: str | None = None
        self.model_name = model_id(opts.model.name) if opts.model else self._default_name()
        self.model_created = now()
        self.hub = EventHub()
        self.telemetry = Telemetry(listener=self._publish, wants_events=self.hub.wants)
        self.stage_slots: list[StageSlot] = []
        self.stage_times: StageTimes | None = None  # a layer split: each stage's times from stage_report()
        # What the worker thread adds to the step or prompt-chunk event it is recording (Telemetry builds the
        # event; only that thread records steps and chunks).
        self._event_extra: dict[str, Any] | None = None
        self._event_warned = False
        self._stage_errors: tuple[type[BaseException], ...] = ()  # a remote stage's failures (StageError)
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.active: Job | None = None
        self._worker: threading.Thread | None = None
        self._loader: threading.Thread | None = None
        self.profile: ProfileRecorder | None = None  # the usage profile this server adds to

    @staticmethod
    def _default_name() -> str:
        from installer.default_model import FILE_NAME

        return model_id(FILE_NAME)

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the model in the background; /health says loading until it is ready (or why it failed)."""
        self._loader = threading.Thread(target=self._load, name="strata-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        loaded: LoadedModel | None = None
        try:
            import torch

            from engine.layers.kv_cache import resolve_kv_type
            from engine.link.startup import load_split_model
            from engine.pipeline.generate import Runner
            from engine.pipeline.prompt_cache import PromptCache
            from engine.pipeline.spec import SpecConfig
            from engine.pipeline.split import SplitOptions, prefill_chunk, prefill_span

            o = self.opts
            if o.threads:
                torch.set_num_threads(o.threads)
                # the threads of --cpu-experts' kernels: Numba reads this when first imported
                os.environ.setdefault("NUMBA_NUM_THREADS", str(o.threads))
            path = o.model
            if path is None:
                from installer.default_model import default_model_path

                path = default_model_path()
            if not path.exists():
                raise FileNotFoundError(
                    f'model file {path} does not exist: check --model or the config\'s "model"'
                )
            split = o.split or SplitOptions(device=o.device)
            if split.remote:
                from engine.link.client import StageError

                self._stage_errors = (StageError,)
            # The plan is checked before any weight is read; a remote stage is connected and checked before this
            # returns (a worker that is not up makes the load fail, with its address, on /health).
            lm = loaded = load_split_model(path, split, o.max_context, o.kv, o.dtype)
            kv = resolve_kv_type(o.kv, lm.model.dtype)
            if o.max_context > lm.config.n_ctx_train:
                log.warning(
                    "--max-context %d is beyond the %d positions %s was trained for: answers past that may degrade",
                    o.max_context,
                    lm.config.n_ctx_train,
                    path.name,
                )
            cache = PromptCache(o.prompt_cache_mib << 20) if o.prompt_cache_mib > 0 else None
            if split.remote and cache is not None:
                # A worker's KV cannot be restored from this process's host memory.
                log.info("prompt cache off: the remote stage keeps its own KV")
                cache = None
            if o.prefill is None:
                chunk = prefill_chunk(lm.model, "auto", max_ctx=o.max_context, kv_type=kv,
                                      budget_mib=split.vram_budget_mib, reserve_mib=split.reserve_mib)  # fmt: skip
            else:
                chunk = o.prefill
            spec = SpecConfig.from_flags(o.spec, o.suffix_draft, o.mtp, o.pipeline_windows)
            span = prefill_span(lm.model, chunk, o.max_context, kv, split.vram_budget_mib, split.reserve_mib)
            runner = Runner(
                lm.model, lm.tokenizer, o.max_context, kv, chunk, cache, spec=spec, prefill_span=span
            )
            slots = stage_layout(lm.model, lm.config.n_layer)
            recorder = _profile_recorder(lm, split, o.profile_every_s)
        except Exception as e:  # the server stays up and says why on /health
            self.error = " ".join(str(e).split()) or type(e).__name__
            self.status = "error"
            log.error("the model could not be loaded: %s", self.error)
            close = getattr(loaded.model, "close", None) if loaded is not None else None
            if close is not None:  # a remote link that was opened
                close()
            return
        self.stage_slots = slots
        if hasattr(lm.model, "stage_report"):
            self.stage_times = StageTimes(slots)
        self.telemetry.stages = [StageStats(RunningStat(), RunningStat()) for _ in slots]
        self.lm, self.runner, self.kv_type = lm, runner, kv
        self.profile = recorder
        self.model_name = model_id(lm.path.name)
        self.model_created = int(lm.path.stat().st_mtime)
        self._worker = threading.Thread(target=self._work, name="strata-generate", daemon=True)
        self._worker.start()
        self.status = "ready"
        log.info("model %s ready in %.1f s", self.model_name, time.perf_counter() - t0)

    def stop(self) -> None:
        """Shutting down: end every request (their clients get a 503 error) and let the worker finish."""
        with self._cv:
            self._stopping = True
            jobs = [*self._waiting, *([self.active] if self.active is not None else [])]
            self._waiting.clear()
            self._cv.notify_all()
        for job in jobs:
            job.cancelled.set()
            job.push("error", APIError(503, "the server is shutting down", code="shutting_down"))
        self.hub.close_soon()

    def finish(self, wait_s: float = 5.0) -> None:
        """After `stop`, at shutdown: let the worker leave the model, then save the usage profile gathered."""
        if self._worker is not None:
            self._worker.join(wait_s)
        if self.profile is not None:
            self.profile.save()

    def stop_soon(self) -> None:
        """`stop` from a signal handler: run it on the event loop, never inside a lock the loop may hold."""
        loop = self.hub.loop
        if loop is None:
            self.stop()
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self.stop)

    # ---- checks ---------------------------------------------------------------------------------------------

    def model_names(self) -> set[str]:
        names = {self.model_name, *self.opts.aliases}
        if self.lm is not None:
            names.add(self.lm.path.name)
        return names

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names():
            raise APIError(
                404,
                f"the model {name!r} does not exist: this server serves {self.model_name!r} (see GET /v1/models)",
                code="model_not_found",
                param="model",
            )

    def require_ready(self) -> None:
        if self.status == "loading":
            raise APIError(
                503,
                f"the model {self.model_name} is still loading: retry when GET /health says ready",
                code="model_loading",
                headers={"Retry-After": "2"},
            )
        if self.status == "error":
            raise APIError(503, f"the model could not be loaded: {self.error}", code="model_load_failed")

    # ---- requests -> token ids ------------------------------------------------------------------------------

    def _encode(self, text: str, parse_special: bool) -> list[int]:
        assert self.lm is not None
        try:
            return self.lm.tokenizer.encode(text, add_special=True, parse_special=parse_special)
        except UnicodeError as e:
            raise APIError(400, f"the text cannot be encoded as UTF-8: {e}", code="invalid_text") from None

    def _sampling(self, r: ChatCompletionRequest | CompletionRequest) -> Any:
        from engine.pipeline.sampling import SamplingError, SamplingParams

        d = SamplingParams()
        temperature = d.temperature if r.temperature is None else r.temperature
        top_p = d.top_p if r.top_p is None else r.top_p
        if top_p == 0:  # "only the most likely token"
            temperature, top_p = 0.0, 1.0
        try:
            return SamplingParams(
                temperature=temperature,
                top_k=d.top_k if r.top_k is None else r.top_k,
                top_p=top_p,
                min_p=d.min_p if r.min_p is None else r.min_p,
                repeat_penalty=d.repeat_penalty if r.repeat_penalty is None else r.repeat_penalty,
                presence_penalty=d.presence_penalty if r.presence_penalty is None else r.presence_penalty,
                frequency_penalty=d.frequency_penalty if r.frequency_penalty is None else r.frequency_penalty,
                repeat_last_n=d.repeat_last_n if r.repeat_last_n is None else r.repeat_last_n,
                seed=None if r.seed is None else r.seed % 2**64,
            )
        except SamplingError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def _generation(
        self, ids: list[int], r: ChatCompletionRequest | CompletionRequest, template_stops: Sequence[str] = ()
    ) -> "GenerationRequest":
        from engine.pipeline.generate import GenerationRequest

        ctx = self.opts.max_context
        if not ids:
            raise APIError(400, "the prompt is empty: give some text", code="empty_prompt", param="prompt")
        if len(ids) >= ctx:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but the context holds {ctx} (--max-context): shorten the "
                "prompt or the conversation, or restart the server with a larger --max-context",
                code="context_length_exceeded",
                param="messages" if isinstance(r, ChatCompletionRequest) else "prompt",
            )
        limit = r.token_limit
        return GenerationRequest(
            ids,
            max_tokens=ctx - len(ids) if limit is None else limit,
            sampling=self._sampling(r),
            stop=[*r.stops, *(s for s in template_stops if s not in r.stops)],
            ignore_eos=bool(r.ignore_eos),
            cache_prompt=r.cache_prompt is not False,
        )

    def prepare_chat(self, r: ChatCompletionRequest) -> "GenerationRequest":
        """Messages through the model's chat template, then tokens (runs in a thread: templates and long
        prompts take time)."""
        from engine.tokenizer import ChatTemplateError

        assert self.lm is not None
        extra = dict(r.chat_template_kwargs or {})
        bad = sorted(_RESERVED_TEMPLATE_VARS & extra.keys())
        if bad:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(bad)}: those come from the request itself",
                code="invalid_value",
                param="chat_template_kwargs",
            )
        if r.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", r.reasoning_effort)
        tools = None
        if r.tools and r.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in r.tools]
        try:
            text = self.lm.chat.render(
                [template_message(m) for m in r.messages], add_generation_prompt=True, tools=tools, **extra
            )
        except ChatTemplateError as e:
            raise APIError(400, str(e), code="chat_template_error", param="messages") from None
        # a reply under the fallback template may write its end marker as text: it ends there
        return self._generation(self._encode(text, parse_special=True), r, self.lm.chat.stop_strings)

    def prepare_completion(self, r: CompletionRequest) -> tuple["GenerationRequest", str]:
        """-> (generation, echo text)"""
        assert self.lm is not None
        p = r.prompt
        if isinstance(p, str) or (p and isinstance(p[0], str)):
            text = p if isinstance(p, str) else str(p[0])
            ids = self._encode(text, parse_special=True)
        else:
            ids = [int(x) for x in (p[0] if isinstance(p[0], list) else p)]  # type: ignore[union-attr]
            vocab = self.lm.tokenizer.vocab_size
            bad = [x for x in ids if not 0 <= x < vocab]
            if bad:
                raise APIError(
                    400,
                    f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})",
                    code="invalid_value",
                    param="prompt",
                )
            text = self.lm.tokenizer.decode(ids) if r.echo else ""
        return self._generation(ids, r), text if r.echo else ""

    # ---- the queue and the worker ---------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._waiting) >= self.opts.max_queue:
                raise APIError(
                    503,
                    f"the server is busy: {len(self._waiting)} requests are waiting (--max-queue "
                    f"{self.opts.max_queue}); retry later",
                    code="server_busy",
                    headers={"Retry-After": "1"},
                )
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job from the queue, or stop its generation at the next step."""
        with self._cv:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running (the worker stops it) or finished
        self.telemetry.request_done(job.endpoint, "cancelled")

    def _work(self) -> None:
        try:
            self._serve_queue()
        finally:  # the links to remote stages are used by this thread only: closed here too
            close = getattr(self.lm.model, "close", None) if self.lm is not None else None
            if close is not None:
                close()

    def _serve_queue(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                self.active = job
            try:
                self._run(job)
            except Exception:  # never let one request end the worker
                log.exception("request %s failed", job.id)
            finally:
                with self._cv:
                    self.active = None

    def _run(self, job: Job) -> None:
        from engine.pipeline.generate import (
            DoneEvent,
            GenerationError,
            PromptChunkEvent,
            StepEvent,
            TextEvent,
            TokenEvent,
        )

        assert self.runner is not None
        if job.cancelled.is_set():  # the client left between the queue and here
            self.telemetry.request_done(job.endpoint, "cancelled")
            return
        job.started = time.perf_counter()
        queued_ms = (job.started - job.created) * 1e3
        tel = self.telemetry
        parts: list[str] = []
        done: DoneEvent | None = None
        gen = self.runner.generate(job.req)
        try:
            for ev in gen:
                if job.cancelled.is_set():
                    break
                if isinstance(ev, TokenEvent):
                    job.generated += 1
                    if ev.text:
                        if job.stream:
                            job.push("text", ev.text)
                        else:
                            parts.append(ev.text)
                elif isinstance(ev, StepEvent):
                    self._record("step", ev.ms, ev.index, {"tokens": ev.tokens})
                elif isinstance(ev, PromptChunkEvent):
                    self._record("prompt_chunk", ev.ms, ev.start, {}, ev.tokens)
                elif isinstance(ev, TextEvent):
                    if ev.text:
                        if job.stream:
                            job.push("text", ev.text)
                        else:
                            parts.append(ev.text)
                elif isinstance(ev, DoneEvent):
                    done = ev
        except GenerationError as e:
            tel.request_done(job.endpoint, "error")
            job.push("error", APIError(400, str(e), code="invalid_request"))
            return
        except self._stage_errors as e:  # a worker stopped, froze or was cut off: the next request reconnects
            log.error("request %s failed: %s", job.id, e)
            self.runner.reset()
            tel.request_done(job.endpoint, "error")
            job.push(
                "error",
                APIError(
                    502,
                    f"a remote stage failed: {e}; the server keeps running and reconnects on the next request "
                    "(GET /health shows each stage)",
                    code="stage_unavailable",
                ),
            )
            return
        except Exception as e:
            log.exception("generation of request %s failed", job.id)
            self.runner.reset()
            tel.request_done(job.endpoint, "error")
            job.push(
                "error",
                APIError(500, f"the generation failed: {type(e).__name__}: {e}", code="generation_failed"),
            )
            return
        finally:
            gen.close()
            self._snapshot_experts()
            if self.profile is not None:
                self.profile.tick()
        if done is None:  # stopped by cancel()
            tel.request_done(job.endpoint, "cancelled")
            return
        tel.request_done(job.endpoint, "ok", timings_dict(done.timings, queued_ms))
        job.push("done", Result("".join(parts), done, queued_ms))

    def _record(self, kind: str, ms: float, at: int, extra: dict[str, Any], tokens: int = 0) -> None:
        """One decode step (`at`: its index) or prompt chunk (`at`: its first position) into the telemetry: the
        whole forward as stage 0 for one stage, each stage's own time from `stage_report()` for a split."""
        tel = self.telemetry
        if self.stage_times is None or self.lm is None:
            parts = [(0, ms, extra)]
        else:
            report = self.lm.model.stage_report()  # type: ignore[union-attr]
            parts = [
                (i, own, {**details, **extra}) for i, own, details in self.stage_times.record(kind, report)
            ]
        for i, own, details in parts:
            self._event_extra = details
            try:
                if kind == "step":
                    tel.step(i, own, at)
                else:
                    tel.prompt_chunk(i, tokens, own, at)
            finally:
                self._event_extra = None

    def _publish(self, event: dict[str, Any]) -> None:
        """Telemetry's listener: its step and prompt-chunk events get the stage's details (layers, device, a
        worker's address and its compute, waiting and transfer times) and the step's token count."""
        extra = self._event_extra
        if extra and event.get("type") in ("step", "prompt_chunk"):
            event.update(extra)
        try:
            typed = EVENT.validate_python(event)
        except (
            ValidationError
        ) as e:  # a field the protocol does not have: a bug, said once, never a failed step
            if not self._event_warned:
                self._event_warned = True
                log.warning("an /events event does not match engine/serve/protocol.py and is left out: %s", e)
            return
        self.hub.publish(typed.model_dump(mode="json", exclude_none=True))

    def _snapshot_experts(self) -> None:
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

    # ---- answers --------------------------------------------------------------------------------------------

    async def run_to_end(self, job: Job, receive: Receive) -> Result:
        """Queue the job and wait for its whole answer; the client leaving cancels it."""
        self.submit(job)
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        getter = asyncio.ensure_future(job.take())
        try:
            done, _ = await asyncio.wait({watcher, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                raise ClientGone
            item = getter.result()[0]  # a whole answer comes as one item
        finally:
            watcher.cancel()
            getter.cancel()
            self.cancel(job)
        if item[0] == "error":
            raise item[1]
        return item[1]

    async def _items(self, job: Job) -> AsyncIterator[list[tuple[Any, ...]]]:
        while True:
            batch = await job.take()
            yield batch
            if batch[-1][0] in ("done", "error"):
                return

    async def stream(
        self, job: Job, endpoint: str, include_usage: bool, echo: str = ""
    ) -> AsyncIterator[bytes]:
        """The SSE body of a streamed answer. Closing it (the client left) cancels the job."""
        chat = endpoint == "chat"
        base = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": now(),
            "model": self.model_name,
            "system_fingerprint": FINGERPRINT,
        }

        def chunk(text: str | None, finish: str | None = None, first: bool = False, **extra: Any) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj: dict[str, Any] = {**base, "choices": [choice], **extra}
            if include_usage and "usage" not in obj:
                obj["usage"] = None
            return sse_event(obj)

        # A text piece differs from its neighbours only in the text: serialize the rest once.
        head, tail = chunk("\x00").split(b'"\\u0000"', 1)

        def text_chunk(text: str) -> bytes:
            return head + json.dumps(text, ensure_ascii=False).encode() + tail

        try:
            if chat:
                yield chunk("", first=True)
            elif echo:
                yield chunk(echo)
            async for batch in self._items(job):
                out = bytearray()
                for item in batch:
                    if item[0] == "text":
                        out += text_chunk(item[1])
                    elif item[0] == "error":
                        err: APIError = item[1]
                        out += sse_event(err.body())
                        yield bytes(out)
                        return
                    else:
                        res: Result = item[1]
                        t = res.done.timings
                        timings = timings_dict(t, res.queued_ms)
                        out += chunk(None if chat else "", res.done.finish_reason, timings=timings)
                        if include_usage:
                            out += sse_event(
                                {**base, "choices": [], "usage": usage_dict(t), "timings": timings}
                            )
                        out += b"data: [DONE]\n\n"
                yield bytes(out)
        finally:
            self.cancel(job)

    def chat_response(self, res: Result) -> dict[str, Any]:
        t = res.done.timings
        return {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": self.model_name,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": res.text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": res.done.finish_reason,
                }
            ],
            "usage": usage_dict(t),
            "timings": timings_dict(t, res.queued_ms),
        }

    def completion_response(self, res: Result, echo: str) -> dict[str, Any]:
        t = res.done.timings
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "text": echo + res.text,
                    "logprobs": None,
                    "finish_reason": res.done.finish_reason,
                }
            ],
            "usage": usage_dict(t),
            "timings": timings_dict(t, res.queued_ms),
        }

    # ---- state ----------------------------------------------------------------------------------------------

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
            "queue": {"waiting": self.waiting, "active": 1 if self.active is not None else 0},
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
                "active": 1 if active is not None else 0,
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
        pc = self.runner.prompt_cache if self.runner is not None else None
        if pc is not None:
            s = pc.stats()
            out["prompt_cache"] = {
                "entries": s.entries,
                "bytes": s.bytes,
                "max_bytes": s.max_bytes,
                "saves": s.saves,
                "restores": s.restores,
                "evictions": s.evictions,
                "restored_tokens": s.restored_tokens,
            }
        else:
            out["prompt_cache"] = None
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

    def metrics(self) -> str:
        snap = self.telemetry.snapshot()
        tot = snap["totals"]
        fams = [
            Family("strata_info", "gauge", "The model served, its architecture and device.").add(
                1,
                {
                    "model": self.model_name,
                    "arch": self.lm.config.arch if self.lm else "",
                    "device": str(self.lm.model.device) if self.lm else "",
                    "version": __version__,
                },
            ),
            Family("strata_model_ready", "gauge", "1 once the model is loaded and serving.").add(
                1 if self.status == "ready" else 0
            ),
            Family("strata_uptime_seconds", "gauge", "Seconds since the server started.").add(
                snap["uptime_s"]
            ),
        ]
        links = self.links()
        if links:
            up = Family(
                "strata_remote_stage_up", "gauge", "1 while the link to a remote stage works, by address."
            )
            for address, st in links:
                up.add(1 if st == "ok" else 0, {"address": address})
            fams.append(up)
        req = Family("strata_requests_total", "counter", "Requests finished, by endpoint and outcome.")
        for r in snap["requests"]:
            req.add(r["count"], {"endpoint": r["endpoint"], "outcome": r["outcome"]})
        fams.append(req)
        for name, key, help_ in (
            ("strata_prompt_tokens_total", "prompt_tokens", "Prompt tokens of finished requests."),
            (
                "strata_prompt_tokens_cached_total",
                "prompt_cached_tokens",
                "Prompt tokens reused from the prompt cache.",
            ),
            ("strata_tokens_predicted_total", "generated_tokens", "Tokens generated."),
            ("strata_prompt_seconds_total", "prompt_seconds", "Seconds spent reading prompts."),
            ("strata_tokens_predicted_seconds_total", "decode_seconds", "Seconds spent generating tokens."),
        ):
            fams.append(Family(name, "counter", help_).add(tot[key]))
        fams.append(
            Family("strata_queue_waiting", "gauge", "Requests waiting for the model.").add(self.waiting)
        )
        fams.append(
            Family("strata_requests_active", "gauge", "Requests being generated (0 or 1).").add(
                1 if self.active is not None else 0
            )
        )
        stages = snap["stages"]
        fams.append(
            summary(
                "strata_step_seconds",
                "Time of one decode step, per pipeline stage.",
                [({"stage": s["stage"]}, s["step_ms"]["count"], s["step_ms"]["total"] / 1e3) for s in stages],
            )
        )
        fams.append(
            summary(
                "strata_prompt_chunk_seconds",
                "Time of one prompt chunk, per pipeline stage.",
                [
                    (
                        {"stage": s["stage"]},
                        s["prompt_chunk_ms"]["count"],
                        s["prompt_chunk_ms"]["total"] / 1e3,
                    )
                    for s in stages
                ],
            )
        )
        hits = Family(
            "strata_expert_cache_hits_total", "counter", "Expert lookups served from the card's cache."
        )
        miss = Family(
            "strata_expert_cache_misses_total", "counter", "Expert lookups that missed the card's cache."
        )
        swaps = Family(
            "strata_expert_cache_swaps_total", "counter", "Experts the adaptive swaps brought into VRAM."
        )
        moved = Family(
            "strata_expert_cache_bytes_moved_total",
            "counter",
            "Expert bytes copied into VRAM by adaptive swaps and prompt chunks' staging.",
        )
        on_cpu = Family(
            "strata_expert_cache_cpu_computed_total",
            "counter",
            "Missed experts computed on the CPU (--cpu-experts).",
        )
        share = Family(
            "strata_expert_cache_cpu_share",
            "gauge",
            "The CPU's share of a decode step's misses now (tuned while serving, or --cpu-ratio).",
        )
        for s in stages:
            ec, lab = s["expert_cache"], {"stage": s["stage"]}
            hits.add(ec["hits"], lab)
            miss.add(ec["misses"], lab)
            swaps.add(ec["swaps"], lab)
            moved.add(ec["bytes_moved"], lab)
            on_cpu.add(ec["computed_on_cpu"], lab)
            if ec["cpu_share"] is not None:
                share.add(ec["cpu_share"], lab)
        fams += [hits, miss, swaps, moved, on_cpu, share]
        counts = snap["expert_counts"]
        if counts:
            sel = Family("strata_expert_selections_total", "counter", "Routed expert selections, per layer.")
            for layer, row in enumerate(counts):
                sel.add(sum(row), {"layer": layer})
            fams.append(sel)
        pc = self.runner.prompt_cache if self.runner is not None else None
        if pc is not None:
            s = pc.stats()
            fams.append(
                Family("strata_prompt_cache_bytes", "gauge", "Bytes of KV kept by the prompt cache.").add(
                    s.bytes
                )
            )
            fams.append(
                Family("strata_prompt_cache_entries", "gauge", "Sequences kept by the prompt cache.").add(
                    s.entries
                )
            )
            fams.append(
                Family(
                    "strata_prompt_cache_restores_total", "counter", "Prompt cache entries brought back."
                ).add(s.restores)
            )
        return render(fams)
