"""A model file without a chat template (a SentencePiece vocabulary without ChatML's tokens, as Gemma 3 270M) is
chatted with through the ChatML fallback; a reply that imitates the format writes `<|im_end|>` as plain text.
The chat endpoint ends the reply there and leaves the marker out; a raw completion keeps the text as written.

The server runs in this process (starlette's test client) on a tiny gemma3 model; its forward is wrapped so that
greedy decoding writes a fixed reply whatever the random weights say."""

import time
from collections.abc import Iterator

import pytest
import torch
from starlette.testclient import TestClient

from engine.serve.app import create_app
from engine.serve.options import ServeOptions
from engine.serve.serving import EngineService
from engine.testing.tiny_models import write_tiny_model

REPLY = "Sure, here it is.<|im_end|>\n<|im_start|>user\nAnd again"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, EngineService]]:
    path = write_tiny_model(
        tmp_path_factory.mktemp("fallback") / "tiny-gemma3.gguf", arch="gemma3", chat_template=False
    )
    service = EngineService(ServeOptions(model=path, device="cpu", max_context=256, threads=1))
    with TestClient(create_app(service)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").json()["status"] != "ready":
            assert time.monotonic() < deadline, c.get("/health").json()
            time.sleep(0.05)
        yield c, service


def _script_reply(service: EngineService, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The model's forward still runs (its cache advances) but its last row of logits names the next token of
    REPLY: the prompt's forward the first, each one-token step the next."""
    assert service.lm is not None
    tok, model = service.lm.tokenizer, service.lm.model
    reply = tok.encode(REPLY, add_special=False, parse_special=False)
    assert tok.token_id("<|im_end|>") is None  # the marker is text here, not an end-of-generation token
    real, steps = model.forward, {"n": 0}

    def scripted(tokens: torch.Tensor, cache: object, start: int, **kw: bool) -> torch.Tensor:
        logits = real(tokens, cache, start, **kw)
        if tokens.shape[0] == 1:
            steps["n"] += 1
        out = torch.full_like(logits, -1e4)
        out[-1, reply[min(steps["n"], len(reply) - 1)]] = 1e4
        return out

    monkeypatch.setattr(model, "forward", scripted)
    return reply


def test_chat_reply_ends_at_the_fallback_marker(
    client: tuple[TestClient, EngineService], monkeypatch: pytest.MonkeyPatch
) -> None:
    c, service = client
    assert service.lm is not None and service.lm.chat.is_fallback
    reply = _script_reply(service, monkeypatch)
    written = service.lm.tokenizer.decode(reply)
    assert "<|im_end|>" in written  # what the model writes
    body = {"messages": [{"role": "user", "content": "Show it"}], "max_tokens": len(reply), "temperature": 0}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # the reply's first piece carries SentencePiece's leading space, which a stream keeps
    assert choice["message"]["content"].lstrip() == REPLY[: REPLY.index("<|im_end|>")]
    assert choice["finish_reason"] == "stop"
    # streamed: the same text, the marker held back and never sent
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert "im_end" not in "".join(events) and '"finish_reason":"stop"' in events[-2].replace(" ", "")


def test_raw_completion_keeps_the_text(
    client: tuple[TestClient, EngineService], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No template, no template stops: a completion ends at its length with the marker in its text."""
    c, service = client
    reply = _script_reply(service, monkeypatch)
    r = c.post("/v1/completions", json={"prompt": "Show it", "max_tokens": len(reply), "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "<|im_end|>" in choice["text"] and choice["finish_reason"] == "length"
