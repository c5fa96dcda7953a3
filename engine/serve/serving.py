"""The server's logic: the model loaded in the background, one FIFO queue, one worker thread that runs the model
(several requests at once in shared steps with --parallel N, engine/pipeline/batch.py; else one at a time), and
the OpenAI responses (whole or streamed) built from its events.

The event loop never waits on the model: requests are tokenized in a thread, the worker pushes what it produces to
each request's asyncio queue, and a request whose client went away is taken out of the queue or stopped between
two steps of its generation.
"""

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from engine.experts.profile import ProfileRecorder, model_counts, profile_location
from engine.layers.kv_cache import resolve_kv_type
from engine.link.client import StageError
from engine.link.startup import load_split_model
from engine.pipeline.batch import BatchRunner
from engine.pipeline.cuda_graphs import warm_prompts
from engine.pipeline.generate import (
    DoneEvent,
    Event,
    GenerationError,
    PromptChunkEvent,
    Runner,
    StepEvent,
    TextEvent,
    TokenEvent,
    TokenLogprob,
)
from engine.pipeline.mtp import draft_layer_of
from engine.pipeline.prompt_cache import PromptCache
from engine.pipeline.spec import SpecConfig
from engine.pipeline.split import SplitOptions, prefill_chunk, prefill_span
from engine.serve.answers import Answers
from engine.serve.errors import APIError, from_validation
from engine.serve.jobs import Job, Result
from engine.serve.metrics import Metrics
from engine.serve.options import ServeOptions, model_id
from engine.serve.protocol import (
    EVENT,
    ChatCompletionRequest,
    now,
    timings_dict,
)
from engine.serve.stages import StageSlot, StageTimes, stage_layout
from engine.serve.status import Status
from engine.serve.translate import RequestTranslation
from engine.telemetry import gc_pauses
from engine.telemetry.events import EventHub
from engine.telemetry.prometheus import CONTENT_TYPE
from engine.telemetry.stats import RunningStat, StageStats, Telemetry
from installer.default_model import FILE_NAME, default_model_path

if TYPE_CHECKING:
    from engine.pipeline.loader import LoadedModel

log = logging.getLogger("strata.serve")
LINK_CHECK_S = 1.0  # idle: how often the links to remote stages are checked for a worker that left

METRICS_CONTENT_TYPE = CONTENT_TYPE


def _runs_alone(model: object, spec: SpecConfig, slots: int) -> str | None:
    """Why requests run one at a time outside the slots' scheduler (the single-sequence Runner), or None: a model
    without batched steps, or verify windows drafted by the model's draft layer (--mtp, and its default with one
    slot where the model has one) or guessed (--pipeline-windows), which draft for one request."""
    if not hasattr(model, "forward_batch"):
        return "this model runs one request at a time"
    if spec.n == 0:
        return None
    if spec.need_draft_layer or spec.pipeline_windows:
        return ("--mtp 1" if spec.need_draft_layer else "--pipeline-windows") + " runs one request at a time"
    if not spec.suffix:
        return "with --suffix-draft 0 only the model's draft layer drafts, for one request at a time"
    if slots == 1 and spec.draft_layer and draft_layer_of(model) is not None:
        return "the model's draft layer drafts the windows"
    return None


def _log_slot_windows(model: object, spec: SpecConfig, slots: int) -> None:
    """Say how slots serve verify windows (--spec): each slot drafts from its request's earlier context."""
    if spec.draft_layer and draft_layer_of(model) is not None:
        log.info("--parallel %d: each slot's windows draft from earlier context (the model's draft layer drafts "
                 "with --parallel 1)", slots)  # fmt: skip
    log.info("--parallel %d: verify windows of up to %d drafts in every slot", slots, spec.n)


def _profile_recorder(lm: "LoadedModel", split: "SplitOptions", every_s: float) -> "ProfileRecorder | None":
    """What serving adds to the model file's usage profile (MoE models, unless --no-profile)."""
    if not split.use_profile or not lm.config.is_moe:
        return None

    path, ident = profile_location(lm.gguf, lm.config, split.profile)
    return ProfileRecorder(path, ident, lm.config.n_expert_used, lambda: model_counts(lm.model), every_s)


