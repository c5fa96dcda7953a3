"""Chat templates: a GGUF file's `tokenizer.chat_template` (Jinja) rendered in a sandbox.

The environment is the one chat templates are written for (Hugging Face's): an immutable sandbox (no attribute
access to internals, no mutation of the inputs), `trim_blocks` and `lstrip_blocks`, loop controls
(`{% break %}`, `{% continue %}`), the globals `raise_exception(msg)` and `strftime_now(fmt)`, a `tojson` filter that
keeps non-ASCII text as is, and `{% generation %}...{% endgeneration %}` accepted (rendered as its body).
Every failure becomes one `ChatTemplateError` line that names the template and what went wrong; a sandbox
violation is a `ChatTemplateSecurityError`, which is also a `jinja2.exceptions.SecurityError`.

A file without a template gets `FALLBACK_TEMPLATE` (ChatML, as llama.cpp falls back to); `ChatFormatter.is_fallback`
tells the caller so it can log it. A vocabulary without ChatML's tokens (Gemma 3 270M, a base model) reads its
markers as plain text, so a model imitating the format writes `<|im_end|>` as text instead of ending its turn:
`ChatFormatter.stop_strings` holds the markers that the generation must then stop at (and leave out).
"""

import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from types import TracebackType
from typing import TYPE_CHECKING, Any

import jinja2
from gguf import Keys
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

if TYPE_CHECKING:
    from jinja2.parser import Parser

    from engine.tokenizer.gguf_tokenizer import Tokenizer

K = Keys.Tokenizer
log = logging.getLogger("strata.engine")

# ChatML: each message as <|im_start|>ROLE\nCONTENT<|im_end|>\n, then <|im_start|>assistant\n to prompt a reply.
# Content given as a list of parts keeps its text parts.
FALLBACK_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "{%- if message['content'] is string -%}\n"
    "{{- message['content'] -}}\n"
    "{%- elif message['content'] is iterable -%}\n"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# The end of the reply under the fallback: its end marker, or the start of a next turn. Where the vocabulary has
