"""The server with no --model serves the embedded chat model (Qwen2.5-Coder-0.5B-Instruct): a greedy completion
that is right, a chat that answers, and a tool-call round trip with the official openai client; and
`strata-engine generate --chat "Hello"`, as the README shows it, answers."""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.engine.serve.harness import ServerProc, start_server

pytestmark = [pytest.mark.chat_model, pytest.mark.slow]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def chat_server(chat_model_path: Path) -> Iterator[ServerProc]:
    # chat_model_path assembles the default model first; the server then finds it without --model.
    srv = start_server(None, "--device", "cpu", "--max-context", "512", "--threads", "2", "--parallel", "1")
    yield srv
    srv.stop()


def _client(srv: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.key, max_retries=0, timeout=300)


def test_default_model_completes_and_chats(chat_server: ServerProc, chat_model_path: Path) -> None:
    client = _client(chat_server)
    models = client.models.list().data
    assert [m.id for m in models] == [chat_model_path.name.removesuffix(".gguf")]
    r = client.completions.create(
        model=models[0].id, prompt="The capital of France is the city of", max_tokens=3, temperature=0
    )
    assert "Paris" in r.choices[0].text, r.choices[0].text
    chat = client.chat.completions.create(
        model=models[0].id, messages=[{"role": "user", "content": "Hello"}], max_tokens=24, temperature=0
    )
    answer = chat.choices[0].message.content or ""
    assert len(answer.split()) >= 3, answer  # a real answer, not an empty line


def test_a_tool_call_round_trip_with_the_openai_client(chat_server: ServerProc) -> None:
    """The model calls the declared tool (it writes the call as a ```json block; read as a call), the tool's
    result goes back through the template, and the next turn is an answer. What the 0.5B model then writes is its
    own: transformers on the same file gives the same greedy text."""
    client = _client(chat_server)
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="any", messages=messages, tools=[WEATHER], max_tokens=60, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    result = "18 degrees Celsius, cloudy"
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = client.chat.completions.create(
        model="any", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=40, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length") and not second.choices[0].message.tool_calls
    assert "18" in (second.choices[0].message.content or "")  # only the tool's result says 18


def test_generate_chat_hello_answers(chat_model_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "generate", "--chat", "Hello", "-n", "24", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout.split()) >= 3, (r.stdout, r.stderr[-500:])


def test_a_streamed_tool_call_comes_as_openai_deltas(chat_server: ServerProc) -> None:
    client = _client(chat_server)
    stream = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    text, finish = "", None
    for ch in stream:
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += tc.id or ""
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        text += d.content or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0], (text, calls)
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"} and not text.strip()


def test_structured_output_and_a_forced_call_on_the_chat_model(chat_server: ServerProc) -> None:
    client = _client(chat_server)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Name the capital of France and its country."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        max_tokens=40,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content or "") == {"city": "Paris", "country": "France"}
    forced = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Hi there"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
    )
    (call,) = forced.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_gives_the_models_tool_call(chat_server: ServerProc, stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
            "stream": stream, "options": {"temperature": 0, "num_predict": 60}}  # fmt: skip
    r = chat_server.post("/api/chat", body)
    assert r.status_code == 200, r.text
    lines = [json.loads(x) for x in r.text.splitlines() if x.strip()] if stream else [r.json()]
    calls = [c for x in lines for c in x["message"].get("tool_calls", [])]
    assert calls == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert lines[-1]["done"] is True
