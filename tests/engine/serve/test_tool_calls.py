"""Tool calls in answers (engine/serve/tool_calls.py) on recorded model outputs in the Hermes/Qwen format, and the
OpenAI message a whole chat answer becomes."""

import json
from types import SimpleNamespace

import pytest

from engine.pipeline.generate import DoneEvent, Timings
from engine.serve.answers import Answers
from engine.serve.jobs import Result
from engine.serve.tool_calls import HermesCalls, parser_for

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
    (choice,) = _service(QWEN_TEMPLATE).chat_response(res, tools=True)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert (
        msg["content"] == "Let me check both." and [c["type"] for c in msg["tool_calls"]] == ["function"] * 2
    )
    assert msg["tool_calls"][1]["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    # without tools in the request, or with a template that teaches no format, the text stays text
    for svc, tools in ((_service(QWEN_TEMPLATE), False), (_service("{{ messages }}"), True)):
        (plain,) = svc.chat_response(res, tools=tools)["choices"]
        assert plain["message"]["content"] == TWO and "tool_calls" not in plain["message"]
        assert plain["finish_reason"] == "stop"
