"""Request parsing on its own: any JSON gives either a request or one 400 that names the field (hypothesis), and
messages reach the chat template in the shape templates expect."""

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from engine.serve.errors import APIError, from_validation
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, template_message

FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "n", "stop", "stream", "stream_options", "seed", "presence_penalty", "frequency_penalty", "logprobs", "tools",
    "tool_choice", "user", "echo", "suffix", "logit_bias", "repeat_penalty", "response_format", "bogus",
]  # fmt: skip

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text"]) | st.text(max_size=4), inner, max_size=3
        )
    ),
    max_leaves=12,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)


def _parse(model: type, raw: bytes) -> APIError | None:
    try:
        model.model_validate_json(raw)
    except ValidationError as e:
        return from_validation(e)
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, chat=st.booleans())
def test_any_json_is_a_request_or_one_400(body: dict[str, Any], chat: bool) -> None:
    err = _parse(ChatCompletionRequest if chat else CompletionRequest, json.dumps(body).encode())
    if err is not None:
        assert err.status == 400
        assert err.message and err.type == "invalid_request_error"
        assert err.param is None or isinstance(err.param, str)
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64))
def test_any_bytes_are_a_request_or_one_400(raw: bytes) -> None:
    err = _parse(ChatCompletionRequest, raw)
    assert err is None or err.status == 400


def test_template_messages() -> None:
    r = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                        "name": "ann",
                    },
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"x": 1}'},
                            },
                            {
                                "id": "2",
                                "type": "function",
                                "function": {"name": "g", "arguments": "not json"},
                            },
                        ],
                    },
                    {"role": "tool", "tool_call_id": "1", "content": "42"},
                ]
            }
        )
    )
    got = [template_message(m) for m in r.messages]
    assert got[0] == {"role": "system", "content": "be brief"}
    assert got[1] == {"role": "user", "content": "a\nb", "name": "ann"}
    assert got[2]["content"] == ""
    assert got[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # templates tojson a mapping
    assert got[2]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert got[3] == {"role": "tool", "content": "42", "tool_call_id": "1"}


def test_documented_client_fields_are_accepted() -> None:
    """Fields real clients send at their neutral values pass."""
    ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "user": "u1",
                "logprobs": False,
                "top_logprobs": 0,
                "n": 1,
                "logit_bias": {},
                "store": False,
                "metadata": {"k": "v"},
                "parallel_tool_calls": True,
                "response_format": {"type": "text"},
                "service_tier": "auto",
                "seed": -1,
                "max_completion_tokens": 5,
                "reasoning_effort": "low",
                "modalities": ["text"],
                "prompt_cache_key": "abc",
                "top_k": 20,
                "min_p": 0.1,
                "chat_template_kwargs": {"enable_thinking": False},
            }
        )
    )
    CompletionRequest.model_validate_json(
        json.dumps(
            {"model": "m", "prompt": ["one"], "echo": False, "best_of": 1, "logprobs": 0, "suffix": None}
        )
    )
