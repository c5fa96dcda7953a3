"""Tool calls in a model's answer, by the format its chat template teaches it (`parser_for`).

- Hermes, Qwen2.5 and Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (`HermesCalls`);
- Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`;
- GLM-4.5: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...</tool_call>`;
- Mistral: `[TOOL_CALLS]` then a JSON list of calls, or `NAME[ARGS]{...}` (the 2025 templates);
- gpt-oss: harmony channels, which also keep the reasoning (the analysis channel) apart (`HarmonyCalls`).

The answer's calls become OpenAI `tool_calls` and the text around them its `content`. A block that is not a call
(text that only looks like one) stays text. Where the request's tools come with their parameters' JSON schemas
(a mapping of name -> schema), the XML formats' values are typed by them: a string parameter keeps its text, any
other is read as JSON (its text where that fails); without a schema a value is read as JSON where it is JSON."""

import json
import re
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text outside the calls (None when there is none)
    calls: list[ToolCall]
    reasoning: str | None = None  # what a channel format keeps apart (gpt-oss's analysis)


class CallFormat:
    """A family's tool-call format: `parse` a whole answer; `stream` reads one piece by piece. Text streams as it
    comes up to the first place a call may begin (`marks`); from there the answer is held to its end and parsed
    whole, so the streamed items are always what `parse` makes of the whole answer."""

    name = ""
    marks: tuple[str, ...] = ()
    channels = False  # the answer's channels carry its reasoning too (harmony): no <think> split before this

    def parse(self, text: str, names: Collection[str] | None = None) -> Parsed:
        raise NotImplementedError

    def stream(self, names: Collection[str]) -> "HeldCalls | CallStream":
        return HeldCalls(self, names)


class HermesCalls(CallFormat):
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3). Small models of these families often leave
    the tags out and write the call's JSON alone or in a ```json fence; with the request's tool names given, such an
    answer is read as calls too where every object in it calls a declared tool (llama.cpp's Hermes parser also
    takes the fenced form)."""

    name = "hermes"
    marks = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    _FENCE = re.compile(r"```json[ \t]*\n?(.*?)```", re.DOTALL)

    def parse(self, text: str, names: Collection[str] | None = None) -> Parsed:
        parsed = self._tagged(text)
        if parsed.calls or not names:
            return parsed
        return self._untagged(text, set(names)) or parsed

    def stream(self, names: Collection[str]) -> "CallStream":
        return CallStream(names)

    def _untagged(self, text: str, names: set[str]) -> Parsed | None:
        fences = list(self._FENCE.finditer(text))
        spans = [(m.start(), m.end(), m.group(1)) for m in fences] or [(0, len(text), text)]
        calls: list[ToolCall] = []
        kept: list[str] = []
        at = 0
        for start, end, body in spans:
            got = _calls(body, names)
            if got is None:
                continue
            kept.append(text[at:start])
            at = end
            calls += got
        if not calls:
            return None
        kept.append(text[at:])
        return Parsed("".join(kept).strip() or None, calls)

    def _tagged(self, text: str) -> Parsed:
        return cut_blocks(text, self._BLOCK, lambda m: _call(m.group(1)))


def cut_blocks(text: str, block: re.Pattern[str], read: Callable[[re.Match[str]], ToolCall | None]) -> Parsed:
    """The calls `read` makes of the blocks `block` finds in `text`, and the text around them; a block `read`
    makes nothing of (not a call) stays in the text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for m in block.finditer(text):
        call = read(m)
        if call is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return Parsed(content or None, calls)


