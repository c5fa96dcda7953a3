"""Ollama's request bodies (/api/generate, /api/chat, /api/show), mapped onto the OpenAI requests this server runs:
one generation path, so the same answer whichever dialect asks. Fields as Ollama's docs/api.md gives them."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.serve.errors import FieldError
from engine.serve.protocol import MAX_STOP, ChatCompletionRequest, CompletionRequest, LlamaSampling


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class OllamaOptions(LlamaSampling):
    """`options`: the sampling ones are honoured; the runner's (context, batch, GPU, threads, memory) are this
    server's own flags and are accepted and left alone (`ignored_fields`)."""

    num_predict: Annotated[int, Field(ge=-2)] | None = None
    stop: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    # accepted, not acted on
    num_ctx: Any = None
    num_keep: Any = None
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    num_thread: Any = None
    penalize_newline: Any = None
    numa: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    vocab_only: Any = None
    use_mmap: Any = None
    use_mlock: Any = None

    def as_openai(self) -> dict[str, Any]:
        out = self.sampling_fields()
        if self.stop:
            out["stop"] = self.stop
        if self.num_predict is not None and self.num_predict > 0:
            out["max_tokens"] = self.num_predict
        return out


class _Generation(_Body):
    model: str | None = None
    stream: bool = True  # Ollama streams unless told not to
    options: OllamaOptions | None = None
    keep_alive: Any = None  # the model stays loaded as long as this server runs
    format: Any = None
    think: bool | None = None

    @model_validator(mode="after")
    def _not_yet(self) -> "_Generation":
        if self.format not in (None, "", "json") and not isinstance(self.format, dict):
            raise FieldError("format", 'format: give "json" or a JSON schema (an object)')
        if self.options is not None and self.options.num_predict == 0:
            raise FieldError("options.num_predict", "num_predict 0 is not supported: send -1 or more")
        return self

    def _extra(self) -> dict[str, Any]:
        out = self.options.as_openai() if self.options is not None else {}
        if self.format:  # the answer held to JSON: any object ("json") or the schema given
            out["json_schema"] = self.format if isinstance(self.format, dict) else {"type": "object"}
        return out


class OllamaGenerateRequest(_Generation):
    prompt: str = ""
    system: str | None = None
    raw: bool = False  # the prompt as it is, without the chat template
    images: list[Any] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> "OllamaGenerateRequest":
        for name in ("images", "suffix", "template", "context"):
            if getattr(self, name):
                raise FieldError(name, f"{name} is not supported: leave it out")
        return self

    def as_openai(self) -> ChatCompletionRequest | CompletionRequest:
        """raw: a completion of the prompt as it is; else the prompt (and system) as a chat turn, as Ollama puts
        it through the model's template."""
        if self.raw:
            return CompletionRequest.model_validate({"prompt": self.prompt, **self._extra()}, strict=False)
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.prompt}
        ]
        return _chat(messages, self.think, self._extra())


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    thinking: str | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None


class OllamaChatRequest(_Generation):
    messages: Annotated[list[OllamaMessage], Field(min_length=1)]
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> "OllamaChatRequest":
        for i, m in enumerate(self.messages):
            if m.images:
                raise FieldError(
                    f"messages.{i}.images", "images are not supported: this server runs text models"
                )
        return self

    def as_openai(self) -> ChatCompletionRequest:
        """Ollama's tool calls (arguments as objects, no ids) become OpenAI's: each call gets an id, and a tool
        message answers the latest call of its `tool_name` (else the latest call)."""
        messages: list[dict[str, Any]] = []
        calls: list[tuple[str, str]] = []  # (id, name) of the calls so far
        for m in self.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                out = []
                for c in m.tool_calls:
                    f = c.get("function", {}) if isinstance(c, dict) else {}
                    cid = f"call_{len(calls)}"
                    calls.append((cid, f.get("name", "")))
                    args = f.get("arguments", {})
                    out.append({"id": cid, "type": "function", "function": {
                        "name": f.get("name", ""), "arguments": args if isinstance(args, str) else json.dumps(args)}})  # fmt: skip
                msg["tool_calls"] = out
            if m.role == "tool":
                named = (
                    [cid for cid, n in calls if n == m.tool_name] or [cid for cid, _ in calls] or ["call_0"]
                )
                msg["tool_call_id"] = named[-1]
            messages.append(msg)
        extra = self._extra()
        if self.tools:
            extra["tools"] = self.tools
        return _chat(messages, self.think, extra)


class OllamaShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool | None = None


def _chat(messages: list[dict[str, Any]], think: bool | None, extra: dict[str, Any]) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": messages, **extra}
    if think is not None:
        body["chat_template_kwargs"] = {"enable_thinking": think}
    return ChatCompletionRequest.model_validate(body, strict=False)
