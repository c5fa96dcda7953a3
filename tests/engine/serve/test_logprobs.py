"""logprobs and top_logprobs through HTTP against the engine's own logits computed here on the same file (the
log-softmax of the raw logits, within 1e-4), whole and streamed, chat and completions."""

import json
from pathlib import Path

import torch

from engine.pipeline.loader import load_model
from tests.engine.serve.harness import ServerProc

PROMPT = [1, 17, 42, 99, 150, 7, 300]


def _reference(tiny_model: Path, n: int) -> list[torch.Tensor]:
    """The log-softmax row of each of the first n greedy tokens after PROMPT."""
    m = load_model(tiny_model, device="cpu", dtype="f32").model
    cache, ids, rows = m.new_cache(64, "f32"), list(PROMPT), []
    logits = m.forward(torch.tensor(ids), cache, 0)[-1]
    for _ in range(n):
        rows.append(torch.log_softmax(logits.double(), -1))
        tok = int(torch.argmax(logits))
        logits = m.forward(torch.tensor([tok]), cache, len(ids))[-1]
        ids.append(tok)
    return rows


def test_completion_logprobs_are_the_models_own(server: ServerProc, tiny_model: Path) -> None:
    ref = _reference(tiny_model, 4)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    lp = server.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    for row, got, top in zip(ref, lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert abs(got - float(row.max())) <= 1e-4  # greedy: the likeliest token
        want = sorted(row.tolist(), reverse=True)[:3]
        assert all(abs(a - b) <= 1e-4 for a, b in zip(sorted(top.values(), reverse=True), want, strict=False))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_chat_logprobs_whole_and_streamed(server: ServerProc) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = server.post("/v1/chat/completions", body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 6
    assert all(
        e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 and isinstance(e["bytes"], list) for e in content
    )
    assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [
        e
        for ch in chunks
        for choice in ch["choices"]
        if choice["logprobs"]
        for e in choice["logprobs"]["content"]
    ]
    assert len(streamed) == len(
        content
    )  # (a reused prompt prefix reads in other chunks: equal within rounding)
    assert all(abs(a["logprob"] - b["logprob"]) <= 1e-4 for a, b in zip(streamed, content, strict=True))
    off = server.post("/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": 0}).json()
    assert off["choices"][0]["logprobs"] is None
    r = server.post("/v1/chat/completions", {**body, "logprobs": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_n_choices_each_seeded_on_from_the_request_seed(server: ServerProc) -> None:
    body = {"prompt": "amber birch", "max_tokens": 5, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "ignore_eos": True, "seed": 11}  # fmt: skip
    three = server.post("/v1/completions", {**body, "n": 3, "logprobs": 1}).json()
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    for i, c in enumerate(three["choices"]):
        alone = server.post("/v1/completions", {**body, "seed": 11 + i}).json()["choices"][0]["text"]
        assert c["text"] == alone and len(c["logprobs"]["tokens"]) == 5
    assert three["usage"]["completion_tokens"] == 15
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "n": 2}
    two = server.post("/v1/chat/completions", chat).json()["choices"]
    assert len(two) == 2 and two[0]["message"] == two[1]["message"]  # greedy: the same answer twice
