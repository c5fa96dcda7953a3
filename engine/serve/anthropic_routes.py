"""POST /v1/messages: Anthropic's Messages API over the same generation as the OpenAI routes, whole or streamed as
Anthropic streams it (message_start, content blocks of text, thinking and tool_use with their deltas,
message_delta with the stop reason and usage, message_stop). The key may come as `x-api-key`, as Anthropic's
clients send it (engine/serve/middleware.py)."""

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.serve.anthropic_protocol import STOP_REASONS, MessagesRequest, message_from_chat
from engine.serve.jobs import ClientGone, Result
from engine.serve.protocol import new_id
from engine.serve.reasoning import AnswerParts
from engine.serve.tool_calls import CallFormat, ToolCall

if TYPE_CHECKING:
    from engine.serve.serving import EngineService


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


class MessageStream:
    """A streamed answer's items as Anthropic's events: text and reasoning go into content blocks opened as they
    start, each tool call becomes a tool_use block with its input as one input_json_delta."""

    def __init__(
        self, msg_id: str, model: str, input_tokens: int, tools: Sequence[str], think: bool | None,
        fmt: CallFormat | None = None,
    ):  # fmt: skip
        self.parts = AnswerParts(tools, think, fmt)
        self.index = -1
        self.open: str | None = None  # the kind of the block open now
        self.n_calls = 0
        self.start = _event("message_start", {"message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }})  # fmt: skip

    def encode(self, item: tuple[Any, ...]) -> bytes:
        if item[0] == "text":
            return self._pieces(item[1], final=False)
        if item[0] == "error":
            return _event(
                "error", {"error": {"type": "api_error", "message": item[1].body()["error"]["message"]}}
            )
        res: Result = item[1]
        out = self._pieces("", final=True) + self._close()
        finish = "tool_calls" if self.n_calls else res.done.finish_reason
        out += _event("message_delta", {"delta": {"stop_reason": STOP_REASONS.get(finish, "end_turn"),
                                                  "stop_sequence": None},
                                        "usage": {"output_tokens": res.done.timings.generated_tokens}})  # fmt: skip
        return out + _event("message_stop", {})

    def _pieces(self, text: str, final: bool) -> bytes:
        parts = self.parts.feed(text) if text else []
        if final:
            parts += self.parts.end()
        out = bytearray()
        for kind, value in parts:
            if kind == "reasoning":
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": value})
            elif kind == "text":
                out += self._delta("text", {"type": "text_delta", "text": value})
            else:
                c: ToolCall = value
                out += self._close()
                self.index += 1
                block = {"type": "tool_use", "id": new_id("toolu"), "name": c.name, "input": {}}
                out += _event("content_block_start", {"index": self.index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": c.arguments}
                out += _event("content_block_delta", {"index": self.index, "delta": delta})
                out += _event("content_block_stop", {"index": self.index})
                self.n_calls += 1
        return bytes(out)

    def _delta(self, kind: str, delta: dict[str, Any]) -> bytes:
        out = b""
        if self.open != kind:
            out += self._close()
            self.index += 1
            self.open = kind
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": ""}
            out += _event("content_block_start", {"index": self.index, "content_block": block})
        return out + _event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":  # Anthropic's clients expect a signature; this server signs nothing
            out += _event("content_block_delta", {"index": self.index,
                                                  "delta": {"type": "signature_delta", "signature": ""}})  # fmt: skip
        self.open = None
        return out + _event("content_block_stop", {"index": self.index})


def add_anthropic_routes(
    app: FastAPI, service: "EngineService", parse: Callable[[Request, type], Awaitable[Any]]
) -> None:
    async def messages(request: Request) -> Response:
        r: MessagesRequest = await parse(request, MessagesRequest)
        chat, job, think = await service.dialect_chat(r, r.stream)
        gen = job.req
        msg_id = new_id("msg")
        if not r.stream:
            try:
                res = await service.run_to_end(job, request.receive)
            except ClientGone:
                return Response(status_code=499)
            whole = service.chat_response(res, tools=chat.tool_names, reasoning=think)
            return JSONResponse(
                message_from_chat(whole["choices"][0], service.model_name, msg_id, whole["usage"])
            )
        enc = MessageStream(
            msg_id, service.model_name, len(gen.prompt), chat.tool_names, think, service.tool_format()
        )
        service.submit(job)

        async def body() -> AsyncIterator[bytes]:
            yield enc.start + _event("ping", {})
            async for chunk in service.relay(job, enc.encode):
                yield chunk

        return StreamingResponse(body(), media_type="text/event-stream")

    app.add_api_route("/v1/messages", messages, methods=["POST"])