def _calls(body: str, names: set[str]) -> list[ToolCall] | None:
    """A JSON object, or a list of them, each a call of one of `names`; None where the body is anything else."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call(json.dumps(o)) for o in objs]
    if not calls or any(c is None or c.name not in names for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "arguments" in obj or "parameters" in obj:
        args = obj.get("arguments", obj.get("parameters"))
    else:  # small models put the arguments beside the name
        args = {k: v for k, v in obj.items() if k != "name"}
    if isinstance(args, str):  # some models write the arguments already as text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class _Blocks(CallFormat):
    """Formats whose calls are tagged blocks (`_BLOCK`), each read by `_read` (None: not a call, stays text)."""

    _BLOCK: re.Pattern[str]

    def parse(self, text: str, names: Collection[str] | None = None) -> Parsed:
        schemas = names if isinstance(names, Mapping) else {}
        return cut_blocks(text, self._BLOCK, lambda m: self._read(m, schemas))

    def _read(self, m: re.Match[str], schemas: Mapping[str, Any]) -> ToolCall | None:
        raise NotImplementedError


class QwenXmlCalls(_Blocks):
    """Qwen3-Coder's XML calls: a function element with a parameter element per argument."""

    name = "qwen3-coder"
    marks = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def _read(self, m: re.Match[str], schemas: Mapping[str, Any]) -> ToolCall | None:
        name, body = m.group(1).strip(), m.group(2)
        params = list(self._PARAM.finditer(body))
        if not name or self._PARAM.sub("", body).strip():  # anything but parameters: not a call
            return None
        props = _properties(schemas.get(name))
        args = {p.group(1).strip(): _typed(p.group(2), props.get(p.group(1).strip())) for p in params}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


class GlmCalls(_Blocks):
    """GLM-4.5's calls: the function's name, then key and value elements."""

    name = "glm-4.5"
    marks = ("<tool_call>",)
    _BLOCK = re.compile(
        r"<tool_call>\s*([^<\n]+?)\s*((?:<arg_key>.*?</arg_value>\s*)*)</tool_call>", re.DOTALL
    )
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _read(self, m: re.Match[str], schemas: Mapping[str, Any]) -> ToolCall | None:
        name = m.group(1).strip()
        if not name or name.startswith(("{", "[")):
            return None
        props = _properties(schemas.get(name))
        args = {
            a.group(1).strip(): _typed(a.group(2), props.get(a.group(1).strip()))
            for a in self._ARG.finditer(m.group(2))
        }
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


class MistralCalls(CallFormat):
    """Mistral's `[TOOL_CALLS]`: a JSON list (or object) of calls, or, in the 2025 templates, `NAME[ARGS]{...}`
    (with `[CALL_ID]id` between in some), one after another. The calls end the answer; what follows that is not a
    call stays text."""

    name = "mistral"
    marks = ("[TOOL_CALLS]",)
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")

    def parse(self, text: str, names: Collection[str] | None = None) -> Parsed:
        i = text.find(self.marks[0])
        if i < 0:
            return Parsed(text or None, [])
        calls: list[ToolCall] = []
        rest = text[i:]
        dec = json.JSONDecoder()
        while rest.startswith(self.marks[0]):
            rest = rest[len(self.marks[0]) :]
            while True:
                s = rest.lstrip()
                named = self._NAMED.match(rest)
                try:
                    if named is not None:
                        obj, end = dec.raw_decode(rest, named.end())
                        got = [_call(json.dumps({"name": named.group(1), "arguments": obj}))]
                    elif s.startswith(("[", "{")):
                        obj, end = dec.raw_decode(s)
                        end += len(rest) - len(s)
                        got = [_call(json.dumps(o)) for o in (obj if isinstance(obj, list) else [obj])]
                    else:
                        break
                except ValueError:
                    break
                if not got or any(c is None for c in got):
                    break
                calls += got  # type: ignore[arg-type]
                rest = rest[end:]
        if not calls:
            return Parsed(text or None, [])
        content = (text[:i] + rest).strip()
        return Parsed(content or None, calls)


