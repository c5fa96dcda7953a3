"""The FastAPI application: thin routes over `EngineService`, OpenAI-style errors for everything that goes wrong."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from engine.pipeline.generate import GenerationRequest
from engine.serve.anthropic_routes import add_anthropic_routes
from engine.serve.errors import APIError, from_validation
from engine.serve.jobs import ClientGone, Job, sse_event
from engine.serve.llama_routes import add_llama_completion, add_llama_routes
from engine.serve.middleware import ApiKeyMiddleware, BodyLimitMiddleware, BodyTooLarge
from engine.serve.ollama_routes import add_ollama_routes
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body
from engine.serve.responses_api import add_responses_routes
from engine.serve.serving import METRICS_CONTENT_TYPE, EngineService
from engine.serve.sse import EventStreamResponse
from installer.version import __version__

log = logging.getLogger("strata.serve")

M = TypeVar("M", bound=BaseModel)

_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completions",
    "/completions": "completions",
}
KEEPALIVE_S = 15.0


async def _parse(request: Request, model: type[M]) -> M:
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation(e) from None


def choices(gen: GenerationRequest, n: int) -> list[GenerationRequest]:
    """A request's n choices: generations of their own, choice i seeded with seed + i where a seed is given."""
    seed = gen.sampling.seed
    return [
        gen
        if i == 0
        else replace(gen, sampling=replace(gen.sampling, seed=None if seed is None else (seed + i) % 2**64))
        for i in range(n)
    ]


def create_app(service: EngineService, cors_origins: Sequence[str] = ()) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.hub.bind(asyncio.get_running_loop())
        service.start()
        yield
        service.hub.close()
        service.stop()
        await asyncio.to_thread(service.finish)  # the usage profile is saved once the worker is out

    app = FastAPI(
        title="PolyStrata engine",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )

    # ---- errors ---------------------------------------------------------------------------------------------

    def _error(request: Request, e: APIError) -> JSONResponse:
        endpoint = _ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            service.telemetry.request_done(endpoint, "rejected")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(request, e)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, e: BodyTooLarge) -> JSONResponse:
        mib = e.limit / (1 << 20)
        return _error(
            request,
            APIError(
                413,
                f"the request body is larger than the server's limit ({mib:g} MiB, --max-body-mib)",
                code="request_too_large",
            ),
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return _error(
            request, APIError(400, f"{param or 'request'}: {first['msg']}", code="invalid_value", param=param)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            msg = (
                f"there is no {request.method} {request.url.path} here; this server offers /v1/models, "
                "/v1/chat/completions, /v1/completions, /health, /metrics, /stats, /events, and llama-server's "
                "/completion, /tokenize, /detokenize, /props and /slots, and Ollama's /api/* (see docs/api.md)"
            )
            code = "not_found"
        elif e.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            msg, code = str(e.detail), None
        return JSONResponse(
            error_body(msg, "invalid_request_error" if e.status_code < 500 else "server_error", None, code),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(
            error_body(f"internal error: {type(e).__name__}: {e}", "server_error", None, "internal_error"),
            status_code=500,
        )

    # ---- routes ---------------------------------------------------------------------------------------------

    async def health() -> JSONResponse:
        return JSONResponse(service.health().model_dump(mode="json", exclude_unset=True))

    async def models() -> JSONResponse:
        return JSONResponse(service.models())

    async def model(model_id: str) -> JSONResponse:
        service.check_model_card(model_id)
        return JSONResponse(service.model_card())

    async def chat(request: Request) -> Response:
        r = await _parse(request, ChatCompletionRequest)
        service.check_model(r.model)
        service.require_ready()
        gen = await run_in_threadpool(service.prepare_chat, r)
        loop = asyncio.get_running_loop()
        if r.stream:
            job = Job("chat", gen, True, loop)
            service.submit(job)
            think = service.reasoning_mode(r, gen)
            return EventStreamResponse(
                service.stream(job, "chat", r.include_usage, tools=r.tool_names, reasoning=think)
            )
        try:
            res = await service.run_all(
                [Job("chat", g, False, loop) for g in choices(gen, r.choices)], request.receive
            )
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(
            service.chat_response(res, tools=r.tool_names, reasoning=service.reasoning_mode(r, gen))
        )

    async def completions(request: Request) -> Response:
        r = await _parse(request, CompletionRequest)
        service.check_model(r.model)
        service.require_ready()
        gen, echo = await run_in_threadpool(service.prepare_completion, r)
        loop = asyncio.get_running_loop()
        if r.stream:
            job = Job("completions", gen, True, loop)
            service.submit(job)
            return EventStreamResponse(service.stream(job, "completions", r.include_usage, echo))
        jobs = [Job("completions", g, False, loop) for g in choices(gen, r.choices)]
        try:
            res = await service.run_all(jobs, request.receive)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(service.completion_response(res, echo))

    async def metrics() -> Response:
        return Response(service.metrics(), media_type=METRICS_CONTENT_TYPE)

    async def stats(experts: str | None = None) -> JSONResponse:
        return JSONResponse(
            service.stats(experts_detail=experts == "full").model_dump(mode="json", exclude_unset=True)
        )

    async def events() -> EventStreamResponse:
        async def body() -> AsyncIterator[bytes]:
            with service.hub.subscribe() as q:
                yield b": connected\n\n"
                while True:
                    try:
                        ev = await asyncio.wait_for(q.get(), KEEPALIVE_S)
                    except TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    batch: list[dict[str, Any] | None] = [ev]
                    while not q.empty():
                        batch.append(q.get_nowait())
                    out = b"".join(sse_event(e) for e in batch if e is not None)
                    if out:
                        yield out
                    if None in batch:
                        return

        return EventStreamResponse(body())

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/health", health, methods=["GET"], include_in_schema=False)
    for prefix in ("/v1", ""):
        hidden = {"include_in_schema": prefix == "/v1"}
        app.add_api_route(f"{prefix}/models", models, methods=["GET"], **hidden)
        app.add_api_route(f"{prefix}/models/{{model_id:path}}", model, methods=["GET"], **hidden)
        app.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"], **hidden)
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"], **hidden)
    add_llama_routes(app, service, _parse)
    add_llama_completion(app, service, _parse)
    add_ollama_routes(app, service, _parse)
    add_anthropic_routes(app, service, _parse)
    add_responses_routes(app, service, _parse)
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/stats", stats, methods=["GET"])
    app.add_api_route("/events", events, methods=["GET"])

    # Outermost last: CORS (answers preflights) -> API key -> body limit -> routes.
    app.add_middleware(BodyLimitMiddleware, limit=service.opts.max_body_bytes)
    if service.opts.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=service.opts.api_key)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    return app
