"""Constrained output through HTTP on the shared tiny-model server: OpenAI's response_format (json_object and
json_schema) and tool_choice (required, a named function) with the official client, llama-server's grammar and
json_schema on /completion; every output checked with jsonschema or the grammar's own pattern."""

import json
import re

import jsonschema
import openai
import pytest

from tests.engine.serve.harness import ServerProc

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=120)


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in range(10):
        r = client.chat.completions.create(
            model="tiny-moe", messages=ASK, response_format=fmt, temperature=1.0, seed=seed, max_tokens=100
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)


def test_json_object_response_format_streamed(client: openai.OpenAI) -> None:
    """Any JSON object: a random model's keys need not ever close, so a few tokens are asked for and they must
    begin an object, written without free whitespace."""
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny-moe", messages=ASK, response_format={"type": "json_object"}, temperature=0, max_tokens=12,
            stream=True,
        )
    )  # fmt: skip
    assert text.startswith("{") and "\n" not in text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_always_calls_a_declared_tool(client: openai.OpenAI, stream: bool) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for seed in range(8):
        kw = dict(model="tiny-moe", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                  parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)  # fmt: skip
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]  # type: ignore[call-overload]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        else:
            parts: dict[int, list[str]] = {}
            finish = None
            for ch in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
                for tc in ch.choices[0].delta.tool_calls or []:
                    p = parts.setdefault(tc.index, ["", ""])
                    p[0] += (tc.function.name or "") if tc.function else ""
                    p[1] += (tc.function.arguments or "") if tc.function else ""
                finish = ch.choices[0].finish_reason or finish
            assert finish == "tool_calls"
            calls = [(n, a) for n, a in parts.values()]
        assert len(calls) == 1
        name, args = calls[0]
        jsonschema.validate(json.loads(args), params[name])


def test_a_named_tool_choice_calls_that_tool(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny-moe", messages=ASK, tools=[WEATHER, ADD], temperature=1.0, seed=3, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])


def test_llama_server_grammar_and_json_schema(server: ServerProc) -> None:
    for seed in range(5):
        r = server.post("/completion", {"prompt": "x", "grammar": 'root ::= ("yes" | "no") [0-9]{2}', "seed": seed,
                                        "temperature": 1.0, "n_predict": 20})  # fmt: skip
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"(yes|no)[0-9]{2}", r.json()["content"]), r.json()["content"]
        r = server.post("/completion", {"prompt": "x", "json_schema": SCHEMA, "seed": seed, "temperature": 1.0,
                                        "n_predict": 200})  # fmt: skip
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["content"]), SCHEMA)
    r = server.post("/v1/completions", {"prompt": "x", "grammar": "root ::= [0-9]{3}", "max_tokens": 10})
    assert re.fullmatch(r"[0-9]{3}", r.json()["choices"][0]["text"])


def test_fields_other_servers_clients_send(client: openai.OpenAI, server: ServerProc) -> None:
    """llama-server's and vLLM's fields on the OpenAI routes: n_predict, repetition_penalty and vLLM's guided_*
    honoured; their other samplers and options accepted and not acted on; anything else refused by name."""
    base = {"model": "m", "messages": ASK, "temperature": 0}
    r = server.post("/v1/chat/completions", {**base, "n_predict": 5})
    assert r.json()["usage"]["completion_tokens"] == 5
    a = server.post("/v1/chat/completions", {**base, "max_tokens": 12, "repetition_penalty": 1.5}).json()
    b = server.post("/v1/chat/completions", {**base, "max_tokens": 12, "repeat_penalty": 1.5}).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    ignored = {"typical_p": 1.0, "mirostat": 0, "keep_alive": "5m", "samplers": ["top_k"], "dry_multiplier": 0,
               "id_slot": -1, "skip_special_tokens": True, "use_beam_search": False}  # fmt: skip
    c = server.post(
        "/v1/chat/completions", {**base, "max_tokens": 12, "repeat_penalty": 1.5, **ignored}
    ).json()
    assert c["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    for seed in range(5):
        body = {**base, "temperature": 1.0, "seed": seed, "max_tokens": 200}
        got = server.post("/v1/chat/completions", {**body, "guided_choice": ["yes", "no", "maybe so"]}).json()
        assert got["choices"][0]["message"]["content"] in ("yes", "no", "maybe so")
        got = server.post("/v1/chat/completions", {**body, "guided_regex": "[a-c]{2}[0-9]"}).json()
        assert re.fullmatch("[a-c]{2}[0-9]", got["choices"][0]["message"]["content"])
        plain = {k: v for k, v in body.items() if k != "messages"}
        got = server.post(
            "/v1/completions", {"prompt": "x", **plain, "guided_json": json.dumps(SCHEMA)}
        ).json()
        jsonschema.validate(json.loads(got["choices"][0]["text"]), SCHEMA)
    bad = server.post("/v1/chat/completions", {**base, "frobnicate": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "frobnicate"
