"""The OpenAI wire format: request models (strict: unknown fields, wrong types and values are refused) and the
dicts of responses and stream chunks.

Requests accept every documented OpenAI field that a client may send (`user`, `stream_options`, `logprobs`, ...);
fields we cannot honour are accepted at their neutral value (`logprobs: false`, `n: 1`) and refused otherwise with a
message that says so. llama-server's extensions that map onto our sampler are accepted too
(`top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`, `ignore_eos`, `cache_prompt`, `chat_template_kwargs`).
"""

import json
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

if TYPE_CHECKING:  # torch loads in the background, after the server already answers /health
    from engine.pipeline.generate import Timings

MAX_STOP = 16
MAX_CHOICES = 16  # n: choices one request may ask for (each a generation of its own, sharing the slots)


class FieldError(ValueError):
    """A refused value; `param` names the field (model-level checks have no location of their own)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# ---- messages -------------------------------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


class _MediaPart(BaseModel):
    """An image, audio or file part: valid OpenAI, refused by us with a clear message (text-only models)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file"]


UserPart = Annotated[TextPart | _MediaPart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system"]
    content: str | list[TextPart]
    name: str | None = None


class DeveloperMessage(_Strict):
    role: Literal["developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, list):
            for p in v:
                if isinstance(p, _MediaPart):
                    raise ValueError(
                        f"content part type {p.type!r} is not supported: this server reads text only; "
                        "send text parts ({'type': 'text', 'text': ...})"
                    )
        return v


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    audio: None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


Message = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


def _text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


def _arguments(raw: str) -> Any:
    """Chat templates expect a tool call's arguments as a mapping (they `tojson` it); keep other text as is."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, dict) else raw


def template_message(m: BaseModel) -> dict[str, Any]:
    """One message as chat templates expect it: role, content as a string, tool calls with parsed arguments."""
    if isinstance(m, AssistantMessage):
        out: dict[str, Any] = {"role": "assistant", "content": _text(m.content) or (m.refusal or "")}
        if m.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
    elif isinstance(m, ToolMessage):
        out = {"role": "tool", "content": _text(m.content), "tool_call_id": m.tool_call_id}
    elif isinstance(m, DeveloperMessage):
        out = {"role": "system", "content": _text(m.content)}  # templates know "system", not "developer"
    else:
        out = {"role": m.role, "content": _text(m.content)}  # type: ignore[attr-defined]
    name = getattr(m, "name", None)
    if name:
        out["name"] = name
    return out


# ---- tools ----------------------------------------------------------------------------------------------------


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _NamedFunction


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


# ---- requests -------------------------------------------------------------------------------------------------


class OtherSamplers(BaseModel):
    """The samplers llama.cpp has and this engine does not: accepted and not acted on (`ignored_fields`) wherever
    a client of llama-server or Ollama may send them."""

    typical_p: Any = None
    tfs_z: Any = None
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None

    @classmethod
    def ignored_fields(cls) -> list[str]:
        return [name for name, f in cls.model_fields.items() if f.annotation is Any]


class LlamaOptions(OtherSamplers):
    """Options of llama-server's samplers, slots and output that clients written for it send, often at their
    defaults: accepted and not acted on, on its own route and on the OpenAI ones."""

    n_keep: Any = None
    min_keep: Any = None
    samplers: Any = None
    dynatemp_range: Any = None
    dynatemp_exponent: Any = None
    xtc_probability: Any = None
    xtc_threshold: Any = None
    dry_multiplier: Any = None
    dry_base: Any = None
    dry_allowed_length: Any = None
    dry_penalty_last_n: Any = None
    dry_sequence_breakers: Any = None
    id_slot: Any = None
    t_max_predict_ms: Any = None
    t_max_prompt_ms: Any = None
    return_tokens: Any = None
    timings_per_token: Any = None
    post_sampling_probs: Any = None


class _Common(_Strict, LlamaOptions):
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    # llama-server's extensions
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool | None = None
    cache_prompt: bool | None = None
    grammar: str | None = None  # the output follows this GBNF (or Lark) grammar
    json_schema: dict[str, Any] | None = None  # the output is JSON valid against this schema
    n_predict: Annotated[int, Field(ge=-1)] | None = None  # llama-server's max_tokens (-1: no limit)
    # vLLM's names: the repeat penalty, and constrained output (a schema, a regex, a grammar, one of some strings)
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    # Accepted and not acted on (`ignored_fields`) besides llama-server's (LlamaOptions): vLLM's and Ollama's
    # options that clients written for them send. Other unknown fields are refused.
    keep_alive: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    top_a: Any = None

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n={v}: send 1 to {MAX_CHOICES} choices")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit():
                raise ValueError(
                    f'logit_bias key {key[:20]!r} is not a token id: give ids as strings, e.g. "50256"'
                )
        if v is not None and len(v) > 1024:
            raise ValueError(f"logit_bias has {len(v)} entries: at most 1024")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Common":
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream: true")
        if self.stream and (self.n or 1) > 1:
            raise FieldError("n", "n > 1 is answered whole for now: send stream false, or n 1 to stream")
        return self

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    # extension (llama-server): "none" keeps a <think> block in the content; the others split it off
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] | None = None
    # extension (vLLM, llama-server): extra variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        rf = self.response_format
        if (
            rf is not None
            and rf.type == "json_schema"
            and not isinstance((rf.json_schema or {}).get("schema"), dict)
        ):
            raise FieldError(
                "response_format",
                'response_format json_schema needs json_schema.schema, e.g. {"type": "json_schema", "json_schema": '
                '{"name": "answer", "schema": {"type": "object", ...}}}',
            )
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
            t.function.name for t in self.tools or ()
        }:
            raise FieldError(
                "tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
            )
        if (self.modalities and "audio" in self.modalities) or self.audio is not None:
            raise FieldError("modalities", "audio output is not supported: this server answers with text")
        if self.web_search_options is not None:
            raise FieldError("web_search_options", "web_search_options is not supported: leave it out")
        if self.functions is not None or self.function_call is not None:
            raise FieldError(
                "functions", "functions and function_call are deprecated and not supported: use tools"
            )
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise FieldError("tool_choice", "tool_choice needs tools: send tools or leave tool_choice out")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_names(self) -> dict[str, dict[str, Any]]:
        """The tools the model may call (none with tool_choice "none"), by name, with their parameters' JSON
        schema (the XML call formats type the arguments by it)."""
        if self.tool_choice == "none":
            return {}
        return {t.function.name: t.function.parameters or {} for t in self.tools or ()}

    @property
    def logprob_top(self) -> int | None:
        """Each token's log-probability and this many of the likeliest (None: none asked for)."""
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Common):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # the OpenAI default for completions
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        p = self.prompt
        if isinstance(p, list) and not p:
            raise FieldError("prompt", "prompt is an empty list: send a string or a list of token ids")
        if isinstance(p, list) and len(p) != 1 and isinstance(p[0], str | list):
            raise FieldError(
                "prompt",
                f"prompt is a batch of {len(p)} prompts: this server takes one prompt per request "
                "(a string, a list of one string, or a list of token ids)",
            )
        if isinstance(p, list) and p and isinstance(p[0], list) and not p[0]:
            raise FieldError("prompt", "prompt is an empty token list")
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported: leave it out")
        if self.best_of is not None and self.best_of != 1:
            raise FieldError("best_of", f"best_of={self.best_of} is not supported: send 1 or leave it out")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def logprob_top(self) -> int | None:
        """Each token's log-probability and this many of the likeliest (None: none asked for)."""
        return self.logprobs


# ---- llama-server's own routes (engine/serve/llama_routes.py) ----------------------------------------------------


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False  # BOS/EOS where the vocabulary adds them
    parse_special: bool = True  # control tokens written in the text become their ids
    with_pieces: bool = False  # each id with its text


class DetokenizeRequest(_Strict):
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)]


