"""The official `openai` Python client against the real server: models, chat (whole and streamed), completions,
stop sequences, usage and timings. The reference for the text is the engine run directly on the same prompt."""

from pathlib import Path

import openai
import pytest

from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner, TextEvent, TokenEvent
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from tests.engine.serve.conftest import MAX_CONTEXT
from tests.engine.serve.harness import ServerProc

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def direct(tiny_model: Path):
    """Greedy text straight from the engine (no HTTP, no server code): the reference."""
    lm = load_model(tiny_model, device="cpu")

    def run(ids: list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> tuple[str, str, int]:
        runner = Runner(lm.model, lm.tokenizer, MAX_CONTEXT, "f32")
        text, finish, n = "", "", 0
        for ev in runner.generate(GenerationRequest(ids, max_tokens=max_tokens, sampling=GREEDY, stop=stop)):
            if isinstance(ev, TokenEvent | TextEvent):
                text += ev.text
            elif isinstance(ev, DoneEvent):
                finish, n = ev.finish_reason, ev.timings.generated_tokens
        return text, finish, n

    def chat_ids(messages: list[dict[str, str]]) -> list[int]:
        return lm.tokenizer.encode(lm.chat.render(messages, add_generation_prompt=True))

    run.chat_ids = chat_ids  # type: ignore[attr-defined]
    run.encode = lambda s: lm.tokenizer.encode(s)  # type: ignore[attr-defined]
    return run


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["tiny-moe"]
    assert client.models.retrieve("tiny-moe").id == "tiny-moe"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat(client: openai.OpenAI, direct) -> None:
    ids = direct.chat_ids(MESSAGES)
    want, finish, n = direct(ids, 8)
    r = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.model == "tiny-moe"
    assert len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == finish
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == n
    assert r.usage.total_tokens == len(ids) + n
    timings = r.model_extra["timings"]  # type: ignore[index]
    assert timings["predicted_n"] == n
    assert timings["prompt_n"] + timings["cache_n"] == len(ids)
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0
    assert timings["predicted_per_second"] > 0 and timings["prompt_per_second"] > 0


def test_chat_alias_and_max_completion_tokens(client: openai.OpenAI, direct) -> None:
    want, _, _ = direct(direct.chat_ids(MESSAGES), 5)
    r = client.chat.completions.create(
        model="gpt-test", messages=MESSAGES, max_completion_tokens=5, temperature=0, stream_options=None
    )
    assert r.choices[0].message.content == want
    assert r.usage is not None and r.usage.completion_tokens == 5


def test_chat_stream(client: openai.OpenAI, direct) -> None:
    ids = direct.chat_ids(MESSAGES)
    want, finish, n = direct(ids, 8)
    stream = client.chat.completions.create(
        model="tiny-moe",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finish]
    # The usage chunk comes last, with no choices; the others carry usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].model_extra["timings"]["predicted_n"] == n  # type: ignore[index]
    assert len({c.id for c in chunks}) == 1


def test_completion_and_stream(client: openai.OpenAI, direct) -> None:
    prompt = "The capital of France is"
    ids = direct.encode(prompt)
    want, finish, _ = direct(ids, 6)
    r = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == finish
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(
        model="tiny-moe", prompt=prompt, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + want
    streamed = client.completions.create(
        model="tiny-moe", prompt=prompt, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want
    by_ids = client.completions.create(model="tiny-moe", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == want


def test_stop_sequence(client: openai.OpenAI, direct) -> None:
    ids = direct.chat_ids(MESSAGES)
    full, _, _ = direct(ids, 16)
    # A stop string from the middle of the greedy answer: the answer ends just before its first occurrence.
    visible = [i for i, ch in enumerate(full) if ch.isprintable() and ch != "\ufffd" and i > 0]
    assert visible, f"the greedy answer has no usable stop string: {full!r}"
    stop = full[visible[len(visible) // 2]]
    cut = full[: full.index(stop)]
    r = client.chat.completions.create(
        model="tiny-moe", messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop]
    )
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="tiny-moe", messages=MESSAGES, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_with_seed_is_repeatable(client: openai.OpenAI) -> None:
    kw = {"model": "tiny-moe", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9}
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = [client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)]
    assert a == b
    assert any(x != a for x in c)


def test_tools_reach_the_template(client: openai.OpenAI, server: ServerProc) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    plain = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(
        model="tiny-moe", messages=MESSAGES, max_tokens=1, temperature=0, tools=tools
    )
    none = client.chat.completions.create(
        model="tiny-moe", messages=MESSAGES, max_tokens=1, temperature=0, tools=tools, tool_choice="none"
    )
    assert plain.usage is not None and with_tools.usage is not None and none.usage is not None
    # The template writes the tool schemas into the prompt, so it grows; tool_choice "none" leaves them out.
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 10
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    follow_up = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    r = client.chat.completions.create(
        model="tiny-moe", messages=follow_up, max_tokens=1, temperature=0, tools=tools
    )
    assert r.usage is not None and r.usage.prompt_tokens > with_tools.usage.prompt_tokens
