"""Requests into generation requests: chat messages through the model's template, prompts into token ids, the
sampling fields into the sampler's, each refusal an OpenAI-style 400 that names the field."""

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.pipeline.constrain import (
    HARMONY_MARKS,
    GrammarError,
    Kind,
    compile_grammar,
    forced_calls_grammar,
    special_marks,
)
from engine.pipeline.generate import GenerationRequest
from engine.pipeline.sampling import SamplingError, SamplingParams
from engine.serve.errors import APIError
from engine.serve.options import ServeOptions
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, template_message
from engine.serve.tool_calls import parser_for
from engine.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from engine.pipeline.generate import GenerationRequest
    from engine.pipeline.loader import LoadedModel

# Names a chat template receives from us; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "source"}


class RequestTranslation:
    """Part of EngineService: reads its loaded model (`lm`) and options (`opts`)."""

    lm: "LoadedModel | None"
    opts: ServeOptions

    def _encode(self, text: str, parse_special: bool, param: str = "prompt") -> list[int]:
        assert self.lm is not None
        ctx, least = self.opts.max_context, self.lm.tokenizer.min_tokens(text)
        if least >= ctx:  # from the length alone: tokenizing megabytes would hold the server for seconds
            raise APIError(
                400,
                f"the prompt has at least {least} tokens (its {len(text.encode('utf-8', 'surrogatepass'))} bytes) "
                f"but the context holds {ctx} (--max-context): shorten the prompt or the conversation, or restart "
                "the server with a larger --max-context",
                code="context_length_exceeded",
                param=param,
            )
        try:
            return self.lm.tokenizer.encode(text, add_special=True, parse_special=parse_special)
        except UnicodeError as e:
            raise APIError(400, f"the text cannot be encoded as UTF-8: {e}", code="invalid_text") from None

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        assert self.lm is not None
        vocab = self.lm.tokenizer.vocab_size
        out = tuple((int(k), float(v)) for k, v in (bias or {}).items())
        bad = [i for i, _ in out if i >= vocab]
        if bad:
            raise APIError(
                400,
                f"logit_bias names token ids {bad[:5]} outside the vocabulary (0..{vocab - 1})",
                code="invalid_value",
                param="logit_bias",
            )
        return out

    def _sampling(self, r: ChatCompletionRequest | CompletionRequest) -> Any:
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
                repeat_penalty=next(
                    (x for x in (r.repeat_penalty, r.repetition_penalty) if x is not None), d.repeat_penalty
                ),
                presence_penalty=d.presence_penalty if r.presence_penalty is None else r.presence_penalty,
                frequency_penalty=d.frequency_penalty if r.frequency_penalty is None else r.frequency_penalty,
                repeat_last_n=d.repeat_last_n if r.repeat_last_n is None else r.repeat_last_n,
                seed=None if r.seed is None else r.seed % 2**64,
                logit_bias=self._logit_bias(r.logit_bias),
            )
        except SamplingError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def _generation(
        self, ids: list[int], r: ChatCompletionRequest | CompletionRequest, template_stops: Sequence[str] = ()
    ) -> "GenerationRequest":
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
        if limit is None and r.n_predict is not None and r.n_predict > 0:
            limit = r.n_predict
        grammar = self._grammar(r)
        return GenerationRequest(
            ids,
            max_tokens=ctx - len(ids) if limit is None else limit,
            sampling=self._sampling(r),
            stop=[*r.stops, *(s for s in template_stops if s not in r.stops)],
            ignore_eos=bool(r.ignore_eos),
            cache_prompt=r.cache_prompt is not False,
            logprobs=r.logprob_top,
            grammar=grammar,
        )

    def _grammar(self, r: ChatCompletionRequest | CompletionRequest) -> str | None:
        """The grammar the request's output must follow, compiled against the vocabulary: a JSON schema
        (`response_format` json_object or json_schema, llama-server's `json_schema`), a GBNF or Lark grammar
        (llama-server's `grammar`), or a forced tool call (`tool_choice` required or a named function)."""
        assert self.lm is not None
        asked: list[tuple[str, Kind, Any]] = []
        rf = getattr(r, "response_format", None)
        if rf is not None and rf.type != "text":
            asked.append(
                (
                    "response_format",
                    "json_schema",
                    True if rf.type == "json_object" else rf.json_schema["schema"],
                )
            )
        if r.json_schema is not None:
            asked.append(("json_schema", "json_schema", r.json_schema))
        if r.grammar:
            asked.append(("grammar", "gbnf", r.grammar))
        if r.guided_json is not None:
            schema = r.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise APIError(400, f"guided_json is not JSON: {e}", code="invalid_grammar",
                                   param="guided_json") from None  # fmt: skip
            asked.append(("guided_json", "json_schema", schema))
        if r.guided_regex:
            asked.append(("guided_regex", "regex", r.guided_regex))
        if r.guided_grammar:
            asked.append(("guided_grammar", "gbnf", r.guided_grammar))
        if r.guided_choice:
            asked.append(
                ("guided_choice", "lark", "start: " + " | ".join(json.dumps(c) for c in r.guided_choice))
            )
        if (
            isinstance(r, ChatCompletionRequest)
            and r.tools
            and (r.tool_choice == "required" or isinstance(r.tool_choice, NamedToolChoice))
        ):
            asked.append(("tool_choice", "lark", self._forced_calls(r)))
        if not asked:
            return None
        if len(asked) > 1:
            raise APIError(
                400,
                f"{' and '.join(a[0] for a in asked)} each constrain the output: give one of them",
                code="invalid_value",
                param=asked[1][0],
            )
        param, kind, source = asked[0]
        try:
            return compile_grammar(kind, source, self.lm.tokenizer)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", code="invalid_grammar", param=param) from None

    def _forced_calls(self, r: ChatCompletionRequest) -> str:
        """tool_choice required (any declared tool, one call or more unless parallel_tool_calls is false) or a
        named function (that one, once), in the call format the model's template teaches."""
        assert self.lm is not None and r.tools
        fmt = parser_for(self.lm.chat.template)
        tools = [t.model_dump(exclude_none=True) for t in r.tools]
        several = r.parallel_tool_calls is not False
        if isinstance(r.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t["function"]["name"] == r.tool_choice.function.name]
            several = False
        specials = (
            special_marks(self.lm.tokenizer, HARMONY_MARKS)
            if fmt is not None and fmt.name == "harmony"
            else set()
        )
        grammar = forced_calls_grammar(fmt.name, tools, several, specials) if fmt is not None else None
        if grammar is None:
            taught = f"teaches the {fmt.name} format" if fmt is not None else "teaches no tool-call format"
            raise APIError(
                400,
                "tool_choice required or a named function is forced in the Hermes/Qwen, Qwen3-Coder, GLM-4.5, "
                f"Mistral and gpt-oss harmony formats, and this model's chat template {taught}: use tool_choice auto",
                code="invalid_value",
                param="tool_choice",
            )
        return grammar

    def prepare_chat(self, r: ChatCompletionRequest) -> "GenerationRequest":
        """Messages through the model's chat template, then tokens (runs in a thread: templates and long
        prompts take time)."""
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
        ids = self._encode(text, parse_special=True, param="messages")
        return self._generation(ids, r, self.lm.chat.stop_strings)

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
