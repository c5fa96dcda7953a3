"""Anthropic's Messages API with the official `anthropic` client against the shared tiny-model server: a message
whole and streamed (the same text as the OpenAI route gives), the key as x-api-key, stop sequences and
max_tokens as stop reasons, a forced tool call and its result fed back, and refusals."""

import json

import anthropic
import openai
import pytest

from tests.engine.serve.harness import ServerProc

ASK = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0}  # the 2.x client has no temperature argument; the API field is still read
ADD = {
    "name": "add",
    "description": "Add two numbers",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(server: ServerProc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.key, max_retries=0, timeout=120)


def _openai_text(server: ServerProc, messages: list, max_tokens: int, **kw: object) -> tuple[str, str]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=120)
    r = c.chat.completions.create(
        model="tiny-moe", messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )  # type: ignore[call-overload]
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_a_message_whole_and_streamed_is_the_chat_answer(
    client: anthropic.Anthropic, server: ServerProc
) -> None:
    want, finish = _openai_text(server, [{"role": "system", "content": "Be brief."}, *ASK], 12)
    m = client.messages.create(
        model="claude-any", system="Be brief.", messages=ASK, max_tokens=12, extra_body=GREEDY
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want  # type: ignore[union-attr]
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert m.usage.output_tokens == 12 or m.stop_reason == "end_turn"
    with client.messages.stream(
        model="claude-any", system="Be brief.", messages=ASK, max_tokens=12, extra_body=GREEDY
    ) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == want and final.content[0].text == want  # type: ignore[union-attr]
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_a_stop_sequence_ends_the_message(client: anthropic.Anthropic, server: ServerProc) -> None:
    text, _ = _openai_text(server, ASK, 12)
    stop = text.strip()[2:5]
    assert stop
    m = client.messages.create(
        model="x", messages=ASK, max_tokens=12, stop_sequences=[stop], extra_body=GREEDY
    )
    assert m.stop_reason == "end_turn" and stop not in m.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_and_its_result(client: anthropic.Anthropic, stream: bool) -> None:
    kw = dict(
        model="x", messages=ASK, max_tokens=80, extra_body=GREEDY, tools=[ADD], tool_choice={"type": "any"}
    )
    if stream:
        with client.messages.stream(**kw) as s:  # type: ignore[arg-type]
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)  # type: ignore[arg-type]
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "add" and set(use.input) == {"a", "b"}  # type: ignore[union-attr, arg-type]
    again = client.messages.create(
        model="x",
        max_tokens=8,
        extra_body=GREEDY,
        tools=[ADD],
        messages=[
            *ASK,
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},  # type: ignore[union-attr]
        ],
    )
    assert again.usage.input_tokens > m.usage.input_tokens  # the call and its result went into the prompt


def test_refusals(server: ServerProc) -> None:
    for body, param in (
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages.0.content.0"),
        ({"max_tokens": 5, "messages": ASK, "tools": [ADD], "tool_choice": {"type": "tool", "name": "nope"}},
         "tool_choice"),
        ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice"),  # no tools to call
    ):  # fmt: skip
        r = server.post("/v1/messages", body)
        assert r.status_code == 400, r.text
        assert param in json.dumps(r.json()), r.text


def test_structured_output_through_output_config(client: anthropic.Anthropic) -> None:
    # bounded values only: the random model samples at the default temperature, and an integer with no bounds
    # may run past max_tokens
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    m = client.messages.create(model="x", messages=ASK, max_tokens=20,
                               output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    assert set(json.loads(m.content[0].text)) == {"n"}  # type: ignore[union-attr]
