"""Malformed requests over raw HTTP: every one gets a 4xx with an OpenAI error body, and the server stays up."""

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.engine.serve.conftest import MAX_CONTEXT
from tests.engine.serve.harness import ServerProc

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> bytes:
    return json.dumps({"model": "tiny-moe", "messages": MSG, "max_tokens": 2, **kw}).encode()


def comp(**kw: Any) -> bytes:
    return json.dumps({"model": "tiny-moe", "prompt": "hi", "max_tokens": 2, **kw}).encode()


def msgs(*messages: Any, **kw: Any) -> bytes:
    return json.dumps({"model": "tiny-moe", "messages": list(messages), "max_tokens": 2, **kw}).encode()


def _chunks(data: bytes) -> Iterator[bytes]:
    for i in range(0, len(data), 64 * 1024):
        yield data[i : i + 64 * 1024]


BIG = b'{"messages": [{"role": "user", "content": "' + b"x" * (1 << 20) + b'"}]}'
LONG_PROMPT = " ".join(f"w{i}" for i in range(700))  # more tokens than the 2048-position context

# (name, method, path, body, expected status, expected param or None for "any")
CASES: list[tuple[str, str, str, bytes | None, int, str | None]] = [
    ("bad json", "POST", CHAT, b"{", 400, None),
    ("empty body", "POST", CHAT, b"", 400, None),
    ("json array", "POST", CHAT, b"[1, 2]", 400, None),
    ("json string", "POST", CHAT, b'"hello"', 400, None),
    ("json null", "POST", CHAT, b"null", 400, None),
    ("truncated json", "POST", CHAT, b'{"messages": [', 400, None),
    ("trailing garbage", "POST", CHAT, chat() + b" x", 400, None),
    ("bad utf-8", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("lone surrogate", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("NaN temperature", "POST", CHAT, chat()[:-1] + b', "temperature": NaN}', 400, "temperature"),
    (
        "Infinity max_tokens",
        "POST",
        CHAT,
        chat()[:-1].replace(b'"max_tokens": 2', b'"max_tokens": 1e999') + b"}",
        400,
        "max_tokens",
    ),
    ("deeply nested", "POST", CHAT, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("missing messages", "POST", CHAT, json.dumps({"model": "tiny-moe"}).encode(), 400, "messages"),
    ("messages not a list", "POST", CHAT, json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    ("messages empty", "POST", CHAT, msgs(), 400, "messages"),
    ("message without role", "POST", CHAT, msgs({"content": "hi"}), 400, None),
    ("bad role", "POST", CHAT, msgs({"role": "wizard", "content": "hi"}), 400, "messages[0].role"),
    (
        "deprecated function role",
        "POST",
        CHAT,
        msgs({"role": "function", "name": "f", "content": "x"}),
        400,
        None,
    ),
    ("content is a number", "POST", CHAT, msgs({"role": "user", "content": 5}), 400, "messages[0].content"),
    ("user content null", "POST", CHAT, msgs({"role": "user", "content": None}), 400, "messages[0].content"),
    (
        "unknown part type",
        "POST",
        CHAT,
        msgs({"role": "user", "content": [{"type": "video", "url": "x"}]}),
        400,
        None,
    ),
    (
        "image part",
        "POST",
        CHAT,
        msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}),
        400,
        "messages[0].content",
    ),
    (
        "text part without text",
        "POST",
        CHAT,
        msgs({"role": "user", "content": [{"type": "text"}]}),
        400,
        None,
    ),
    (
        "unknown message field",
        "POST",
        CHAT,
        msgs({"role": "user", "content": "hi", "mood": "happy"}),
        400,
        None,
    ),
    (
        "message name not a string",
        "POST",
        CHAT,
        msgs({"role": "user", "content": "hi", "name": 3}),
        400,
        None,
    ),
    ("tool message without id", "POST", CHAT, msgs({"role": "tool", "content": "sunny"}), 400, None),
    (
        "tool call without function",
        "POST",
        CHAT,
        msgs({"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}),
        400,
        None,
    ),
    ("unknown top-level field", "POST", CHAT, chat(frobnicate=True), 400, "frobnicate"),
    ("model as a list", "POST", CHAT, chat(model=["gpt-9"]), 400, "model"),
    ("model not a string", "POST", CHAT, chat(model=7), 400, "model"),
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("zero max_tokens", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens as string", "POST", CHAT, chat(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens as float", "POST", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    (
        "negative max_completion_tokens",
        "POST",
        CHAT,
        chat(max_completion_tokens=-1),
        400,
        "max_completion_tokens",
    ),
    ("negative temperature", "POST", CHAT, chat(temperature=-0.5), 400, "temperature"),
    ("temperature too high", "POST", CHAT, chat(temperature=5), 400, "temperature"),
    ("temperature as string", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("top_p above 1", "POST", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("negative top_k", "POST", CHAT, chat(top_k=-1), 400, "top_k"),
    ("min_p above 1", "POST", CHAT, chat(min_p=2), 400, "min_p"),
    ("presence_penalty out of range", "POST", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty out of range", "POST", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("zero repeat_penalty", "POST", CHAT, chat(repeat_penalty=0), 400, "repeat_penalty"),
    ("n=2 streamed", "POST", CHAT, chat(n=2, stream=True), 400, "n"),
    ("huge n", "POST", CHAT, chat(n=1000000), 400, "n"),
    ("stop is a number", "POST", CHAT, chat(stop=5), 400, "stop"),
    ("too many stop strings", "POST", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop list with a number", "POST", CHAT, chat(stop=["a", 1]), 400, None),
    ("stream as string", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "include_usage as string",
        "POST",
        CHAT,
        chat(stream=True, stream_options={"include_usage": "y"}),
        400,
        None,
    ),
    ("top_logprobs over 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("logit_bias key not a token id", "POST", CHAT, chat(logit_bias={"hello": 10}), 400, "logit_bias"),
    (
        "json_schema response_format without a schema",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format",
    ),
    (
        "a schema that is not one",
        "POST",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            }
        ),
        400,
        "response_format",
    ),
    (
        "two constraints",
        "POST",
        CHAT,
        chat(response_format={"type": "json_object"}, grammar='root ::= "a"'),
        400,
        "grammar",
    ),
    ("tool without name", "POST", CHAT, chat(tools=[{"type": "function", "function": {}}]), 400, None),
    (
        "tool_choice names a tool not given",
        "POST",
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
    ),
    ("seed as string", "POST", CHAT, chat(seed="42"), 400, "seed"),
    ("seed too large", "POST", CHAT, chat(seed=2**70), 400, "seed"),
    ("reasoning_effort unknown", "POST", CHAT, chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    ("metadata not strings", "POST", CHAT, chat(metadata={"a": 1}), 400, None),
    (
        "chat_template_kwargs sets messages",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"messages": []}),
        400,
        None,
    ),
    (
        "prompt longer than the context",
        "POST",
        CHAT,
        msgs({"role": "user", "content": LONG_PROMPT}),
        400,
        "messages",
    ),
    ("oversize body", "POST", CHAT, BIG, 413, None),
    ("completion without prompt", "POST", COMP, json.dumps({"model": "tiny-moe"}).encode(), 400, "prompt"),
    ("completion prompt a number", "POST", COMP, comp(prompt=3), 400, "prompt"),
    ("completion batch of prompts", "POST", COMP, comp(prompt=["a", "b"]), 400, "prompt"),
    ("completion empty prompt list", "POST", COMP, comp(prompt=[]), 400, "prompt"),
    ("completion token out of vocab", "POST", COMP, comp(prompt=[1, 2, 10**9]), 400, "prompt"),
    ("completion best_of 3", "POST", COMP, comp(best_of=3), 400, "best_of"),
    ("completion suffix", "POST", COMP, comp(suffix="end"), 400, "suffix"),
    ("completion echo as string", "POST", COMP, comp(echo="yes"), 400, "echo"),
    ("completion logprobs over 5", "POST", COMP, comp(logprobs=6), 400, "logprobs"),
    ("completion prompt too long", "POST", COMP, comp(prompt=LONG_PROMPT), 400, "prompt"),
    ("GET on chat", "GET", CHAT, None, 405, None),
    ("PUT on completions", "PUT", COMP, comp(), 405, None),
    ("unknown path", "POST", "/v1/embeddings", chat(), 404, None),
    ("unknown model card", "GET", "/v1/models/gpt-9", None, 404, "model"),
]


def _check_error(r: httpx.Response, status: int, param: str | None, name: str) -> None:
    assert r.status_code == status, f"{name}: {r.status_code} {r.text[:300]}"
    body = r.json()
    assert set(body) == {"error"}, name
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, name
    assert isinstance(err["message"], str) and len(err["message"]) > 10, name
    assert err["type"] in ("invalid_request_error", "server_error"), name
    if param is not None:
        assert err["param"] == param, f"{name}: param {err['param']!r}, message {err['message']!r}"


def test_there_are_fifty_cases() -> None:
    assert len(CASES) >= 50
    assert len({c[0] for c in CASES}) == len(CASES)


def test_malformed_requests(server: ServerProc) -> None:
    failures = []
    with server.client() as c:
        for name, method, path, body, status, param in CASES:
            r = c.request(method, path, content=body, headers={"content-type": "application/json"})
            try:
                _check_error(r, status, param, name)
            except AssertionError as e:
                failures.append(str(e))
            assert server.alive(), f"the server died on {name!r}"
    assert not failures, "\n".join(failures)
    # Still serving, and it counted the refusals.
    assert server.get("/health").json()["status"] == "ready"
    ok = server.post(CHAT, json.loads(chat()))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    requests = server.get("/stats").json()["requests"]
    rejected = sum(r["count"] for r in requests if r["outcome"] == "rejected")
    # All that reached a route (not 405s, not the body limit, which answers before any route).
    routed = [c for c in CASES if c[2] in (CHAT, COMP) and c[4] not in (405, 413)]
    assert rejected >= len(routed)


def test_oversize_chunked_body(server: ServerProc) -> None:
    """No Content-Length (chunked transfer): the limit applies while reading."""
    with server.client() as c:
        r = c.post(CHAT, content=_chunks(BIG), headers={"content-type": "application/json"})
    _check_error(r, 413, None, "chunked oversize")
    assert server.alive()


def test_context_error_says_what_to_do(server: ServerProc) -> None:
    r = server.post(CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]})
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert str(MAX_CONTEXT) in err["message"] and "--max-context" in err["message"]


def test_form_content_type_is_accepted(server: ServerProc) -> None:
    """curl -d sends application/x-www-form-urlencoded; the body is JSON all the same."""
    r = httpx.post(
        server.url + CHAT,
        content=chat(),
        headers={**server.headers, "content-type": "application/x-www-form-urlencoded"},
        timeout=60,
    )
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/models", "/health", "/v1/health"])
def test_get_endpoints_answer(server: ServerProc, path: str) -> None:
    assert server.get(path).status_code == 200


def test_a_prompt_far_beyond_the_context_is_refused_from_its_length(server: ServerProc) -> None:
    """900 KB of text: refused before it is tokenized (the message gives the bound from its bytes), for a completion
    and for a chat; the server answers /health as before."""
    text = "lorem ipsum dolor sit amet " * 34_000
    for path, body in (
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ):
        r = server.post(path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert "at least" in err["message"] and f"the context holds {MAX_CONTEXT}" in err["message"]
        assert err["param"] == ("prompt" if path == "/v1/completions" else "messages")
    assert server.get("/health").json()["status"] == "ready"


def test_any_model_name_is_answered_by_the_model_loaded(server: ServerProc) -> None:
    """As llama-server and LM Studio: one model is loaded, so a client's own model name gets it; the model list
    says so, and a card lookup by an unknown name is still a 404."""
    served = server.get("/v1/models").json()["data"][0]
    assert served["answers_any_name"] is True and "gpt-test" in served["aliases"]
    r = server.post(CHAT, json.loads(chat(model="gpt-9")))
    assert r.status_code == 200 and r.json()["model"] == served["id"]
    assert server.get("/v1/models/gpt-9").status_code == 404
