"""An engine failure in the middle of a generation: the request gets a 500 (or an error event in its stream), the
server keeps serving, and the next answer is right. The server runs in a thread of this process here, so that the
test can make the model's step fail."""

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from engine.serve.app import create_app
from engine.serve.cli import bind
from engine.serve.options import ServeOptions
from engine.serve.serving import EngineService


@pytest.fixture(scope="module")
def live(tiny_model: Path) -> Iterator[tuple[str, EngineService]]:
    service = EngineService(ServeOptions(model=tiny_model, device="cpu", max_context=256, threads=1))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), log_config=None, log_level="warning", ws="none")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).json()["status"] == "ready":
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield url, service
    server.should_exit = True
    thread.join(10)


def _break_after(service: EngineService, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's forward raises on its (steps+1)-th call, as a CUDA error or a bug would."""
    assert service.lm is not None
    model = service.lm.model
    real = model.forward
    calls = {"n": 0}

    def failing(*args, **kw):
        calls["n"] += 1
        if calls["n"] > steps:
            raise RuntimeError("simulated device failure")
        return real(*args, **kw)

    monkeypatch.setattr(model, "forward", failing)


BODY = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 8, "temperature": 0}


def test_failure_gives_500_and_the_server_goes_on(live, monkeypatch: pytest.MonkeyPatch) -> None:
    url, service = live
    good = httpx.post(url + "/v1/chat/completions", json={**BODY, "cache_prompt": False}, timeout=60).json()
    _break_after(service, 3, monkeypatch)
    r = httpx.post(url + "/v1/chat/completions", json={**BODY, "cache_prompt": False}, timeout=60)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "generation_failed" and "simulated device failure" in err["message"]
    monkeypatch.undo()
    _break_after(service, 3, monkeypatch)
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**BODY, "stream": True, "cache_prompt": False}, timeout=60
    ) as s:
        assert s.status_code == 200
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-1][6:])["error"]["code"] == "generation_failed"
    monkeypatch.undo()
    # The failed sequence's KV was dropped (only the good request's kept copy may be reused): the next answer
    # is the one from before the failure.
    again = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=60).json()
    assert again["choices"][0]["message"]["content"] == good["choices"][0]["message"]["content"]
    outcomes = {(r["endpoint"], r["outcome"]): r["count"] for r in service.stats().model_dump()["requests"]}
    assert outcomes[("chat", "error")] == 2 and outcomes[("chat", "ok")] == 2
