"""A client that goes away cancels its generation: the engine is idle within 1 s, whether the request was
streaming, waiting for a whole answer, or still in the queue."""

import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.engine.serve.harness import ServerProc

LONG = {"max_tokens": 1800, "ignore_eos": True, "temperature": 0}  # seconds of work


def _queue(server: ServerProc) -> dict[str, Any]:
    return server.get("/stats").json()["queue"]


def _cancelled(server: ServerProc) -> int:
    return sum(r["count"] for r in server.get("/stats").json()["requests"] if r["outcome"] == "cancelled")


def _idle_after(server: ServerProc, t0: float, limit: float = 1.0) -> float:
    """Seconds from t0 until /stats shows no active and no waiting request (fails past `limit`)."""
    while True:
        q = _queue(server)
        dt = time.perf_counter() - t0
        if q["active"] == 0 and q["waiting"] == 0:
            return dt
        assert dt < limit, f"still busy {dt:.2f} s after the client left: {q}"
        time.sleep(0.01)


def _wait_active(server: ServerProc, generated_at_least: int = 1) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        q = _queue(server)
        if q["active"] and q["active_request"]["generated"] >= generated_at_least:
            return
        time.sleep(0.01)
    raise AssertionError("the request never started generating")


def _raw_post(server: ServerProc, path: str, body: bytes) -> socket.socket:
    """A request over a plain socket, so the test decides exactly when the connection closes."""
    u = urlsplit(server.url)
    s = socket.create_connection((u.hostname, u.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: Bearer {server.key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


def test_disconnect_mid_stream(server: ServerProc) -> None:
    before = _cancelled(server)
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True, **LONG}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            pieces = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    pieces += 1
                    if pieces >= 5:
                        break
        t0 = time.perf_counter()  # leaving the block closed the connection mid-stream
    dt = _idle_after(server, t0)
    assert _cancelled(server) == before + 1
    stats = server.get("/stats").json()
    # The request ended as cancelled, long before its 1800 tokens.
    assert stats["last_request"] is None or stats["last_request"].get("predicted_n") != 1800
    print(f"idle {dt * 1e3:.0f} ms after the disconnect")


def test_disconnect_while_waiting_for_whole_answer(server: ServerProc) -> None:
    before = _cancelled(server)
    s = _raw_post(
        server, "/v1/completions", b'{"prompt": "Once upon a time", "max_tokens": 1800, "ignore_eos": true}'
    )
    _wait_active(server, generated_at_least=3)
    t0 = time.perf_counter()
    s.close()
    _idle_after(server, t0)
    assert _cancelled(server) == before + 1


def test_disconnect_while_queued(server: ServerProc) -> None:
    """A queued request whose client left is dropped at once, and the one running is not disturbed."""
    before = _cancelled(server)
    result: dict[int, Any] = {}
    slots = (server.get("/stats").json()["slots"] or {"total": 1})["total"]

    def holder(i: int) -> None:
        body = {"prompt": f"The first request {i}", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        result[i] = server.post("/v1/completions", body)

    holders = [threading.Thread(target=holder, args=(i,)) for i in range(slots)]  # every slot busy
    for t in holders:
        t.start()
    deadline = time.monotonic() + 30
    while _queue(server)["active"] < slots:
        assert time.monotonic() < deadline, "the slots never filled"
        time.sleep(0.005)
    s = _raw_post(server, "/v1/completions", b'{"prompt": "The second request", "max_tokens": 5}')
    deadline = time.monotonic() + 10
    while _queue(server)["waiting"] != 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.005)
    s.close()
    t0 = time.perf_counter()
    while _queue(server)["waiting"] != 0:
        assert time.perf_counter() - t0 < 1.0, "the queued request stayed after its client left"
        time.sleep(0.005)
    for t in holders:
        t.join(60)
    for r in result.values():
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 200
    assert _cancelled(server) == before + 1
    _idle_after(server, time.perf_counter())