def auto_groups(model: object, remote: bool) -> int:
    """--batch-groups auto: 2 with a remote stage where this process computes on the CPU (a step's cost grows with
    its rows there, so two half steps cost about one whole one, and both PCs compute at once); 1 where it computes
    on a GPU, whose step of 4 rows costs nearly one of 8: two groups doubled each process's steps (one H200, a
    worker on loopback, 8 clients: 484 tok/s in 2 groups against 641 in 1; 1 client 159 against 180)."""
    if not remote:
        return 1
    return 1 if any(getattr(d, "type", "") == "cuda" for d in getattr(model, "devices", [])) else 2


class EngineService(RequestTranslation, Answers, Status, Metrics):
    """The served model: loaded in the background, one FIFO queue and one worker thread (here); requests into
    generation requests (translate.py), answers (answers.py), what it says about itself (status.py, metrics.py)."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.status = "loading"
        self.error: str | None = None
        self.lm: LoadedModel | None = None
        self.runner: Runner | None = None
        self.batch: BatchRunner | None = None  # the slots (None: one request at a time, on `runner`)
        self.running: list[Job] = []  # the requests in the slots, oldest first
        self._outputs: dict[str, _JobOutput] = {}  # by job id: what the slots' requests produced so far
        self.rows = RunningStat()  # token rows per shared step
        self.prompt_cache: PromptCache | None = None
        self._other_names: set[str] = set()  # model names clients sent that are not the served model's
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
            o = self.opts
            if o.threads:
                torch.set_num_threads(o.threads)
                # the threads of --cpu-experts' kernels: Numba reads this when first imported (once it has loaded,
                # its pool is fixed and another value would make it refuse to compile)
                if "numba" not in sys.modules:
                    os.environ.setdefault("NUMBA_NUM_THREADS", str(o.threads))
            path = o.model
            if path is None:
                path = default_model_path()
            if not path.exists():
                raise FileNotFoundError(
                    f'model file {path} does not exist: check --model or the config\'s "model"'
                )
            split = o.split or SplitOptions(device=o.device)
            if split.remote:
                self._stage_errors = (StageError,)
            # The plan is checked before any weight is read; a remote stage is connected and checked before this
            # returns (a worker that is not up makes the load fail, with its address, on /health).
            lm = loaded = load_split_model(path, split, o.max_context, o.kv, o.dtype, parallel=o.parallel)
            # --max-context auto, resolved (/v1/models, /stats and /props say it)
            if lm.context != o.max_context:
                self.opts = o = dataclasses.replace(o, max_context=lm.context)
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
            slots = lm.sequences
            spec = SpecConfig.from_flags(o.spec, o.suffix_draft, o.mtp, o.pipeline_windows)
            alone = _runs_alone(lm.model, spec, slots)
            # every slot's KV cache is still to come: the prompt's temporaries get what they leave
            caches = 1 if alone is not None else slots
            if o.prefill is None:
                chunk = prefill_chunk(lm.model, "auto", max_ctx=o.max_context, kv_type=kv, slots=caches,
                                      budget_mib=split.vram_budget_mib, reserve_mib=split.reserve_mib)  # fmt: skip
            else:
                chunk = o.prefill
            span = prefill_span(
                lm.model, chunk, o.max_context, kv, split.vram_budget_mib, split.reserve_mib, caches
            )
            if alone is not None and slots > 1:
                log.info("--parallel %d: %s: 1 slot", slots, alone)
            elif slots > 1 and spec.n > 0:
                _log_slot_windows(lm.model, spec, slots)
            groups = (
                o.batch_groups if o.batch_groups is not None else auto_groups(lm.model, bool(split.remote))
            )
            batch = None
            # One slot runs through the scheduler too, wherever it can: its steps overlap the host's work on each
            # token (the single-sequence Runner reads each token before it queues the next step: 0.86x the decode
            # of a slot on an H200, bench/results/serve-one-request-parallel1-h200.json)
            if alone is None:
                batch = BatchRunner(
                    lm.model,
                    lm.tokenizer,
                    o.max_context,
                    kv,
                    slots,
                    chunk,
                    cache,
                    prefill_span=span,
                    groups=groups,
                    spec=spec,
                )
            if batch is not None and batch.groups > 1:
                log.info("%d slots in %d groups: a group's step goes out while the worker computes another's",
                         slots, batch.groups)  # fmt: skip
            if batch is not None:
                tw = time.perf_counter()
                warmed = batch.warm()
                if warmed:
                    log.info("%d slots: decode graphs for 1-%d rows captured in %.1f s", slots, warmed,
                             time.perf_counter() - tw)  # fmt: skip
            graphs = getattr(lm.model, "prompt_graphs", None)
            split_graphs = getattr(lm.model, "warm_prompt_graphs", None)  # a layer split's stages' own
            if graphs is not None or split_graphs is not None:
                # every prompt length then runs from graphs: none waits for a capture
                tw = time.perf_counter()
                sizes = graphs.warm(chunk, kv) if graphs is not None else split_graphs(chunk, kv)
                if sizes:
                    log.info("prompt graphs for chunks of 2-%d tokens (%d sizes) captured in %.1f s", sizes[-1],
                             len(sizes), time.perf_counter() - tw)  # fmt: skip
            runner = (
                Runner(lm.model, lm.tokenizer, o.max_context, kv, chunk, cache, spec=spec, prefill_span=span)
                if batch is None
                else None
            )
            # where no prompt graphs were captured, the prompt kernels are built now (cuda_graphs.warm_prompts)
            tw = time.perf_counter()
            read = (
                batch.warm_prompts() if batch is not None else warm_prompts(lm.model, [runner.cache], chunk)
            )
            if read:
                log.info("prompt kernels for chunks of 2-%d tokens built in %.1f s (%d sizes, every stage)", read[-1],
                         time.perf_counter() - tw, len(read))  # fmt: skip
            layout = stage_layout(lm.model, lm.config.n_layer)
            recorder = _profile_recorder(lm, split, o.profile_every_s)
        except Exception as e:  # the server stays up and says why on /health
            self.error = " ".join(str(e).split()) or type(e).__name__
            self.status = "error"
            log.error("the model could not be loaded: %s", self.error)
            close = getattr(loaded.model, "close", None) if loaded is not None else None
            if close is not None:  # a remote link that was opened
                close()
            return
        self.stage_slots = layout
        if hasattr(lm.model, "stage_report"):
            self.stage_times = StageTimes(layout)
        self.telemetry.stages = [StageStats(RunningStat(), RunningStat()) for _ in layout]
        self.lm, self.runner, self.batch, self.kv_type = lm, runner, batch, kv
        self.prompt_cache = cache
        self.profile = recorder
        self.model_name = model_id(lm.path.name)
        self.model_created = int(lm.path.stat().st_mtime)
        # what the load made lives as long as the model: no collection walks it again (a full collection of it in
        # the middle of a request would hold every thread)
        frozen, ms = gc_pauses.freeze_loaded()
        log.debug("%d objects of the load frozen out of garbage collection in %.0f ms", frozen, ms)
        gc_pauses.watch()
        self._worker = threading.Thread(target=self._work, name="strata-generate", daemon=True)
        self._worker.start()
        self.status = "ready"
        log.info(
            "model %s ready in %.1f s (%d slot%s)",
            self.model_name,
            time.perf_counter() - t0,
            1 if batch is None else len(batch.slots),
            "s: requests are decoded together" if batch is not None and len(batch.slots) > 1 else "",
        )

    def stop(self) -> None:
        """Shutting down: end every request (their clients get a 503 error) and let the worker finish."""
        with self._cv:
            self._stopping = True
            jobs = [*self._waiting, *self.running]
            if self.active is not None and self.active not in jobs:
                jobs.append(self.active)
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
        gc_pauses.unfreeze()  # the model may go now (another service in this process loads its own)

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
        """A generation request's `model`: one model is loaded, so it answers whatever name the client sends (as
        llama-server and LM Studio do); a name it does not have is logged once."""
        if name is None or name in self.model_names() or name in self._other_names:
            return
        if len(self._other_names) < 32:
            self._other_names.add(name)
            log.info(
                "requests name the model %r: %s answers them (the one model loaded)", name, self.model_name
            )

    def check_model_card(self, name: str) -> None:
        """GET /v1/models/{id}: a lookup, so only the served model's names."""
        if name not in self.model_names():
            raise APIError(
                404,
                f"the model {name!r} does not exist: this server serves {self.model_name!r} (see GET /v1/models)",
                code="model_not_found",
                param="model",
            )

    async def dialect_chat(self, r: Any, stream: bool) -> tuple[ChatCompletionRequest, Job, bool | None]:
        """Another dialect's chat request (Anthropic's, the Responses API's): the chat request it maps onto (one
        the chat route would refuse is a 400 naming the field), its job, prepared off the event loop, and how its
        answer's reasoning goes (`reasoning_mode`)."""
        self.check_model(r.model)
        try:
            chat: ChatCompletionRequest = r.as_openai()
        except ValidationError as e:
            raise from_validation(e) from None
        self.require_ready()
        gen = await run_in_threadpool(self.prepare_chat, chat)
        return chat, Job("chat", gen, stream, asyncio.get_running_loop()), self.reasoning_mode(chat, gen)

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

    # ---- the queue and the worker ---------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def generating(self) -> int:
        """Requests being generated: those in the slots, or the one request."""
        return len(self.running) if self.batch is not None else (1 if self.active is not None else 0)

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
            if self.batch is not None:
                self._serve_slots(self.batch)
            else:
                self._serve_queue()
        finally:  # the links to remote stages are used by this thread only: closed here too
            close = getattr(self.lm.model, "close", None) if self.lm is not None else None
            if close is not None:
                close()

    def _idle(self, busy: Callable[[], bool]) -> bool:
        """Under the lock: wait for work; -> False when LINK_CHECK_S passed without any (check the links then)."""
        while not busy() and not self._stopping:
            if not self._cv.wait(LINK_CHECK_S):
                return busy() or self._stopping
        return True

    def _check_links(self) -> None:
        """Between requests, in this thread (which owns the links' sockets): a remote stage whose worker left is
        marked down, so /health says so before a request fails on it."""
        check = getattr(self.lm.model, "check_links", None) if self.lm is not None else None
        if check is not None:
            check()

    def _serve_queue(self) -> None:
        while True:
            with self._cv:
                if not self._idle(lambda: bool(self._waiting)):
                    job = None
                elif self._stopping:
                    return
                else:
                    job = self._waiting.popleft()
                    self.active = job
            if job is None:
                self._check_links()
                continue
            try:
                self._run(job)
            except Exception:  # never let one request end the worker
                log.exception("request %s failed", job.id)
            finally:
                with self._cv:
                    self.active = None

    def _run(self, job: Job) -> None:
        assert self.runner is not None
        if job.cancelled.is_set():  # the client left between the queue and here
            self.telemetry.request_done(job.endpoint, "cancelled")
            return
        out = _JobOutput(self, job)
        gen = self.runner.generate(job.req)
        try:
            for ev in gen:
                if job.cancelled.is_set():
                    break
                out.event(ev)
        except GenerationError as e:
            out.refused(e)
            return
        except self._stage_errors as e:  # a worker stopped, froze or was cut off: the next request reconnects
            log.error("request %s failed: %s", job.id, e)
            self.runner.reset()
            self.telemetry.request_done(job.endpoint, "error")
            job.push("error", _stage_failed(e))
            return
        except Exception as e:
            log.exception("generation of request %s failed", job.id)
            self.runner.reset()
            out.failed(e)
            return
        finally:
            gen.close()
            self._snapshot_experts()
            if self.profile is not None:
                self.profile.tick()
        if out.done is None:  # stopped by cancel()
            self.telemetry.request_done(job.endpoint, "cancelled")
        else:
            out.answer()

    def _serve_slots(self, batch: BatchRunner) -> None:
        """--parallel N: each step admits waiting requests to free slots (first come, first served) and runs one
        forward over every busy slot; a request whose client left leaves its slot at the next step."""
        while True:
            with self._cv:
                idle = not self._idle(lambda: bool(self._waiting or batch.busy or batch.in_flight))
                if self._stopping:
                    return
                admit = []
                while self._waiting and len(admit) < batch.free:
                    admit.append(self._waiting.popleft())
            if idle:
                self._check_links()
                continue
            for job in admit:
                self._admit(batch, job)
            try:
                steps = batch.step()
            except Exception:  # never let a step end the worker
                log.exception("a step failed")
                steps = []
            ended = [j for j in self.running if j.cancelled.is_set() or j.finished]
            with self._cv:
                self.running = [j for j in self.running if j not in ended]
                self.active = self.running[0] if self.running else None
            for st in steps:
                self.rows.add(st.rows)
                extra = {"tokens": st.decode_rows, "rows": st.rows, "slots": st.busy}
                if st.decode_rows:
                    self._record("step", st.ms, st.index, extra, report=st.stages)
                else:
                    extra = {"rows": st.rows, "slots": st.busy}
                    self._record("prompt_chunk", st.ms, st.index, extra, st.rows, st.stages)
            if ended:
                self._snapshot_experts(force=not self.running)
                if self.profile is not None:
                    self.profile.tick()
            for job in ended:
                out = self._outputs.pop(job.id)
                if out.done is not None and not job.cancelled.is_set():
                    out.answer()
                elif not job.finished:  # its client left while it ran: its slot is free again
                    self.telemetry.request_done(job.endpoint, "cancelled")

    def _admit(self, batch: BatchRunner, job: Job) -> None:
        if job.cancelled.is_set():
            self.telemetry.request_done(job.endpoint, "cancelled")
            return
        out = _JobOutput(self, job)
        try:
            batch.admit(job.req, out.event, job.cancelled.is_set, out.failed)
        except GenerationError as e:
            out.refused(e)
            return
        self._outputs[job.id] = out
        with self._cv:
            self.running.append(job)
            self.active = self.running[0]

    def _record(
        self,
        kind: str,
        ms: float,
        at: int,
        extra: dict[str, Any],
        tokens: int = 0,
        report: list[dict[str, Any]] | None = None,
    ) -> None:
        """One decode step (`at`: its index) or prompt chunk (`at`: its first position) into the telemetry: the
        whole forward as stage 0 for one stage, each stage's own time from `stage_report()` for a split (`report`:
        the one a shared step took when it was read)."""
        tel = self.telemetry
        if self.stage_times is None or self.lm is None:
            parts = [(0, ms, extra)]
        else:
            if report is None:
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


