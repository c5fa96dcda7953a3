"""Ollama's API for the apps that speak it (Open WebUI and many others): /api/version, /api/tags, /api/ps,
/api/show, /api/generate and /api/chat, streamed as Ollama streams (one JSON object a line) unless `stream` is
false. The generation runs through the same path as the OpenAI routes (engine/serve/ollama_protocol.py maps the
requests)."""

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import gguf
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from engine.serve.errors import from_validation
from engine.serve.jobs import ClientGone, Job, Result
from engine.serve.ollama_protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from engine.serve.protocol import ChatCompletionRequest
from engine.serve.reasoning import AnswerParts
from engine.serve.tool_calls import ToolCall
from installer.version import __version__

if TYPE_CHECKING:
    from engine.serve.serving import EngineService

NDJSON = "application/x-ndjson"


def _iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat().replace("+00:00", "Z")


def add_ollama_routes(
    app: FastAPI, service: "EngineService", parse: Callable[[Request, type], Awaitable[Any]]
) -> None:
    def name() -> str:
        return f"{service.model_name}:latest"

    def details() -> dict[str, Any]:
        service.require_ready()
        lm = service.lm
        assert lm is not None
        params = sum(t.n_elements for t in lm.gguf.tensors.values())
        ftype = lm.gguf.get("general.file_type")
        return {
            "format": "gguf",
            "family": lm.config.arch,
            "families": [lm.config.arch],
            "parameter_size": f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M",
            "quantization_level": _quantization(ftype),
        }

    def model_entry() -> dict[str, Any]:
        lm = service.lm
        assert lm is not None
        st = lm.path.stat()
        return {
            "name": name(),
            "model": name(),
            "modified_at": _iso(st.st_mtime),
            "size": st.st_size,
            "digest": f"{st.st_size:x}{int(st.st_mtime):x}",  # stable for the file, not a content hash
            "details": details(),
        }

    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    async def tags() -> JSONResponse:
        return JSONResponse({"models": [model_entry()] if service.lm is not None else []})

    async def ps() -> JSONResponse:
        if service.lm is None:
            return JSONResponse({"models": []})
        entry = model_entry()
        on_card = service.lm.model.device.type == "cuda"
        entry.update(expires_at="2262-04-11T23:47:16Z", size_vram=entry["size"] if on_card else 0)
        return JSONResponse({"models": [entry]})

    async def show(request: Request) -> JSONResponse:
        r: OllamaShowRequest = await parse(request, OllamaShowRequest)
        service.check_model(r.model or r.name)
        d = details()
        lm = service.lm
        assert lm is not None
        arch = lm.config.arch
        info = {"general.architecture": arch, f"{arch}.context_length": lm.config.n_ctx_train,
                f"{arch}.block_count": lm.config.n_layer, f"{arch}.embedding_length": lm.config.n_embd}  # fmt: skip
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": lm.chat.template,
                "details": d,
                "model_info": info,
                "capabilities": ["completion"],
                "modified_at": _iso(lm.path.stat().st_mtime),
            }
        )

    def stats(res: Result, t0: float) -> dict[str, Any]:
        t = res.done.timings
        ns = 1_000_000
        return {
            "done": True,
            "done_reason": res.done.finish_reason,
            "total_duration": int((time.perf_counter() - t0) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": t.prompt_tokens,
            "prompt_eval_duration": int(t.prompt_ms * ns),
            "eval_count": t.generated_tokens,
            "eval_duration": int(t.generated_ms * ns),
        }

    async def run(request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        r = await parse(request, OllamaChatRequest if chat else OllamaGenerateRequest)
        service.check_model(r.model)
        service.require_ready()
        try:
            openai = r.as_openai()
        except ValidationError as e:  # what the chat route would refuse: a 400 naming the field
            raise from_validation(e) from None
        tools: list[str] = []
        think: bool | None = None
        if isinstance(openai, ChatCompletionRequest):
            gen = await run_in_threadpool(service.prepare_chat, openai)
            tools, think = openai.tool_names, service.reasoning_mode(openai, gen)
        else:
            gen, _ = await run_in_threadpool(service.prepare_completion, openai)
        job = Job("chat" if chat else "completions", gen, r.stream, asyncio.get_running_loop())

        def piece(text: str, **message: Any) -> dict[str, Any]:
            body = (
                {"message": {"role": "assistant", "content": text, **message}} if chat else {"response": text}
            )
            return {"model": name(), "created_at": _iso(), **body, "done": False}

        def ollama_calls(calls: list[ToolCall]) -> dict[str, Any]:
            return {
                "tool_calls": [
                    {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls
                ]
            }

        if not r.stream:
            try:
                res = await service.run_to_end(job, request.receive)
            except ClientGone:
                return Response(status_code=499)
            if not chat:
                return JSONResponse({**piece(res.text), **stats(res, t0)})
            m = service.chat_response(res, tools=tools, reasoning=think)["choices"][0]["message"]
            extra = {"thinking": m["reasoning_content"]} if m.get("reasoning_content") else {}
            calls = [
                ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []
            ]
            if calls:
                extra.update(ollama_calls(calls))
            return JSONResponse({**piece(m["content"] or "", **extra), **stats(res, t0)})

        parts = AnswerParts(tools, think, service.tool_format()) if chat else None

        def as_lines(found: list[tuple[str, Any]]) -> bytes:
            out = bytearray()
            for kind, value in found:
                obj = (piece(value) if kind == "text" else piece("", thinking=value) if kind == "reasoning"
                       else piece("", **ollama_calls([value])))  # fmt: skip
                out += json.dumps(obj, ensure_ascii=False).encode() + b"\n"
            return bytes(out)

        def line(item: tuple[Any, ...]) -> bytes:
            if item[0] == "text":
                return as_lines(parts.feed(item[1]) if parts is not None else [("text", item[1])])
            if item[0] == "error":
                obj = {"error": item[1].body()["error"]["message"]}
                return json.dumps(obj, ensure_ascii=False).encode() + b"\n"
            head = as_lines(parts.end()) if parts is not None else b""
            return head + json.dumps({**piece(""), **stats(item[1], t0)}, ensure_ascii=False).encode() + b"\n"

        service.submit(job)
        return StreamingResponse(service.relay(job, line), media_type=NDJSON)

    async def generate(request: Request) -> Response:
        return await run(request, chat=False)

    async def chat(request: Request) -> Response:
        return await run(request, chat=True)

    app.add_api_route("/api/version", version, methods=["GET"])
    app.add_api_route("/api/tags", tags, methods=["GET"])
    app.add_api_route("/api/ps", ps, methods=["GET"])
    app.add_api_route("/api/show", show, methods=["POST"])
    app.add_api_route("/api/generate", generate, methods=["POST"])
    app.add_api_route("/api/chat", chat, methods=["POST"])


def _quantization(ftype: object) -> str:
    """general.file_type (llama.cpp's LLAMA_FTYPE_*) as Ollama names the quantization: Q4_K_M, F16, ..."""
    try:
        return gguf.LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return "unknown"
