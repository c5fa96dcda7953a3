"""Reasoning apart from the answer (engine/serve/reasoning.py): <think> blocks opened by the answer or by the
prompt, cut short, empty; the streamed split equals the whole one however the text is split; and the chat message
a whole answer becomes, its tool calls read from the answer only."""

from types import SimpleNamespace

import pytest

from engine.pipeline.generate import DoneEvent, GenerationRequest, Timings
from engine.serve.answers import Answers
from engine.serve.jobs import Result
from engine.serve.reasoning import ThinkStream, split

THINKING_TEMPLATE = "{{ messages }}<think></think><tool_call></tool_call>"


@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("<think>\nThe user greets.\n</think>\n\nHello!", False, ("The user greets.", "Hello!")),
        ("The user greets.\n</think>\n\nHello!", True, ("The user greets.", "Hello!")),
        ("Hello!", False, (None, "Hello!")),
        ("<think>\n\n</think>\n\nHello!", False, (None, "Hello!")),
        (
            "<think>\nStill thinking when the length ran out",
            False,
            ("Still thinking when the length ran out", ""),
        ),
        ("Say <think> later", False, (None, "Say <think> later")),
    ],
)
def test_split(text: str, opened: bool, want: tuple) -> None:
    assert split(text, opened) == want


@pytest.mark.parametrize(
    ("text", "opened"),
    [
        ("<think>\nThe user greets.\n</think>\n\nHello!", False),
        ("The user greets.\n</think>\n\nHello!", True),
        ("Hello <thin", False),
        ("  <think>a</think>b", False),
        ("<think>\nno end", False),
    ],
)
def test_the_stream_splits_as_the_whole_answer_at_every_character(text: str, opened: bool) -> None:
    thought, answer = split(text, opened)
    for cut in range(len(text) + 1):
        s = ThinkStream(opened)
        pieces = s.feed(text[:cut]) + s.feed(text[cut:]) + s.end()
        got_thought = "".join(v for k, v in pieces if k == "reasoning").strip() or None
        got_answer = "".join(v for k, v in pieces if k == "text")
        assert (got_thought, got_answer.strip()) == (thought, answer.strip()), cut


def _service() -> Answers:
    svc = Answers()
    svc.model_name = "m"
    tok = SimpleNamespace(decode=lambda ids: "".join(chr(i) for i in ids))
    svc.lm = SimpleNamespace(chat=SimpleNamespace(template=THINKING_TEMPLATE), tokenizer=tok)  # type: ignore[assignment]
    return svc


def test_the_chat_message_has_the_reasoning_apart_and_calls_from_the_answer() -> None:
    text = (
        '<think>\nI should call <tool_call>{"name": "f", "arguments": {}}</tool_call> maybe.\n</think>\n\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    res = Result(text, DoneEvent("stop", Timings(prompt_tokens=3, generated_tokens=30)), 0.0)
    (choice,) = _service().chat_response(res, tools=["get_weather", "f"], reasoning=False)["choices"]
    msg = choice["message"]
    assert msg["reasoning_content"].startswith("I should call") and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    plain = _service().chat_response(res, tools=[], reasoning=None)["choices"][0]["message"]
    assert plain["content"] == text and "reasoning_content" not in plain


def test_the_mode_follows_the_template_the_prompt_and_reasoning_format() -> None:
    svc = _service()
    opened = GenerationRequest([ord(c) for c in "<|im_start|>assistant\n<think>\n"])
    closed = GenerationRequest([ord(c) for c in "<|im_start|>assistant\n"])
    assert svc.reasoning_mode(SimpleNamespace(), opened) is True
    assert svc.reasoning_mode(SimpleNamespace(), closed) is False
    assert svc.reasoning_mode(SimpleNamespace(reasoning_format="none"), opened) is None
    svc.lm.chat.template = "{{ messages }}"  # type: ignore[union-attr]
    assert svc.reasoning_mode(SimpleNamespace(), opened) is None
