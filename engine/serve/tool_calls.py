"""Tool calls in a model's answer, by the format its chat template teaches it.

Hermes, Qwen2.5 and Qwen3 templates show the model `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
the answer's calls become OpenAI `tool_calls` and the text around them its `content`. A block that is not such JSON
(text that only looks like a call) stays text. Other families' formats are chosen the same way, from the template,
as they are added."""

import json
import re
import uuid
from collections.abc import Sequence
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


class HermesCalls:
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3). Small models of these families often leave
    the tags out and write the call's JSON alone or in a ```json fence; with the request's tool names given, such an
    answer is read as calls too where every object in it calls a declared tool (llama.cpp's Hermes parser also
    takes the fenced form)."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    _FENCE = re.compile(r"```json[ \t]*\n?(.*?)```", re.DOTALL)

    def parse(self, text: str, names: Sequence[str] | None = None) -> Parsed:
        parsed = self._tagged(text)
        if parsed.calls or not names:
            return parsed
        return self._untagged(text, set(names)) or parsed

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
        calls: list[ToolCall] = []
        kept: list[str] = []
        at = 0
        for m in self._BLOCK.finditer(text):
            call = _call(m.group(1))
            if call is None:
                continue  # not a call: the block stays in the text
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


def parser_for(template: str) -> HermesCalls | None:
    """The tool-call format a chat template teaches, or None where it shows none this server reads."""
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


class CallStream:
    """A streamed answer with its tool calls taken out as they complete (Hermes format): `feed` each text piece,
    then `end`; each gives ("text", str) and ("call", ToolCall) items in answer order. Text streams as it comes,
    except what may begin a call: a partial `<tool_call>` (or, where the request declared tools, "```json") at the
    end of what came so far, and a block until it closes; and an answer that begins as a bare JSON object or list
    where tools were declared, held whole (small models write their calls so). However the text is split, the
    items are what `HermesCalls.parse` makes of the whole answer (tests split it at every character)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)
        self.marks = (OPEN, FENCE) if names else (OPEN,)
        self.held = ""
        self.sent = False  # any text other than whitespace given out
        self.whole = False  # holding the whole answer (a bare JSON call, perhaps)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.held += text
        return self._drain(final=False)

    def end(self) -> list[tuple[str, Any]]:
        return self._drain(final=True)

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