class Lenient(OtherSamplers):
    """A body in another server's dialect: its fields typed Any are accepted and not acted on (`ignored_fields`),
    any other unknown field is refused. The samplers llama.cpp has and this engine does not are common to them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LlamaSampling(Lenient):
    """The sampling fields llama.cpp's servers (llama-server, Ollama) name as this engine's sampler does."""

    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: int | None = None  # -1 (or any negative): random

    def sampling_fields(self) -> dict[str, Any]:
        """The OpenAI request's sampling fields for those given (a negative seed: none, a random one)."""
        names = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                 "frequency_penalty")  # fmt: skip
        out: dict[str, Any] = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.seed is not None and self.seed >= 0:
            out["seed"] = self.seed
        return out


class LlamaCompletionRequest(LlamaSampling, LlamaOptions):
    """llama-server's own POST /completion: the fields it honours are mapped onto the OpenAI completion's."""

    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    n_predict: Annotated[int, Field(ge=-2)] = -1  # -1: until the context or an end; -2 likewise
    stop: Annotated[list[str], Field(max_length=MAX_STOP)] = []
    stream: bool = False
    cache_prompt: bool = True
    ignore_eos: bool = False
    n_probs: Annotated[int, Field(ge=0)] = 0
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | list[Any] | None = None
    # accepted and not acted on besides LlamaOptions' (docs/api.md lists them all)
    n_indent: Any = None
    penalize_nl: Any = None
    response_fields: Any = None
    n_cmpl: Any = None

    @model_validator(mode="after")
    def _not_yet(self) -> "LlamaCompletionRequest":
        if self.n_predict == 0:
            raise FieldError(
                "n_predict", "n_predict 0 (read the prompt only) is not supported: send -1 or more"
            )
        if self.n_probs:
            raise FieldError("n_probs", "n_probs (token probabilities) is not supported yet: send 0")
        self._bias()  # its shape, checked here so that a bad one is a 400 naming it
        return self

    def _bias(self) -> dict[str, float]:
        """llama-server's logit_bias: {"id": bias} or [[id, bias], ...], a bias of false banning the token."""
        b = self.logit_bias
        pairs = b.items() if isinstance(b, dict) else b or []
        out = {}
        for pair in pairs:
            if not isinstance(pair, list | tuple) or len(pair) != 2 or not isinstance(pair[0], int | str):
                raise FieldError("logit_bias", 'logit_bias: give {"id": bias} or [[id, bias], ...]')
            bias = -100.0 if pair[1] is False else pair[1]
            if not isinstance(bias, int | float) or isinstance(bias, bool):
                raise FieldError(
                    "logit_bias", f"logit_bias for {pair[0]}: a number or false, not {pair[1]!r}"
                )
            out[str(pair[0])] = max(-100.0, min(100.0, float(bias)))
        return out

    def as_openai(self) -> "CompletionRequest":
        """The OpenAI completion this request is (the fields acted on)."""
        fields = self.sampling_fields()
        if self.logit_bias:
            fields["logit_bias"] = self._bias()
        return CompletionRequest.model_validate(
            {
                "prompt": self.prompt,
                "max_tokens": self.n_predict if self.n_predict > 0 else None,
                "stop": self.stop or None,
                "ignore_eos": self.ignore_eos,
                "cache_prompt": self.cache_prompt,
                "grammar": self.grammar or None,
                "json_schema": self.json_schema,
                **fields,
            },
            strict=False,
        )


