"""llama-server's /tokenize, /detokenize, /props and /slots on the shared server: the model's own tokenizer, the
slots /stats reports, llama-server's field names, and clear refusals."""

import json
from pathlib import Path

from engine.gguf.reader import GGUFFile
from engine.tokenizer import Tokenizer
from tests.engine.serve.conftest import MAX_CONTEXT
from tests.engine.serve.harness import ServerProc

TEXT = "Hello world: <|im_start|> naïve façade, 12345"


def test_tokenize_and_detokenize_round_trip(server: ServerProc, tiny_model: Path) -> None:
    tok = Tokenizer.from_metadata(GGUFFile.open(tiny_model).metadata)
    r = server.post("/tokenize", {"content": TEXT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == tok.encode(TEXT, add_special=False) and ids
    plain = server.post("/tokenize", {"content": TEXT, "parse_special": False}).json()["tokens"]
    assert plain == tok.encode(TEXT, add_special=False, parse_special=False) and len(plain) > len(ids)
    pieces = server.post("/tokenize", {"content": TEXT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert all(isinstance(p["piece"], str | list) for p in pieces)
    back = server.post("/detokenize", {"tokens": ids}).json()["content"]
    assert back == tok.decode(ids) and "naïve façade" in back


def test_refusals_name_the_field(server: ServerProc) -> None:
    r = server.post("/detokenize", {"tokens": [1, 10**6]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = server.post("/tokenize", {"content": "x", "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = server.post("/tokenize", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "content"


def test_props_and_slots_say_what_stats_says(server: ServerProc) -> None:
    stats = server.get("/stats").json()
    total = stats["slots"]["total"] if stats["slots"] else 1
    props = server.get("/props").json()
    assert props["total_slots"] == total
    assert props["default_generation_settings"]["n_ctx"] == MAX_CONTEXT
    assert props["default_generation_settings"]["params"]["top_k"] == 40
    assert isinstance(props["chat_template"], str) and props["model_path"].endswith(".gguf")
    slots = server.get("/slots").json()
    assert [s["id"] for s in slots] == list(range(total))
    assert all(s["n_ctx"] == MAX_CONTEXT and s["is_processing"] is False for s in slots)


def test_completion_whole_and_streamed_as_llama_server_answers(server: ServerProc) -> None:
    body = {"prompt": "jade harbor", "n_predict": 8, "temperature": 0, "ignore_eos": True}
    want = server.post("/v1/completions", {"prompt": "jade harbor", "max_tokens": 8, "temperature": 0,
                                           "ignore_eos": True}).json()  # fmt: skip
    r = server.post(
        "/completion", {**body, "typical_p": 1.0, "mirostat": 0, "samplers": ["top_k"], "id_slot": -1}
    )
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["content"] == want["choices"][0]["text"] and j["stop"] is True
    assert j["tokens_predicted"] == 8 and j["stopped_limit"] is True
    assert j["tokens_evaluated"] == want["usage"]["prompt_tokens"] and j["timings"]["predicted_n"] == 8
    with server.client() as c, c.stream("POST", "/completion", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == j["content"]


def test_completion_refuses_what_it_cannot_honour(server: ServerProc) -> None:
    for field, value in (("grammar", "root ::= undefined-rule"), ("json_schema", {"type": 5}), ("n_probs", 3),
                         ("logit_bias", [[1, "much"]]),
                         ("n_predict", 0), ("frobnicate", 1)):  # fmt: skip
        r = server.post("/completion", {"prompt": "x", field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field


def test_logit_bias_forces_and_bans_tokens_in_both_dialects(server: ServerProc, tiny_model: Path) -> None:
    tok = Tokenizer.from_metadata(GGUFFile.open(tiny_model).metadata)
    body = {"prompt": "jade harbor", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    free = server.post("/v1/completions", body).json()["choices"][0]["text"]
    forced = server.post("/v1/completions", {**body, "logit_bias": {"77": 100}}).json()["choices"][0]["text"]
    assert forced == tok.decode([77] * 4)
    first = tok.encode(free, add_special=False)[0]
    banned = server.post("/v1/completions", {**body, "logit_bias": {str(first): -100}}).json()
    assert tok.encode(banned["choices"][0]["text"], add_special=False)[0] != first
    llama = {"prompt": "jade harbor", "n_predict": 4, "temperature": 0, "ignore_eos": True}
    assert server.post("/completion", {**llama, "logit_bias": [[77, 100]]}).json()["content"] == forced
    assert server.post("/completion", {**llama, "logit_bias": {"77": 100}}).json()["content"] == forced
    r = server.post("/v1/completions", {**body, "logit_bias": {"999999": 5}})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
