"""Output held to a grammar, token by token: JSON schemas, Lark grammars, llama.cpp's GBNF and regexes.

llguidance (a Rust library with Python bindings and no other dependency) computes, before each sampled token, the
set of tokens that keep the output inside the grammar; the sampler then draws only from those. It was chosen over
xgrammar (which needs torch, transformers and Triton as install dependencies) and outlines-core (which builds an
index over the whole vocabulary per schema up front, and reads no GBNF or Lark): its masks are computed lazily, in
about 20 us a token for a JSON schema on a 152k vocabulary (measured on the 2-core CPU), and it ships abi3 wheels
for Linux, Windows and macOS. llama.cpp and vLLM use it as well.

`compile_grammar` turns a request's constraint into llguidance's grammar text (checked against the model's
vocabulary: a bad schema or grammar is a GrammarError that names the problem); each generation then makes its own
`Constraint` from that text, whose state follows the tokens it consumes."""

import json
import threading
import weakref
from typing import Any, Literal

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from engine import kernels
from engine.tokenizer import Tokenizer

Kind = Literal["json_schema", "lark", "gbnf", "regex"]
# JSON output as models write it when asked for JSON on one line: ", " between items, ": " after keys, no other
# whitespace (free whitespace lets a sampler wander into spaces and newlines until the token limit).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: "weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class GrammarError(ValueError):
    pass


