"""OpenAI's Responses API (POST /v1/responses), as Codex-style clients and the official `openai` client send it:
the request mapped onto the chat request the engine serves, the answer back as a response of output items
(reasoning, message, function_call), whole or as the Responses stream of typed events. Nothing is stored: a
request gives its whole conversation in `input` (previous_response_id is refused with a message saying so)."""

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, model_validator

from engine.serve.jobs import ClientGone, Result
from engine.serve.protocol import ChatCompletionRequest, FieldError, _Strict, new_id, reasoning_effort
from engine.serve.reasoning import AnswerParts
from engine.serve.tool_calls import CallFormat, ToolCall

if TYPE_CHECKING:
    from engine.serve.serving import EngineService


class _Item(_Strict):
    """An input item: a message (role and content) or a function call and its output. Items a client echoes back
    from an earlier response carry more fields: accepted and not acted on."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | Annotated[list[_Item], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}
    previous_response_id: str | None = None
    background: bool | None = None
    # accepted and not acted on: storage, caching, account and tracing options of OpenAI's service
    store: Any = None
    metadata: Any = None
    user: Any = None
    include: Any = None
    truncation: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    stream_options: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    access_programs: Any = None
    moderation: Any = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    image: Any = None

    @model_validator(mode="after")
    def _refused(self) -> "ResponsesRequest":
        if self.previous_response_id:
            raise FieldError("previous_response_id", "this server stores no responses: send the whole "
                             "conversation in input")  # fmt: skip
        if self.background:
            raise FieldError("background", "background responses are not supported: leave background out")
        for i, t in enumerate(self.tools or ()):
            if t.get("type") != "function" or not t.get("name"):
                raise FieldError(
                    f"tools.{i}", "only function tools (type function, with a name) are supported"
                )
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            for part in item.content if isinstance(item.content, list) else []:
                if part.get("type") not in ("input_text", "output_text", "text", "refusal"):
                    raise FieldError(f"input.{i}.content", f"{part.get('type')} parts are not supported: this "
                                     "server reads text")  # fmt: skip
        return self

    def as_openai(self) -> ChatCompletionRequest:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [_Item(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments or "{}"}}  # fmt: skip
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            elif item.type == "message":
                role = "system" if item.role == "developer" else item.role or "user"
                messages.append({"role": role, "content": _text(item.content)})
            # reasoning items and others a client echoes back: the template sees the answers only
        body: dict[str, Any] = {"messages": messages}
        for ours, theirs in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                             ("top_p", self.top_p), ("parallel_tool_calls", self.parallel_tool_calls)):  # fmt: skip
            if theirs is not None:
                body[ours] = theirs
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                  "parameters": t.get("parameters") or {"type": "object"}}}
                for t in self.tools
            ]  # fmt: skip
        c = self.tool_choice
        if isinstance(c, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": c.get("name")}}
        elif c is not None and (
            self.tools or c not in ("auto", "none")
        ):  # a call forced with no tools: refused
            body["tool_choice"] = c
        fmt = (self.text or {}).get("format") or {}
        if fmt.get("type") == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}}  # fmt: skip
        effort = (self.reasoning or {}).get("effort")
        if effort:
            body["reasoning_effort"] = reasoning_effort(effort)
        return ChatCompletionRequest.model_validate(body, strict=False)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))


def _message(text: str) -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def _call(c: ToolCall, call_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id or new_id("call"), "name": c.name,
            "arguments": c.arguments, "status": "completed"}  # fmt: skip


def _reasoning(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def response_object(
    r: ResponsesRequest, model: str, resp_id: str, created: float, output: list[dict[str, Any]], status: str,
    finish: str | None, usage: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """A response as the API gives it: its output items, how it ended and the request's settings."""
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    return {
        "id": resp_id, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if incomplete and status == "completed" else status,
        "incomplete_details": incomplete, "error": None, "output": output,
        "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
        "parallel_tool_calls": r.parallel_tool_calls is not False, "tool_choice": r.tool_choice or "auto",
        "tools": r.tools or [], "temperature": r.temperature, "top_p": r.top_p,
        "text": r.text or {"format": {"type": "text"}}, "reasoning": r.reasoning, "store": False,
        "metadata": r.metadata if isinstance(r.metadata, dict) else {}, "usage": usage,
    }  # fmt: skip