class _JobOutput:
    """What one request's generation events become: its text (streamed or kept for the whole answer), the step
    and prompt-chunk telemetry of a request served alone, and at the end its answer or error."""

    def __init__(self, service: EngineService, job: Job) -> None:
        self.service, self.job = service, job
        job.started = time.perf_counter()
        self.queued_ms = (job.started - job.created) * 1e3
        self.parts: list[str] = []
        self.done: DoneEvent | None = None
        self.logprobs: list[tuple[int, TokenLogprob]] = []  # where the request asked for them
        self.sent = 0  # of those, streamed so far (each goes with the text that shows its token)

    def _text(self, text: str) -> None:
        if text:
            if self.job.stream:
                self.job.push("text", text, self._unsent())
            else:
                self.parts.append(text)

    def _unsent(self) -> list[tuple[int, TokenLogprob]]:
        out, self.sent = self.logprobs[self.sent :], len(self.logprobs)
        return out

    def event(self, ev: Event) -> None:
        job, svc = self.job, self.service
        if isinstance(ev, TokenEvent):
            job.generated += 1
            if ev.logprob is not None:
                self.logprobs.append((ev.token, ev.logprob))
            self._text(ev.text)
        elif isinstance(ev, TextEvent):
            self._text(ev.text)
        elif isinstance(ev, StepEvent):
            svc._record("step", ev.ms, ev.index, {"tokens": ev.tokens})
        elif isinstance(ev, PromptChunkEvent):
            if svc.batch is None:  # shared steps are recorded once, by the worker
                svc._record("prompt_chunk", ev.ms, ev.start, {}, ev.tokens)
        elif isinstance(ev, DoneEvent):
            self.done, job.finished = ev, True

    def answer(self) -> None:
        """After the done event (and after the usage profile took the request's counts): the whole answer, or the
        end of the stream."""
        assert self.done is not None
        svc, job = self.service, self.job
        svc.telemetry.request_done(job.endpoint, "ok", timings_dict(self.done.timings, self.queued_ms))
        if job.stream and self.sent < len(
            self.logprobs
        ):  # tokens whose text never showed (an end, a stop string)
            job.push("text", "", self._unsent())
        lps = self.logprobs if job.req.logprobs is not None else None
        job.push("done", Result("".join(self.parts), self.done, self.queued_ms, lps))

    def refused(self, e: GenerationError) -> None:
        self.job.finished = True
        self.service.telemetry.request_done(self.job.endpoint, "error")
        self.job.push("error", APIError(400, str(e), code="invalid_request"))

    def failed(self, e: BaseException) -> None:
        self.job.finished = True
        self.service.telemetry.request_done(self.job.endpoint, "error")
        if isinstance(e, self.service._stage_errors):  # a step of the slots through a worker that left
            self.job.push("error", _stage_failed(e))
            return
        self.job.push(
            "error",
            APIError(500, f"the generation failed: {type(e).__name__}: {e}", code="generation_failed"),
        )


def _stage_failed(e: BaseException) -> APIError:
    """A worker stopped, froze or was cut off: a 502 naming it; the next request reconnects."""
    return APIError(
        502,
        f"a remote stage failed: {e}; the server keeps running and reconnects on the next request "
        "(GET /health shows each stage)",
        code="stage_unavailable",
    )
