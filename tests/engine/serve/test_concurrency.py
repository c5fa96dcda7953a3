"""8 clients x 20 requests at once: every answer complete and the one its own request gets when sent alone."""

import threading
import time

from tests.engine.serve.harness import ServerProc

CLIENTS = 8
PER_CLIENT = 20
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island", "jade"]
# 20 distinct prompts of different lengths (so usage.prompt_tokens tells them apart too)
PROMPTS = [" ".join([WORDS[i % 10]] * (1 + i // 10) + [str(i)]) for i in range(20)]
MAX_TOKENS = 4


def _ask(c, prompt: str, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "echo": True}
    if not stream:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        return {
            "text": j["choices"][0]["text"],
            "finish": j["choices"][0]["finish_reason"],
            "usage": j["usage"],
        }
    text, finish, usage = "", None, None
    with c.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            import json

            obj = json.loads(data)
            assert "error" not in obj, obj
            if obj["choices"]:
                text += obj["choices"][0]["text"]
                finish = obj["choices"][0]["finish_reason"] or finish
            if obj.get("usage"):
                usage = obj["usage"]
        assert done, "the stream ended without [DONE]"
    return {"text": text, "finish": finish, "usage": usage}


def test_concurrent_clients(server: ServerProc) -> None:
    with server.client() as c:
        alone = {p: _ask(c, p, stream=False) for p in PROMPTS}
    # The continuations differ between prompts, so a swapped answer would be seen even past the echo.
    assert len({a["text"].removeprefix(p) for p, a in alone.items()}) >= 10

    results: dict[tuple[int, int], tuple[str, dict]] = {}
    errors: list[str] = []

    def client(k: int) -> None:
        try:
            with server.client(timeout=120) as c:
                for i in range(PER_CLIENT):
                    prompt = PROMPTS[(k * 7 + i) % len(PROMPTS)]
                    results[(k, i)] = (prompt, _ask(c, prompt, stream=(k + i) % 2 == 0))
        except Exception as e:  # reported below with the client number
            errors.append(f"client {k}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    elapsed = time.perf_counter() - t0
    assert not errors, errors
    assert len(results) == CLIENTS * PER_CLIENT
    for (k, i), (prompt, got) in results.items():
        want = alone[prompt]
        assert got["text"] == want["text"], f"client {k} request {i}: {got['text']!r} != {want['text']!r}"
        assert got["finish"] == want["finish"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    stats = server.get("/stats").json()
    assert stats["queue"]["waiting"] == 0 and stats["queue"]["active"] == 0
    print(f"{CLIENTS * PER_CLIENT} concurrent requests in {elapsed:.1f} s")