# ---- responses ------------------------------------------------------------------------------------------------


def reasoning_effort(level: str) -> str:
    """Another API's effort level as the chat request's reasoning_effort (its two levels above high are high)."""
    return {"xhigh": "high", "max": "high"}.get(level, level)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage_dict(t: "Timings") -> dict[str, Any]:
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.generated_tokens,
        "total_tokens": t.prompt_tokens + t.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": t.prompt_cached},
    }


def timings_dict(t: "Timings", queued_ms: float = 0.0) -> dict[str, Any]:
    """llama-server's `timings`: prompt_n is the tokens read, cache_n those reused from the prompt cache."""
    read = t.prompt_tokens - t.prompt_cached
    return {
        "cache_n": t.prompt_cached,
        "prompt_n": read,
        "prompt_ms": round(t.prompt_ms, 3),
        "prompt_per_token_ms": round(t.prompt_ms / read, 3) if read else 0.0,
        "prompt_per_second": round(t.prompt_per_second, 3),
        "predicted_n": t.generated_tokens,
        "predicted_ms": round(t.generated_ms, 3),
        "predicted_per_token_ms": round(t.generated_ms / t.generated_tokens, 3)
        if t.generated_tokens
        else 0.0,
        "predicted_per_second": round(t.generated_per_second, 3),
        "queued_ms": round(queued_ms, 3),
        # verify windows (--spec), under llama-server's names: drafted tokens verified, and kept
        "draft_n": t.drafts_proposed,
        "draft_n_accepted": t.drafts_accepted,
    }


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- status: /health, /stats, /events ---------------------------------------------------------------------------
# What the server reports about itself, typed: the app (app/controllers/engine.py, stats.py, charts.py) reads these
# fields and tests/engine/serve/test_status_contract.py checks every key it reads against them. Optional fields are
# left out of the JSON where they do not apply (dumped with exclude_unset).


class _Status(BaseModel):
    model_config = ConfigDict(extra="forbid")


ServerStatus = Literal["loading", "ready", "degraded", "error"]


class QueueHealth(_Status):
    waiting: int
    active: int


class RemoteStageHealth(_Status):
    address: str
    status: str  # "ok" or "down: <why>"


class Health(_Status):
    status: ServerStatus
    model: str
    error: str | None
    queue: QueueHealth
    remote_stages: list[RemoteStageHealth] | None = None


class Series(_Status):
    """A series of times (ms): telemetry.stats.RunningStat.to_dict; None until the first value."""

    count: int
    total: float
    mean: float | None
    last: float | None
    min: float | None
    max: float | None
    recent: float | None


class ExpertCacheStats(_Status):
    in_vram: int | None
    total: int | None
    hits: int
    misses: int
    swaps: int
    bytes_moved: int
    computed_on_cpu: int
    cpu_share: float | None
    hit_rate: float | None