def ll_tokenizer(tok: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a vocabulary: each token's bytes (control tokens marked with a leading 0xFF, so that
    grammar text never matches them), the end-of-generation tokens, and our encoder. Made once per tokenizer
    (about 1 s for a 152k vocabulary)."""
    with _LOCK:
        got = _TOKENIZERS.get(tok)
        if got is None:
            got = _TOKENIZERS[tok] = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Vocabulary(tok)), eos_token=sorted(tok.eog_ids) or None
            )
        return got


class _Vocabulary:
    def __init__(self, tok: Tokenizer) -> None:
        n = tok.vocab_size
        special = [i for i in range(n) if tok.is_special(i)]
        marked = set(special)
        self.tokens = [
            (b"\xff" if i in marked else b"") + tok.token_to_bytes(i, special=True) for i in range(n)
        ]
        self.special_token_ids = special
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self._tok = tok

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special=False, parse_special=False)


def hermes_calls_grammar(tools: list[dict[str, Any]], several: bool) -> str:
    """A Lark grammar whose every output is a Hermes-format call (`<tool_call>`, a newline, the call's JSON, a
    newline, `</tool_call>`) of one of `tools` (OpenAI tool objects), its arguments valid against the tool's
    parameters; `several`: one call or more, a newline apart."""
    schema = {"x-guidance": JSON_OPTIONS, **_call_schemas(tools)}
    more = ' ("\\n" block)*' if several else ""
    return f'start: block{more}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'


def _call_schemas(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One JSON schema for a call of any of `tools`: {"name": ..., "arguments": ...}."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"anyOf": calls} if len(calls) > 1 else calls[0]


def mistral_calls_grammar(tools: list[dict[str, Any]], several: bool) -> str:
    """Mistral's form: `[TOOL_CALLS]` then a JSON list of calls (one unless `several`)."""
    schema = {"x-guidance": JSON_OPTIONS, "type": "array", "items": _call_schemas(tools), "minItems": 1}
    if not several:
        schema["maxItems"] = 1
    return f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps(schema)}\n'


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _xml_calls_grammar(tools: list[dict[str, Any]], several: bool, glm: bool) -> str:
    """Qwen3-Coder's `<function=NAME>` with a `<parameter=KEY>` element per argument, or GLM-4.5's NAME with
    `<arg_key>`/`<arg_value>` pairs: each tool's required arguments in the order its schema lists them, then its
    optional ones, each optional. A string argument is text without `<` (within its length bounds); any other is
    JSON of its schema."""
    rules = []
    names = []
    for i, t in enumerate(tools):
        f = t["function"]
        params = f.get("parameters") or {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = [k for k in props if k in set(params.get("required") or [])]
        parts = []
        for j, key in enumerate([*required, *(k for k in props if k not in required)]):
            schema = props[key] if isinstance(props[key], dict) else {}
            value = f"v{i}_{j}"
            enum = schema.get("enum")
            if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
                rules.append(f"{value}: " + " | ".join(_lit(e) for e in enum))
            elif schema.get("type") == "string":
                lo, hi = schema.get("minLength"), schema.get("maxLength")
                bounded = isinstance(hi, int) or isinstance(lo, int)
                count = (
                    f"{{{max(int(lo or 0), 1)},{int(hi) if isinstance(hi, int) else ''}}}" if bounded else "+"
                )
                rules.append(f"{value}: /[^<]{count}/")
            else:
                rules.append(f"{value}: %json {json.dumps({'x-guidance': JSON_OPTIONS, **schema})}")
            if glm:
                element = f'"<arg_key>" {_lit(key)} "</arg_key>\\n<arg_value>" {value} "</arg_value>\\n"'
            else:
                element = f'"<parameter=" {_lit(key)} ">\\n" {value} "\\n</parameter>\\n"'
            parts.append(element if key in required else f"({element})?")
        body = " ".join(parts)
        if glm:
            rules.append(f'f{i}: {_lit(f["name"])} "\\n" {body}')
        else:
            rules.append(f'f{i}: "<function=" {_lit(f["name"])} ">\\n" {body} "</function>"')
        names.append(f"f{i}")
    more = ' ("\\n" block)*' if several else ""
    block = '"<tool_call>" call "</tool_call>"' if glm else '"<tool_call>\\n" call "\\n</tool_call>"'
    head = [f"start: block{more}", f"block: {block}", "call: " + " | ".join(names)]
    return "\n".join([*head, *rules]) + "\n"


HARMONY_MARKS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>")


def special_marks(tok: Tokenizer, marks: tuple[str, ...]) -> set[str]:
    """Which of `marks` are one control token of `tok` (written in a grammar as that token, not as text: llguidance
    never matches a control token with text)."""
    out = set()
    for m in marks:
        ids = tok.encode(m, add_special=False, parse_special=True)
        if len(ids) == 1 and tok.is_special(ids[0]):
            out.add(m)
    return out


def harmony_calls_grammar(
    tools: list[dict[str, Any]], specials: set[str] | frozenset[str] = frozenset()
) -> str:
    """gpt-oss's harmony form, after the generation prompt's `<|start|>assistant`: one commentary message to one of
    `tools` whose JSON body is its arguments, ended by `<|call|>` (which ends the turn: harmony calls one function
    a turn), after an optional analysis message (the model's reasoning, any text up to `<|end|>`, then
    `<|start|>assistant`) where `<|call|>` is the vocabulary's end-of-generation control token, as in gpt-oss's.
    `specials`: the markers that are control tokens (special_marks); llama.cpp's reader makes the others text."""

    def mark(m: str) -> str:
        return m if m in specials else _lit(m)

    rules = ["start: analysis? call" if "<|call|>" in specials else "start: call"]
    rules.append(
        f'analysis: {mark("<|channel|>")} "analysis" {mark("<|message|>")} thought {mark("<|start|>")} "assistant"'
    )
    if "<|end|>" in specials:  # the control token ends the text
        rules.append(r"thought: THOUGHT <|end|>" + "\n" + r"THOUGHT: /(.|\n)*/")
    else:  # the reasoning runs to the first "<|end|>" (a lazy lexeme: it may hold "<" and newlines)
        rules.append(r"thought[lazy]: /(.|\n)*<\|end\|>/")
    rules.append("call: " + " | ".join(f"f{i}" for i in range(len(tools))))
    for i, t in enumerate(tools):
        f = t["function"]
        schema = {"x-guidance": JSON_OPTIONS, **(f.get("parameters") or {"type": "object"})}
        rules.append(
            f"f{i}: {mark('<|channel|>')} {_lit('commentary to=functions.' + f['name'] + ' ')} "
            f'{mark("<|constrain|>")} "json" {mark("<|message|>")} a{i} {mark("<|call|>")}'
        )
        rules.append(f"a{i}: %json {json.dumps(schema)}")
    return "\n".join(rules) + "\n"


def forced_calls_grammar(
    fmt: str, tools: list[dict[str, Any]], several: bool, specials: set[str] | frozenset[str] = frozenset()
) -> str | None:
    """A grammar whose every output is a call of one of `tools` in the format `fmt` (tool_calls.CallFormat.name)
    teaches, its arguments valid against the tool's parameters; None for a format with no such grammar here.
    `specials`: the format's markers that are control tokens of the vocabulary (harmony's)."""
    if fmt == "harmony":
        return harmony_calls_grammar(tools, specials)
    if fmt == "hermes":
        return hermes_calls_grammar(tools, several)
    if fmt == "mistral":
        return mistral_calls_grammar(tools, several)
    if fmt in ("qwen3-coder", "glm-4.5"):
        return _xml_calls_grammar(tools, several, glm=fmt == "glm-4.5")
    return None


def compile_grammar(kind: Kind, source: Any, tok: Tokenizer) -> str:
    """A constraint as llguidance grammar text, checked against `tok`'s vocabulary. `source`: a JSON schema (a
    dict, or True for any JSON object), a Lark or GBNF grammar, or a regex."""
    try:
        if kind == "json_schema":
            schema = {"type": "object"} if source is True else source
            if not isinstance(schema, dict):
                raise GrammarError(f"a JSON schema is an object, not {type(schema).__name__}")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        elif kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(source)
        elif kind == "gbnf":  # llama.cpp's GBNF (a Lark grammar passes as it is)
            grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(source))
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
    except GrammarError:
        raise
    except Exception as e:  # the converters' own complaints (the GBNF one raises plain Exceptions)
        raise GrammarError(f"the {kind} cannot be read: {e}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(tok))
    if err and not err.startswith("WARNING"):
        raise GrammarError(f"the {kind} cannot be used: {err}")
    return grammar


class Constraint:
    """One generation's place in a grammar: `mask` the logits before a token is drawn, `consume` the token
    drawn."""

    def __init__(self, grammar: str, tok: Tokenizer) -> None:
        llt = ll_tokenizer(tok)
        self.matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.n_vocab = llt.vocab_size
        self.words = np.full((self.n_vocab + 31) // 32, -1, dtype=np.int32)
        self._pinned: torch.Tensor | None = None  # the mask words for a card, in page-locked memory
        self._bits: dict[torch.device, torch.Tensor] = {}
        self._ready: torch.Tensor | None = None  # the words of the next token's mask, once computed (prepare)

    def _host_words(self, cuda: bool) -> torch.Tensor:
        """Where the matcher writes the mask: page-locked for a card, so that the copy is truly asynchronous (a
        copy from pageable memory makes the host wait for the step before it)."""
        if not cuda:
            return torch.from_numpy(self.words)
        if self._pinned is None:
            self._pinned = torch.empty(self.words.shape[0], dtype=torch.int32, pin_memory=True)
        return self._pinned

    def prepare(self, cuda: bool) -> None:
        """Compute the next token's mask now, where the host would otherwise wait: a caller that has just queued
        the step whose logits it masks calls this, and the matcher's work overlaps the device's (`mask` then
        uses it). `cuda`: the logits will be on a card."""
        if self._ready is None:
            host = self._host_words(cuda)
            self.matcher.unsafe_compute_mask_ptr(host.data_ptr(), host.numel() * 4)
            self._ready = host

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (any device) with every token the grammar does not allow next at -inf."""
        self.prepare(logits.is_cuda)
        host = self._ready
        assert host is not None
        words = host.to(logits.device, non_blocking=True)
        if logits.is_cuda:
            return kernels.token_mask.apply_token_mask_(
                logits.to(torch.float32, copy=True).contiguous(), words, self.n_vocab
            )
        bits = self._bits.get(logits.device)
        if bits is None:
            bits = self._bits[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(-1) >> bits) & 1).view(-1).bool()
        v = logits.shape[-1]
        keep = torch.zeros(v, dtype=torch.bool, device=logits.device)
        n = min(v, allowed.numel(), self.n_vocab)
        keep[:n] = allowed[:n]  # rows past the vocabulary (a padded output head) are never allowed
        return logits.masked_fill(~keep, float("-inf"))

    def consume(self, token: int) -> None:
        self._ready = None  # the mask computed was for the token just drawn
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} leaves the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar allows nothing more (the output is complete)."""
        return self.matcher.is_stopped()
