"""Tool calls in a model's answer, by the format its chat template teaches it.

Hermes, Qwen2.5 and Qwen3 templates show the model `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
the answer's calls become OpenAI `tool_calls` and the text around them its `content`. A block that is not such JSON
(text that only looks like a call) stays text. Other families' formats are chosen the same way, from the template,
as they are added."""

import json
import re
import uuid
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
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> Parsed:
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


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
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
