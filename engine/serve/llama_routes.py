"""llama-server's own routes, for the clients and scripts written against it: /completion, /tokenize, /detokenize,
/props and /slots (shapes as llama.cpp's tools/server README gives them; the fields this engine has no counterpart for are
left out rather than faked)."""

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.serve.errors import APIError
from engine.serve.jobs import ClientGone, Job, Result, sse_event
from engine.serve.protocol import DetokenizeRequest, LlamaCompletionRequest, TokenizeRequest, timings_dict
from engine.serve.sse import EventStreamResponse
from installer.engine_options import SAMPLING
from installer.version import __version__

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from engine.serve.serving import EngineService


def add_llama_routes(
    app: FastAPI, service: "EngineService", parse: "Callable[[Request, type], Awaitable[Any]]"
) -> None:
    def tokenizer() -> Any:
        service.require_ready()
        assert service.lm is not None
        return service.lm.tokenizer

    async def tokenize(request: Request) -> JSONResponse:
        r: TokenizeRequest = await parse(request, TokenizeRequest)
        tok = tokenizer()
        if tok.min_tokens(r.content) > 1 << 20:
            raise APIError(400, "content is over a million tokens: send it in parts", code="invalid_value")
        ids = await run_in_threadpool(tok.encode, r.content, r.add_special, r.parse_special)
        if not r.with_pieces:
            return JSONResponse({"tokens": ids})
        pieces = []
        for i in ids:
            raw = tok.token_to_bytes(i)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
                piece = list(raw)
            pieces.append({"id": i, "piece": piece})
        return JSONResponse({"tokens": pieces})

    async def detokenize(request: Request) -> JSONResponse:
        r: DetokenizeRequest = await parse(request, DetokenizeRequest)
        tok = tokenizer()
        bad = [i for i in r.tokens if i >= tok.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token ids {bad[:5]} are outside the vocabulary (0..{tok.vocab_size - 1})",
                code="invalid_value",
                param="tokens",
            )
        return JSONResponse({"content": await run_in_threadpool(tok.decode, r.tokens)})

    def params() -> dict[str, Any]:
        return {
            "temperature": SAMPLING.temperature,
            "top_k": SAMPLING.top_k,
            "top_p": SAMPLING.top_p,
            "min_p": SAMPLING.min_p,
            "repeat_penalty": SAMPLING.repeat_penalty,
            "repeat_last_n": SAMPLING.repeat_last_n,
            "presence_penalty": SAMPLING.presence_penalty,
            "frequency_penalty": SAMPLING.frequency_penalty,
        }

    def slot_rows() -> list[dict[str, Any]]:
        ctx = service.opts.max_context
        if service.batch is not None:
            return [
                {
                    "id": s["index"],
                    "n_ctx": ctx,
                    "is_processing": s["state"] != "idle",
                    "state": s["state"],
                    "n_past": s["tokens"],
                    "tokens_per_second": round(float(s["tokens_per_second"]), 2),  # type: ignore[arg-type]
                    "params": params(),
                }
                for s in service.batch.slot_report()
            ]
        busy = service.active is not None
        return [{"id": 0, "n_ctx": ctx, "is_processing": busy, "state": "decode" if busy else "idle",
                 "params": params()}]  # fmt: skip

    async def props() -> JSONResponse:
        service.require_ready()
        lm = service.lm
        assert lm is not None
        return JSONResponse(
            {
                "default_generation_settings": {"n_ctx": service.opts.max_context, "params": params()},
                "total_slots": len(service.batch.slots) if service.batch is not None else 1,
                "model_path": str(lm.path),
                "chat_template": lm.chat.template,
                "modalities": {"vision": False, "audio": False},
                "build_info": f"polystrata {__version__}",
            }
        )

    async def slots() -> JSONResponse:
        service.require_ready()
        return JSONResponse(slot_rows())

    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/props", props, methods=["GET"])
    app.add_api_route("/slots", slots, methods=["GET"])


def add_llama_completion(
    app: FastAPI, service: "EngineService", parse: "Callable[[Request, type], Awaitable[Any]]"
) -> None:
    """POST /completion: llama-server's native completion, whole or streamed as its `data: {"content", "stop"}`
    events (no [DONE]), with its counts and timings."""

    def final(res: Result) -> dict[str, Any]:
        t = res.done.timings
        return {
            "content": "",
            "stop": True,
            "model": service.model_name,
            "tokens_predicted": t.generated_tokens,
            "tokens_evaluated": t.prompt_tokens,
            "tokens_cached": t.prompt_cached,
            "stopped_limit": res.done.finish_reason == "length",
            "truncated": False,
            "timings": timings_dict(t, res.queued_ms),
        }

    def event(item: tuple[Any, ...]) -> bytes:
        if item[0] == "text":
            return sse_event({"content": item[1], "stop": False})
        return sse_event(item[1].body() if item[0] == "error" else final(item[1]))

    async def completion(request: Request) -> Response:
        r: LlamaCompletionRequest = await parse(request, LlamaCompletionRequest)
        service.require_ready()
        gen, _ = await run_in_threadpool(service.prepare_completion, r.as_openai())
        job = Job("completions", gen, r.stream, asyncio.get_running_loop())
        if r.stream:
            service.submit(job)
            return EventStreamResponse(service.relay(job, event))
        try:
            res = await service.run_to_end(job, request.receive)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse({**final(res), "content": res.text})

    app.add_api_route("/completion", completion, methods=["POST"])