def _properties(schema: Any) -> dict[str, Any]:
    """A tool's parameter schemas by name (an object schema's `properties`), {} where unknown."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _typed(value: str, schema: Any) -> Any:
    """An argument written as text in an XML format -> its JSON value: a string parameter keeps its text, any
    other is read as JSON where it is JSON."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    if kinds == "string" or (
        isinstance(kinds, list) and kinds and all(k in ("string", "null") for k in kinds)
    ):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class HeldCalls:
    """A streamed answer read with a CallFormat: text streams up to where a call may begin (one of the format's
    marks, or its partial start at the end of what came so far); from a mark on, the rest is held and parsed
    whole at the end. `feed` each text piece, then `end`; items as CallStream's."""

    def __init__(self, fmt: CallFormat, names: Collection[str]) -> None:
        self.fmt, self.names = fmt, names
        self.held = ""
        self.holding = False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.held += text
        if self.holding:
            return []
        found = [i for m in self.fmt.marks if (i := self.held.find(m)) >= 0]
        if found:
            i = min(found)
            out, self.held, self.holding = self.held[:i], self.held[i:], True
        else:
            keep = max(partial_tag(self.held, m) for m in self.fmt.marks)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return [("text", out)] if out else []

    def end(self) -> list[tuple[str, Any]]:
        text, self.held = self.held, ""
        if not self.holding:
            return [("text", text)] if text else []
        parsed = self.fmt.parse(text, self.names)
        if not parsed.calls:
            return [("text", text)] if text else []
        out: list[tuple[str, Any]] = [("text", parsed.content)] if parsed.content else []
        return out + [("call", c) for c in parsed.calls]


