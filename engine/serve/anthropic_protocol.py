"""Anthropic's Messages API (POST /v1/messages), as Claude Code-style clients and the official `anthropic` client
send it: its request mapped onto the OpenAI chat request the engine serves, and the answer back as a message of
content blocks (text, thinking, tool_use)."""

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from engine.serve.protocol import MAX_STOP, ChatCompletionRequest, FieldError, _Strict, reasoning_effort


class _Block(_Strict):
    """A content block. Blocks a client echoes back from an earlier answer carry fields that grow with Anthropic's
    API (`caller`, citations, ...): those are accepted and not acted on."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    type: Literal["text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    source: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    citations: Any = None


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[_Block]


class AnthropicTool(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_\-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom"
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[_Block] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}
    output_config: dict[str, Any] | None = (
        None  # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}
    )
    # accepted and not acted on: account, caching and routing options of Anthropic's service
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: Any = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None

    @model_validator(mode="after")
    def _refused(self) -> "MessagesRequest":
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else []):
                if b.type in ("image", "document"):
                    raise FieldError(f"messages.{i}.content.{j}", f"{b.type} blocks are not supported: this "
                                     "server runs text models")  # fmt: skip
        c = self.tool_choice
        if c is not None and c.type == "tool" and c.name not in {t.name for t in self.tools or ()}:
            raise FieldError("tool_choice", f"tool_choice names {c.name!r}, which is not in tools")
        return self

    def as_openai(self) -> ChatCompletionRequest:
        """The OpenAI chat request this is: system first, tool_use blocks as assistant tool calls, tool_result
        blocks as tool messages, thinking blocks dropped (the template sees the answers)."""
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system)})
        for m in self.messages:
            blocks = [_Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            if m.role == "assistant":
                calls = [
                    {"id": b.id, "type": "function",
                     "function": {"name": b.name, "arguments": json.dumps(b.input or {})}}
                    for b in blocks if b.type == "tool_use"
                ]  # fmt: skip
                msg: dict[str, Any] = {"role": "assistant", "content": _text(blocks) or None}
                if calls:
                    msg["tool_calls"] = calls
                messages.append(msg)
                continue
            for b in blocks:
                if b.type == "tool_result":
                    messages.append(
                        {"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
                    )
            text = _text([b for b in blocks if b.type == "text"])
            if text or not any(b.type == "tool_result" for b in blocks):
                messages.append({"role": "user", "content": text})
        body: dict[str, Any] = {"messages": messages, "max_tokens": self.max_tokens}
        for ours, theirs in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k)):
            if theirs is not None:
                body[ours] = theirs
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [
                {"type": "function",
                 "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
                for t in self.tools
            ]  # fmt: skip
        c = self.tool_choice
        if c is not None and (
            self.tools or c.type in ("any", "tool")
        ):  # a call forced with no tools: refused
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or {
                "type": "function",
                "function": {"name": c.name},
            }
            if c.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.get("type") == "enabled"}
        oc = self.output_config or {}
        fmt = oc.get("format")
        if fmt:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.get("schema")},
            }
        if oc.get("effort"):
            body["reasoning_effort"] = reasoning_effort(oc["effort"])
        return ChatCompletionRequest.model_validate(body, strict=False)


def _text(content: Any) -> str:
    """The text of a string or of text blocks (a tool result's content is either)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for b in content:
        kind, text = (b.type, b.text) if isinstance(b, _Block) else (b.get("type"), b.get("text"))
        if kind == "text" and text:
            parts.append(text)
    return "\n".join(parts)


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def message_from_chat(
    choice: dict[str, Any], model: str, msg_id: str, usage: dict[str, int]
) -> dict[str, Any]:
    """An OpenAI chat choice (the engine's answer) as an Anthropic message."""
    m = choice["message"]
    content: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    for c in m.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": c["id"].replace("call_", "toolu_", 1), "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])})  # fmt: skip
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
    }