# `<|im_end|>` as a control token it is an end-of-generation token anyway; the strings catch it written as text.
FALLBACK_STOPS: tuple[str, ...] = ("<|im_end|>", "<|im_start|>")


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered; the message is one line."""


class ChatTemplateSecurityError(ChatTemplateError, SecurityError):
    """The template tried to reach outside the sandbox."""


class _Raised(Exception):
    """`raise_exception(...)` called by the template itself."""


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; here it is just its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads this class attribute

    def parse(self, parser: "Parser") -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# The work one render may do, whatever the template (it comes from the model file, so a damaged or hostile file can
# hold anything): the text it writes, the numbers and sequences it builds, the loop steps over range() and the time.
MAX_OUTPUT_CHARS = 32 << 20
MAX_VALUE_ITEMS = 1 << 22  # characters or items of one string or list built by *, +
MAX_POWER_BITS = 1 << 16  # bits of an integer built by **
MAX_RANGE_STEPS = 1 << 20  # steps of every range() of one render together
MAX_RENDER_S = 2.0
_budget = threading.local()


class _Overrun(Exception):
    """A render went past its budget."""


def _spend(steps: int = 1) -> None:
    b = getattr(_budget, "left", None)
    if b is None:
        return
    _budget.left = b - steps
    if _budget.left < 0:
        raise _Overrun(f"its loops ran more than {MAX_RANGE_STEPS} steps")
    if time.monotonic() > _budget.deadline:
        raise _Overrun(f"it ran more than {MAX_RENDER_S:g} s")


def _range(*args: int) -> Iterator[int]:
    """range() as the sandbox allows it, each step counted against the render's budget."""
    for i in safe_range(*args):
        _spend()
        yield i


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, and bounded work: `**`, `*` and `+` are not folded while the template compiles (Jinja
    would compute `10 ** 100000000` there, holding the GIL for minutes) and are refused where their result would
    exceed the budget; range() counts its steps; lipsum() is gone."""

    intercepted_binops = frozenset({"**", "*", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
                raise _Overrun(f"{left} ** {right} is too large")
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > MAX_VALUE_ITEMS:
                raise _Overrun(f"a sequence of {len(seq)} repeated {n} times is too long")
        elif (
            operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple)
        ):
            if len(left) + len(right) > MAX_VALUE_ITEMS:
                raise _Overrun("a string or list built by + is too long")
        _spend(0)
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _range
    env.globals.pop("lipsum", None)
    return env


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _where(source: str | None) -> str:
    return f"chat template of {source}" if source else "chat template"


@lru_cache(maxsize=32)
def _compile(template: str, source: str | None) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"{_where(source)}: syntax error at line {e.lineno}: {_one_line(e.message)}"
        ) from None
    except (RecursionError, MemoryError, ValueError, TypeError) as e:  # nested too deep, too large, odd input
        raise ChatTemplateError(
            f"{_where(source)} cannot be compiled: {type(e).__name__}: {_one_line(e)}"
        ) from None


def _template_line(tb: TracebackType | None) -> int | None:
    """The template line being rendered when the error happened (jinja2 maps its frames back to the source)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    source: str | None = None,
    **extra: Any,
) -> str:
    """Render `template` for `messages` (OpenAI-style dicts). `extra` reaches the template as variables, e.g.
    `enable_thinking=False` for Qwen3. `source` names the template in errors."""
    compiled = _compile(template, source)
    context = dict(extra)
    context.update(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    _budget.left, _budget.deadline = MAX_RANGE_STEPS, time.monotonic() + MAX_RENDER_S
    try:
        out: list[str] = []
        size = 0
        for piece in compiled.generate(**context):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise _Overrun(f"it wrote more than {MAX_OUTPUT_CHARS} characters")
            _spend(0)
            out.append(piece)
        return "".join(out)
    except _Overrun as e:
        raise ChatTemplateError(
            f"{_where(source)} was stopped: {e} (a chat template may not; check the file's template)"
        ) from None
    except _Raised as e:
        raise ChatTemplateError(f"{_where(source)} refused the conversation: {_one_line(e)}") from None
    except SecurityError as e:
        raise ChatTemplateSecurityError(
            f"{_where(source)} tried an unsafe operation, blocked by the sandbox: {_one_line(e)}"
        ) from None
    except Exception as e:
        line = _template_line(e.__traceback__)
        at = f" at line {line}" if line else ""
        raise ChatTemplateError(
            f"{_where(source)} failed{at}: {type(e).__name__}: {_one_line(e)}; check the template or the messages"
        ) from None
    finally:
        _budget.left = None


class ChatFormatter:
    """The chat template of one model file, with the special tokens it refers to.

    `render` strips a leading BOS text when the tokenizer adds BOS itself (and a trailing EOS when it adds EOS),
    as llama.cpp does, so that encoding the prompt with `add_special=True` yields exactly one BOS.
    `stop_strings` are the strings a reply to a rendered prompt ends at, besides the end-of-generation tokens
    (the fallback's markers; none for the file's own template): callers add them to the request's stops.
    """

    def __init__(
        self,
        template: str,
        *,
        is_fallback: bool = False,
        bos_token: str = "",
        eos_token: str = "",
        strip_bos: bool = False,
        strip_eos: bool = False,
        source: str | None = None,
    ) -> None:
        self.template = template
        self.is_fallback = is_fallback
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.strip_bos = strip_bos
        self.strip_eos = strip_eos
        self.source = source
        self.stop_strings: tuple[str, ...] = FALLBACK_STOPS if is_fallback else ()
        _compile(template, source)  # fail at load, not at the first request

    @classmethod
    def from_metadata(
        cls,
        meta: Mapping[str, Any],
        tokenizer: "Tokenizer | None" = None,
        name: str | None = None,
        source: str | None = None,
    ) -> "ChatFormatter":
        """The template under `tokenizer.chat_template` (or `tokenizer.chat_template.<name>`), else ChatML.
        With `tokenizer`, BOS/EOS and whether the tokenizer adds them come from it (llama.cpp's defaults
        included); without it, only from the explicit keys."""
        key = K.CHAT_TEMPLATE_N.format(name=name) if name else K.CHAT_TEMPLATE
        template = meta.get(key)
        is_fallback = not template
        tokens = meta.get(K.LIST)

        def text(token_id: int | None) -> str:
            if token_id is None or tokens is None or not 0 <= int(token_id) < len(tokens):
                return ""
            return str(tokens[int(token_id)])

        if tokenizer is not None:
            bos, eos = text(tokenizer.bos_id), text(tokenizer.eos_id)
            add_bos, add_eos = tokenizer.add_bos, tokenizer.add_eos
        else:
            bos, eos = text(meta.get(K.BOS_ID)), text(meta.get(K.EOS_ID))
            add_bos, add_eos = bool(meta.get(K.ADD_BOS, False)), bool(meta.get(K.ADD_EOS, False))
        marks = {"bos_token": bos, "eos_token": eos, "strip_bos": add_bos and bool(bos),
                 "strip_eos": add_eos and bool(eos), "source": source}  # fmt: skip
        if is_fallback:
            return cls(FALLBACK_TEMPLATE, is_fallback=True, **marks)  # type: ignore[arg-type]
        try:
            return cls(str(template), **marks)  # type: ignore[arg-type]
        except ChatTemplateError as e:  # a template that cannot compile: chat as ChatML, completions as ever
            log.warning("%s: using the ChatML fallback template", e)
            return cls(FALLBACK_TEMPLATE, is_fallback=True, **marks)  # type: ignore[arg-type]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        text = render_chat(
            self.template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            source=self.source,
            **extra,
        )
        if self.strip_bos and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.strip_eos and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text