class _Pieces:
    """A reader of an answer piece by piece: `feed` each text piece, then `end`; each gives the items that are
    ready (`_drain` reads what is held so far)."""

    held = ""

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.held += text
        return self._drain(final=False)

    def end(self) -> list[tuple[str, Any]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        raise NotImplementedError


class HarmonyCalls(CallFormat):
    """gpt-oss's harmony channels: the answer is messages, each a header (`<|channel|>NAME`, a recipient
    `to=functions.NAME`, a content type) then `<|message|>` and a body up to `<|end|>` (or the end: `<|call|>` and
    `<|return|>` end the generation). The analysis channel is reasoning, the final channel the answer, a message to
    a declared function a call whose body is its JSON arguments; anything else stays answer text. The
    openai-harmony package parses the same from token ids, but loads its vocabulary file from the network on
    first use; the detokenized text carries every marker (engine/tokenizer/vocab.py renders them), so it is read
    here."""

    name = "harmony"
    marks = ("<|channel|>",)
    channels = True

    def parse(self, text: str, names: Collection[str] | None = None) -> Parsed:
        st = HarmonyStream(names or ())
        items = st.feed(text) + st.end()
        thought = "".join(v for k, v in items if k == "reasoning")
        content = "".join(v for k, v in items if k == "text")
        calls = [v for k, v in items if k == "call"]
        return Parsed(content.strip() or None, calls, thought.strip() or None)

    def stream(self, names: Collection[str]) -> "HarmonyStream":
        return HarmonyStream(names)


class HarmonyStream(_Pieces):
    """HarmonyCalls for a streamed answer: `feed` each text piece, then `end`; gives ("reasoning", str),
    ("text", str) and ("call", ToolCall) items in order. A body streams as it comes (but a call's, held whole);
    only a partial marker at the end of what came so far waits for the next piece."""

    _ENDS = ("<|end|>", "<|start|>", "<|call|>", "<|return|>")
    _MESSAGE = "<|message|>"
    _CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
    _TO = re.compile(r"to=([^\s<]+)")

    def __init__(self, names: Collection[str]) -> None:
        self.names = set(names)
        self.held = ""
        self.head: str | None = ""  # the header read so far (None: in a body)
        self.kind = "text"  # what the current body is: reasoning, text, or call
        self.call = ""  # the function a call's body goes to
        self.body = ""  # a call's body, held whole

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while True:
            if self.head is not None:  # in a header: up to <|message|>
                i = self.held.find(self._MESSAGE)
                if i < 0:
                    if not final:
                        return out
                    if "<|channel|>" not in self.head + self.held:  # no harmony here at all: plain text
                        rest = (self.head + self.held).replace("<|start|>assistant", "")
                        if rest:
                            out.append(("text", rest))
                    self.held, self.head = "", ""
                    return out
                self._header(self.head + self.held[:i])
                self.held, self.head = self.held[i + len(self._MESSAGE) :], None
                continue
            found = [(j, m) for m in self._ENDS if (j := self.held.find(m)) >= 0]
            if found:
                j, mark = min(found)
                self._body(out, self.held[:j])
                self._close(out)
                self.held = self.held[j + len(mark) :]
                if mark == "<|start|>":  # the next message's role, then its header
                    self.held = self.held.removeprefix("assistant")
                self.head = ""
                continue
            keep = 0 if final else max(partial_tag(self.held, m) for m in self._ENDS)
            self._body(out, self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep :]
            if final:
                self._close(out)
                self.head = ""
            return out

    def _header(self, head: str) -> None:
        channel = self._CHANNEL.search(head)
        to = self._TO.search(head)
        fn = to.group(1).removeprefix("functions.") if to is not None else ""
        self.call = fn if to is not None and to.group(1).startswith("functions.") and fn in self.names else ""
        ch = channel.group(1) if channel is not None else "final"
        self.kind = "call" if self.call else "reasoning" if ch == "analysis" else "text"
        self.body = ""

    def _body(self, out: list[tuple[str, Any]], text: str) -> None:
        if not text:
            return
        if self.kind == "call":
            self.body += text
        else:
            out.append((self.kind, text))

    def _close(self, out: list[tuple[str, Any]]) -> None:
        if self.kind != "call":
            return
        call = _call(json.dumps({"name": self.call, "arguments": _json_or_text(self.body)}))
        if call is not None:
            out.append(("call", call))
        elif self.body:
            out.append(("text", self.body))
        self.kind, self.body = "text", ""


def _json_or_text(body: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body


def parser_for(template: str) -> CallFormat | None:
    """The tool-call format a chat template teaches, or None where it shows none this server reads."""
    if "<|channel|>" in template:
        return HarmonyCalls()
    if "<parameter=" in template and "<function=" in template:
        return QwenXmlCalls()
    if "<arg_key>" in template:
        return GlmCalls()
    if "[TOOL_CALLS]" in template:
        return MistralCalls()
    if "<tool_call>" in template:
        return HermesCalls()
    return None


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]  # fmt: skip


OPEN, CLOSE, FENCE = "<tool_call>", "</tool_call>", "```json"


class CallStream(_Pieces):
    """A streamed answer with its tool calls taken out as they complete (Hermes format): `feed` each text piece,
    then `end`; each gives ("text", str) and ("call", ToolCall) items in answer order. Text streams as it comes,
    except what may begin a call: a partial `<tool_call>` (or, where the request declared tools, "```json") at the
    end of what came so far, and a block until it closes; and an answer that begins as a bare JSON object or list
    where tools were declared, held whole (small models write their calls so). However the text is split, the
    items are what `HermesCalls.parse` makes of the whole answer (tests split it at every character)."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = set(names)
        self.marks = (OPEN, FENCE) if names else (OPEN,)
        self.held = ""
        self.sent = False  # any text other than whitespace given out
        self.whole = False  # holding the whole answer (a bare JSON call, perhaps)

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while True:
            if self.whole:
                if final:
                    parsed = HermesCalls().parse(self.held, list(self.names))
                    self._text(out, (parsed.content or "") if parsed.calls else self.held)
                    out += [("call", c) for c in parsed.calls]
                    self.held = ""
                return out
            if self.names and not self.sent:
                s = self.held.lstrip()
                if s.startswith(("{", "[")):
                    self.whole = True
                    continue
                if not s and not final:
                    return out  # only whitespace so far
            found = [(i, m) for m in self.marks if (i := self.held.find(m)) >= 0]
            if found:
                i, mark = min(found)
                close = CLOSE if mark == OPEN else "```"
                j = self.held.find(close, i + len(mark))
                self._text(out, self.held[:i])
                self.held = self.held[i:]
                if j < 0:
                    if final:  # never closed: text
                        self._text(out, self.held)
                        self.held = ""
                    return out
                j -= i
                body = self.held[len(mark) : j].strip()
                got = [_call(body)] if mark == OPEN else _calls(body, self.names)
                if got and all(c is not None for c in got):
                    out += [("call", c) for c in got]
                else:
                    self._text(out, self.held[: j + len(close)])
                self.held = self.held[j + len(close) :]
                continue
            keep = 0 if final else max(partial_tag(self.held, m) for m in self.marks)
            self._text(out, self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep :]
            return out

    def _text(self, out: list[tuple[str, Any]], text: str) -> None:
        if text:
            out.append(("text", text))
            self.sent = self.sent or bool(text.strip())


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be completed by the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