def usage_of(res: Result) -> dict[str, Any]:
    t = res.done.timings
    return {"input_tokens": t.prompt_tokens, "input_tokens_details": {"cached_tokens": t.prompt_cached},
            "output_tokens": t.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": t.prompt_tokens + t.generated_tokens}  # fmt: skip


class EventStream:
    """A streamed answer as the Responses API's events, each with its sequence number: the response created and in
    progress, then per output item its added / delta / done events (reasoning text, output text, function call
    arguments), then the completed response with every item and the usage."""

    def __init__(
        self, r: ResponsesRequest, model: str, tools: Sequence[str], think: bool | None,
        fmt: CallFormat | None = None,
    ) -> None:  # fmt: skip
        self.r, self.model = r, model
        self.id, self.created = new_id("resp"), time.time()
        self.parts = AnswerParts(tools, think, fmt)
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the message or reasoning item being written

    def event(self, kind: str, **data: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    def start(self) -> bytes:
        resp = response_object(self.r, self.model, self.id, self.created, [], "in_progress", None, None)
        return self.event("response.created", response=resp) + self.event(
            "response.in_progress", response=resp
        )

    def encode(self, item: tuple[Any, ...]) -> bytes:
        if item[0] == "text":
            return self._parts(self.parts.feed(item[1]))
        if item[0] == "error":
            err = item[1].body()["error"]
            return self.event("error", code=err.get("code"), message=err["message"], param=err.get("param"))
        res: Result = item[1]
        out = self._parts(self.parts.end()) + self._close()
        resp = response_object(self.r, self.model, self.id, self.created, self.items, "completed",
                               res.done.finish_reason, usage_of(res))  # fmt: skip
        return out + self.event("response.completed", response=resp)

    def _parts(self, parts: list[tuple[str, Any]]) -> bytes:
        out = bytearray()
        for kind, value in parts:
            if kind == "call":
                out += self._close()
                item = _call(value)
                n = len(self.items)
                self.items.append(item)
                out += self.event("response.output_item.added", output_index=n, item={**item, "arguments": "",
                                                                                        "status": "in_progress"})  # fmt: skip
                out += self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=n,
                                  delta=item["arguments"])  # fmt: skip
                out += self.event("response.function_call_arguments.done", item_id=item["id"], output_index=n,
                                  arguments=item["arguments"], name=item["name"])  # fmt: skip
                out += self.event("response.output_item.done", output_index=n, item=item)
                continue
            out += self._open(kind)
            assert self.open is not None
            n, part = len(self.items) - 1, self.open["content"][0]
            part["text"] += value
            delta = "response.output_text.delta" if kind == "text" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "text" else {}
            out += self.event(
                delta, item_id=self.open["id"], output_index=n, content_index=0, delta=value, **extra
            )
        return bytes(out)

    def _open(self, kind: str) -> bytes:
        want = "message" if kind == "text" else "reasoning"
        if self.open is not None and self.open["type"] == want:
            return b""
        out = self._close()
        item = _message("") if want == "message" else _reasoning("")
        self.open = item
        self.items.append(item)
        n = len(self.items) - 1
        out += self.event("response.output_item.added", output_index=n,
                          item={**item, "status": "in_progress", "content": []})  # fmt: skip
        part = item["content"][0]
        out += self.event("response.content_part.added", item_id=item["id"], output_index=n, content_index=0,
                          part={**part, "text": ""})  # fmt: skip
        return out

    def _close(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        n, part = len(self.items) - 1, item["content"][0]
        done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        out = self.event(
            done, item_id=item["id"], output_index=n, content_index=0, text=part["text"], **extra
        )
        out += self.event("response.content_part.done", item_id=item["id"], output_index=n, content_index=0,
                          part=part)  # fmt: skip
        return out + self.event("response.output_item.done", output_index=n, item=item)


def add_responses_routes(
    app: FastAPI, service: "EngineService", parse: Callable[[Request, type], Awaitable[Any]]
) -> None:
    async def responses(request: Request) -> Response:
        r: ResponsesRequest = await parse(request, ResponsesRequest)
        chat, job, think = await service.dialect_chat(r, r.stream)
        if not r.stream:
            created = time.time()
            try:
                res = await service.run_to_end(job, request.receive)
            except ClientGone:
                return Response(status_code=499)
            m = service.chat_response(res, tools=chat.tool_names, reasoning=think)["choices"][0]["message"]
            output = [_reasoning(m["reasoning_content"])] if m.get("reasoning_content") else []
            if m.get("content"):
                output.append(_message(m["content"]))
            for c in m.get("tool_calls") or []:
                output.append(_call(ToolCall(c["function"]["name"], c["function"]["arguments"]), c["id"]))
            return JSONResponse(response_object(r, service.model_name, new_id("resp"), created, output,
                                                "completed", res.done.finish_reason, usage_of(res)))  # fmt: skip
        enc = EventStream(r, service.model_name, chat.tool_names, think, service.tool_format())
        service.submit(job)

        async def body() -> AsyncIterator[bytes]:
            yield enc.start()
            async for chunk in service.relay(job, enc.encode):
                yield chunk

        return StreamingResponse(body(), media_type="text/event-stream")

    app.add_api_route("/v1/responses", responses, methods=["POST"])
    app.add_api_route("/responses", responses, methods=["POST"])
