"""OpenAI's Responses API with the official client against the shared tiny-model server: a response whole and
streamed with the chat route's text, a forced function call and its output fed back, a JSON schema text format,
and refusals."""

import json

import jsonschema
import openai
import pytest

from tests.engine.serve.harness import ServerProc

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=120)


def test_a_response_whole_and_streamed_is_the_chat_answer(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=10, temperature=0,
    )  # fmt: skip
    want = chat.choices[0].message.content
    r = client.responses.create(
        model="m", instructions="Be brief.", input="Hi", max_output_tokens=10, temperature=0
    )
    assert r.object == "response" and r.output_text == want
    assert r.status in ("completed", "incomplete") and r.usage is not None and r.usage.output_tokens >= 1
    assert (r.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    events = list(
        client.responses.create(
            model="m", instructions="Be brief.", input="Hi", max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == want  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_and_its_output(client: openai.OpenAI, stream: bool) -> None:
    kw = dict(model="m", input="Add 2 and 3", tools=[ADD], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=80, temperature=0)  # fmt: skip
    if stream:
        events = list(client.responses.create(stream=True, **kw))  # type: ignore[call-overload]
        r = events[-1].response
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    else:
        r = client.responses.create(**kw)  # type: ignore[call-overload]
        args = None
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "add" and (args is None or args == call.arguments)
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    again = client.responses.create(
        model="m", tools=[ADD], max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": "Add 2 and 3"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
    )  # fmt: skip
    assert again.usage is not None and r.usage is not None and again.usage.input_tokens > r.usage.input_tokens


def test_a_json_schema_text_format(client: openai.OpenAI) -> None:
    # bounded values only: sampled at the default temperature, an unbounded integer may run past the token limit
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(
        model="m", input="A number", max_output_tokens=20,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)


def test_refusals(server: ServerProc) -> None:
    for body, param in (
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "background": True}, "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        (
            {"input": "x", "tool_choice": "required"},
            "tool_choice",
        ),  # refused by the chat request it maps onto
    ):
        r = server.post("/v1/responses", body)
        assert r.status_code == 400, r.text
        assert param in json.dumps(r.json()), r.text
