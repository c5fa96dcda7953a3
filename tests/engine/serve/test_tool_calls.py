"""Tool calls in answers (engine/serve/tool_calls.py) on recorded model outputs in the Hermes/Qwen format, and the
OpenAI message a whole chat answer becomes."""

import json
from types import SimpleNamespace

import pytest

from engine.pipeline.generate import DoneEvent, Timings
from engine.serve.answers import Answers
from engine.serve.jobs import Result
from engine.serve.tool_calls import CallStream, HermesCalls, parser_for

QWEN_TEMPLATE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>...</tool_call>"
ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TWO = (
    'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (ONE, None, [("get_weather", {"city": "Paris", "unit": "c"})]),
        (TWO, "Let me check both.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
        ("Paris is sunny.", "Paris is sunny.", []),
        (
            "I would write <tool_call>not json</tool_call> here.",
            "I would write <tool_call>not json</tool_call> here.",
            [],
        ),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),  # no name
        (
            'Starting <tool_call>{"name": "f", "arguments": {}}',
            'Starting <tool_call>{"name": "f", "arguments": {}}',
            [],
        ),
    ],
)
def test_hermes_blocks_become_calls_and_the_rest_stays_text(
    text: str, content: str | None, calls: list
) -> None:
    parsed = HermesCalls().parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


@pytest.mark.parametrize(
    ("text", "names", "content", "calls"),
    [
        (
            FENCED,
            ["get_weather"],
            None,
            [("get_weather", {"city": "Paris"})],
        ),  # Qwen2.5-Coder-0.5B's own answer
        (
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
            ["get_weather"],
            None,
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            "Sure:\n" + FENCED + "\nDone.",
            ["get_weather"],
            "Sure:\n\nDone.",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]',
            ["a", "b"],
            None,
            [("a", {}), ("b", {"x": 1})],
        ),
        (FENCED, ["get_time"], FENCED, []),  # a tool the request did not declare: text
        (FENCED, [], FENCED, []),  # no tools declared: text
        (
            '```json\n{"name": "get_weather", "city": "Paris"}\n```',
            ["get_weather"],
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        ("```python\nprint(1)\n```", ["get_weather"], "```python\nprint(1)\n```", []),
        ('```json\n{"weather": "sunny"}\n```', ["get_weather"], '```json\n{"weather": "sunny"}\n```', []),
    ],
)
def test_untagged_calls_of_declared_tools_are_read(
    text: str, names: list, content: str | None, calls: list
) -> None:
    parsed = HermesCalls().parse(text, names)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def test_the_format_comes_from_the_template() -> None:
    assert isinstance(parser_for(QWEN_TEMPLATE), HermesCalls)
    assert parser_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def _service(template: str) -> Answers:
    svc = Answers()
    svc.model_name = "m"
    svc.lm = SimpleNamespace(chat=SimpleNamespace(template=template))  # type: ignore[assignment]
    return svc


def test_a_whole_answer_with_calls_is_an_openai_tool_call_message() -> None:
    res = Result(TWO, DoneEvent("stop", Timings(prompt_tokens=5, generated_tokens=40)), 0.0)
    (choice,) = _service(QWEN_TEMPLATE).chat_response(res, tools=["get_weather", "get_time"])["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert (
        msg["content"] == "Let me check both." and [c["type"] for c in msg["tool_calls"]] == ["function"] * 2
    )
    assert msg["tool_calls"][1]["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    # without tools in the request, or with a template that teaches no format, the text stays text
    for svc, tools in (
        (_service(QWEN_TEMPLATE), []),
        (_service("{{ messages }}"), ["get_weather", "get_time"]),
    ):
        (plain,) = svc.chat_response(res, tools=tools)["choices"]
        assert plain["message"]["content"] == TWO and "tool_calls" not in plain["message"]
        assert plain["finish_reason"] == "stop"


def _streamed(pieces: list[str], names: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    s = CallStream(names)
    items = [it for p in pieces for it in s.feed(p)] + s.end()
    text = "".join(v for k, v in items if k == "text")
    return text, [(v.name, json.loads(v.arguments)) for k, v in items if k == "call"]


STREAMED = [
    ONE,
    TWO,
    "Paris is sunny.",
    "I would write <tool_call>not json</tool_call> here.",
    'Starting <tool_call>{"name": "f", "arguments": {}}',
    FENCED,
    "Sure:\n" + FENCED + "\nDone.",
    "```python\nprint(1)\n```",
    '  {"name": "get_weather", "arguments": {"city": "Oslo"}}',
    "<tool_call",  # a partial tag at the very end stays text
]


@pytest.mark.parametrize("text", STREAMED)
def test_a_streamed_answer_gives_the_whole_answers_calls_split_at_every_character(text: str) -> None:
    names = ["get_weather", "get_time"]
    whole = HermesCalls().parse(text, names)
    want = ((whole.content or "").strip(), [(c.name, json.loads(c.arguments)) for c in whole.calls])
    for cut in range(len(text) + 1):
        got_text, got_calls = _streamed([text[:cut], text[cut:]], names)
        assert (got_text.strip(), got_calls) == want, cut
    got_text, got_calls = _streamed(list(text), names)  # a character a piece
    assert (got_text.strip(), got_calls) == want


def test_text_streams_before_a_call_and_nothing_waits_without_tools() -> None:
    s = CallStream(["get_weather"])
    assert s.feed("Let me check. <tool") == [("text", "Let me check. ")]  # the partial tag waits
    assert s.feed('_call>{"name": "get_weather", "arguments": {}}') == []  # an open block waits
    (call,) = s.feed("</tool_call> ok")[:1]
    assert call[0] == "call" and call[1].name == "get_weather"
    plain = CallStream([])
    assert plain.feed('{"a": 1}') == [("text", '{"a": 1}')]  # no tools declared: JSON is text at once