class StageStats(_Status):
    stage: int
    step_ms: Series
    prompt_chunk_ms: Series
    prompt_chunk_tokens: int
    expert_cache: ExpertCacheStats
    device: str | None = None
    layers: list[int] | None = None  # [begin, end)
    host: str | None = None  # a worker's address
    status: str | None = None  # a remote stage's link: "ok" or "down: <why>"
    # a split's waiting for the stage and transfers to it (engine/serve/stages.py link_stats)
    step_wait_ms: Series | None = None
    step_transfer_ms: Series | None = None
    prompt_chunk_wait_ms: Series | None = None
    prompt_chunk_transfer_ms: Series | None = None


class ActiveRequest(_Status):
    id: str
    endpoint: str
    prompt_tokens: int
    generated: int
    running_s: float


class QueueStats(_Status):
    waiting: int
    active: int
    max: int
    active_request: ActiveRequest | None


class Totals(_Status):
    requests: int
    prompt_tokens: int
    prompt_cached_tokens: int
    generated_tokens: int
    prompt_seconds: float
    decode_seconds: float


class RequestCount(_Status):
    endpoint: str
    outcome: str
    count: int


class RequestTimings(_Status):
    """llama-server's `timings` of one request (`timings_dict`)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    queued_ms: float
    draft_n: int
    draft_n_accepted: int


class LastRequest(RequestTimings):
    endpoint: str
    outcome: str
    t: float


class EventsStats(_Status):
    subscribers: int
    dropped: int


class GcStats(_Status):
    collections: list[int]  # per generation (0, 1, 2) since the server started
    pause_ms_total: float
    pause_ms_max: float
    frozen_objects: int  # left out of every collection (what the model's load made)


class PromptCacheStats(_Status):
    entries: int
    bytes: int
    max_bytes: int
    saves: int
    restores: int
    evictions: int
    restored_tokens: int


class ExpertsStats(_Status):
    n_expert: int
    n_expert_used: int
    routed: int
    in_vram: int
    selections_total: int
    selections_per_layer: list[int]
    cache: list[ExpertCacheStats]
    counts: list[list[int]] | None = None  # with ?experts=full


class SlotStats(_Status):
    index: int
    state: Literal["idle", "prompt", "decode"]
    tokens: int  # what its KV cache holds
    tokens_per_second: float  # the request it holds, since its first token


class SlotsStats(_Status):
    """--parallel: the slots requests are decoded in together (engine/pipeline/batch.py)."""

    total: int
    busy: int
    groups: int = 1  # --batch-groups: groups of slots pipelined through a remote stage
    rows_per_step: Series  # token rows per shared step
    slots: list[SlotStats]


class Stats(_Status):
    status: ServerStatus
    error: str | None
    model: str
    version: str
    uptime_s: float
    queue: QueueStats
    totals: Totals
    requests: list[RequestCount]
    last_request: LastRequest | None
    events: EventsStats
    stages: list[StageStats]
    gc: GcStats | None = None
    # once the model is loaded
    arch: str | None = None
    device: str | None = None
    dtype: str | None = None
    kv_type: str | None = None
    max_context: int | None = None
    kv_host_layers: list[int] | None = None  # the layers whose KV lives in host RAM (--kv-resident)
    n_layer: int | None = None
    prompt_cache: PromptCacheStats | None = None
    experts: ExpertsStats | None = None
    slots: SlotsStats | None = None


class _StageEvent(_Status):
    stage: int
    ms: float
    t: float
    # a split's stage details (engine/serve/stages.py): its layers ("0-23"), device, a worker's address, and the
    # stage's own compute, its waiting and the transfers
    layers: str | None = None
    device: str | None = None
    host: str | None = None
    compute_ms: float | None = None
    wait_ms: float | None = None
    transfer_ms: float | None = None
    tokens: int | None = None  # rows of a decode step (verify windows: more than one)
    rows: int | None = None  # --parallel: the step's token rows (every slot's decode row and prompt tokens)
    slots: int | None = None  # --parallel: slots holding a request during the step


class StepEvent(_StageEvent):
    type: Literal["step"]
    index: int | None = None  # the step's index in its request; with --parallel, in the server's shared steps


class PromptChunkEvent(_StageEvent):
    type: Literal["prompt_chunk"]
    tokens: int | None = None
    start: int | None = None  # the chunk's first position


class RequestEvent(RequestTimings):
    type: Literal["request"]
    endpoint: str
    outcome: str
    t: float


Event = Annotated[StepEvent | PromptChunkEvent | RequestEvent, Field(discriminator="type")]
EVENT: TypeAdapter[StepEvent | PromptChunkEvent | RequestEvent] = TypeAdapter(Event)
