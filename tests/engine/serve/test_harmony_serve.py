"""A forced tool call for a model whose chat template teaches gpt-oss's harmony channels, through HTTP with the
official client: tool_choice naming a function (or required) comes back as that call, its arguments valid against
the tool's parameters, streamed as OpenAI sends deltas too."""

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from engine.testing.tiny_models import write_tiny_model
from tests.engine.serve.harness import ServerProc, start_server
from tests.engine.serve.test_constrained_serve import ADD, WEATHER

# harmony's message layout (gpt-oss's template also renders the tools and the reasoning; the format is what counts)
HARMONY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m['content'] or '' }}<|end|>"
    "{%- else -%}<|start|>{{ m['role'] }}<|message|>{{ m['content'] or '' }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
ASK = [{"role": "user", "content": "Add two numbers."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    path = write_tiny_model(
        tmp_path_factory.mktemp("harmony") / "tiny-harmony.gguf", "qwen2", "Q8_0", seed=2,
        chat_template=HARMONY_TEMPLATE,
    )  # fmt: skip
    srv = start_server(Path(path), "--device", "cpu", "--threads", "1", "--max-context", "512")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=120)


@pytest.mark.parametrize("choice", ["add", "get_weather", "required"])
def test_a_forced_harmony_call_comes_back_as_that_tool_call(client: openai.OpenAI, choice: str) -> None:
    tools = [WEATHER, ADD]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    forced = "required" if choice == "required" else {"type": "function", "function": {"name": choice}}
    for seed in range(3):
        r = client.chat.completions.create(
            model="any",
            messages=ASK,
            tools=tools,
            tool_choice=forced,
            seed=seed,
            temperature=1.0,
            max_tokens=200,
        )  # type: ignore[call-overload]
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls and len(msg.tool_calls) == 1, msg
        call = msg.tool_calls[0].function
        assert choice == "required" or call.name == choice
        jsonschema.validate(json.loads(call.arguments), params[call.name])


def test_a_forced_harmony_call_streams_as_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="any", messages=ASK, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
        stream=True, seed=1, temperature=1.0, max_tokens=200,
    )  # fmt: skip
    name, args, finish = "", "", None
    for chunk in stream:
        ch = chunk.choices[0] if chunk.choices else None
        if ch is None:
            continue
        for tc in ch.delta.tool_calls or []:
            if tc.function is not None:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    assert name == "add" and finish == "tool_calls"
    jsonschema.validate(json.loads(args), ADD["function"]["parameters"])
