"""A fake engine for the app's tests: real HTTP on 127.0.0.1 (the engine's API contract), canned answers.

In a thread: `FakeEngine()` serves /health, /stats, /v1/models, /v1/chat/completions (SSE), /events (SSE).
As a process: `python fake_engine.py serve --port N [...]` imitates `strata-engine serve` for the QProcess tests:
it logs to stdout, reports "loading" for FAKE_LOAD_S seconds, and with FAKE_CRASH_AFTER_S it dies with exit code 3
after printing an error, as a crashing engine would; with FAKE_HEALTH_ERROR its /health reports that error (as status FAKE_HEALTH_STATUS: error, or degraded).
"""

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _series(mean: float, n: int = 10) -> dict[str, Any]:
    return {
        "count": n,
        "total": mean * n,
        "mean": mean,
        "last": mean,
        "min": mean,
        "max": mean,
        "recent": mean,
    }


def _cache(in_vram: int, total: int, hits: int, misses: int) -> dict[str, Any]:
    return {"in_vram": in_vram, "total": total, "hits": hits, "misses": misses, "swaps": 0, "bytes_moved": 0,
            "computed_on_cpu": 0, "cpu_share": None, "hit_rate": round(hits / (hits + misses), 4)}  # fmt: skip


# A two-card split's GET /stats, in the engine's protocol (engine/serve/protocol.py `Stats`; the contract test
# validates it there).
STATS = {
    "status": "ready",
    "error": None,
    "model": "tiny-test.gguf",
    "version": "0.0.0",
    "uptime_s": 12.5,
    "queue": {"waiting": 0, "active": 0, "max": 64, "active_request": None},
    "totals": {
        "requests": 3,
        "prompt_tokens": 360,
        "prompt_cached_tokens": 0,
        "generated_tokens": 126,
        "prompt_seconds": 0.45,
        "decode_seconds": 4.2,
    },
    "requests": [{"endpoint": "chat", "outcome": "ok", "count": 3}],
    "last_request": {
        "endpoint": "chat",
        "outcome": "ok",
        "t": 1.7e9,
        "cache_n": 0,
        "prompt_n": 120,
        "prompt_ms": 150.0,
        "prompt_per_token_ms": 1.25,
        "prompt_per_second": 800.0,
        "predicted_n": 42,
        "predicted_ms": 1400.0,
        "predicted_per_token_ms": 33.333,
        "predicted_per_second": 30.0,
        "queued_ms": 0.0,
        "draft_n": 0,
        "draft_n_accepted": 0,
    },
    "events": {"subscribers": 1, "dropped": 0},
    "arch": "qwen3moe",
    "device": "cuda:0",
    "dtype": "bfloat16",
    "kv_type": "bf16",
    "max_context": 4096,
    "n_layer": 48,
    "stages": [
        {
            "stage": 0,
            "device": "cuda:0",
            "layers": [0, 12],
            "step_ms": _series(11.5),
            "prompt_chunk_ms": _series(90.0),
            "prompt_chunk_tokens": 120,
            "expert_cache": _cache(1536, 1536, 900, 100),
        },
        {
            "stage": 1,
            "device": "cuda:1",
            "layers": [12, 48],
            "step_ms": _series(19.0),
            "prompt_chunk_ms": _series(140.0),
            "prompt_chunk_tokens": 120,
            "expert_cache": _cache(3000, 4608, 700, 300),
        },
    ],
    "prompt_cache": None,
    "experts": None,
    "slots": {
        "total": 4,
        "busy": 0,
        "rows_per_step": {
            "count": 120,
            "total": 310.0,
            "mean": 2.6,
            "last": 1.0,
            "min": 1.0,
            "max": 4.0,
            "recent": 1.0,
        },
        "slots": [{"index": i, "state": "idle", "tokens": 0, "tokens_per_second": 0.0} for i in range(4)],
    },
}
STATS["experts"] = {
    "n_expert": 128, "n_expert_used": 8, "routed": 6144, "in_vram": 4536, "selections_total": 2016,
    "selections_per_layer": [42] * 48, "cache": [st["expert_cache"] for st in STATS["stages"]],  # type: ignore[index]
}  # fmt: skip


def health_body(status: str, model: str, error: str | None) -> dict[str, Any]:
    """GET /health in the engine's protocol (`Health`)."""
    return {"status": status, "model": model, "error": error, "queue": {"waiting": 0, "active": 0}}


# One decode step of a two-stage split as the engine reports it: each stage's compute, waiting and transfer.
SPLIT_EVENTS = [
    {"type": "step", "stage": 0, "ms": 12.0, "compute_ms": 12.0, "wait_ms": 0.0, "transfer_ms": 0.0,
     "layers": "0-11", "device": "cuda:0", "tokens": 1},
    {"type": "step", "stage": 1, "ms": 18.0, "compute_ms": 18.0, "wait_ms": 0.5, "transfer_ms": 1.2,
     "layers": "12-47", "device": "cuda:1", "tokens": 1},
]  # fmt: skip

TIMINGS = {
    "prompt_n": 5,
    "prompt_ms": 10.0,
    "prompt_per_second": 500.0,
    "predicted_n": 3,
    "predicted_ms": 60.0,
    "predicted_per_second": 50.0,
    "cache_n": 0,
}


class FakeEngine:
    def __init__(
        self,
        port: int = 0,
        health: Iterable[str] = ("ready",),
        chunks: Iterable[str] = ("Hello", ", ", "**world**"),
        chunk_delay_s: float = 0.0,
        events: Iterable[dict[str, Any]] = (),
        model: str = "tiny-test.gguf",
        chat_status: int = 200,
        api_key: str = "",
        ready_after_s: float | None = None,
        error_message: str = "CUDA out of memory on GPU 1",
    ) -> None:
        self.error_message = error_message
        self.health = list(health)
        self.ready_after_s = ready_after_s
        self.started = time.monotonic()
        self.chunks = list(chunks)
        self.chunk_delay_s = chunk_delay_s
        self.events = list(events)
        self.model = model
        self.chat_status = chat_status
        self.api_key = api_key
        self.requests: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.cancelled = threading.Event()
        self.events_clients = 0
        self._stopping = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeEngine":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.server.shutdown()
        self.server.server_close()

    def next_health(self) -> str:
        if self.ready_after_s is not None:
            return "ready" if time.monotonic() - self.started >= self.ready_after_s else "loading"
        return self.health.pop(0) if len(self.health) > 1 else self.health[0]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _json(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if engine.api_key and self.headers.get("Authorization") != f"Bearer {engine.api_key}":
                    self._json(401, {"error": {"message": "invalid API key", "type": "auth"}})
                    return False
                return True

            def _sse_start(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()

            def _sse(self, obj: Any) -> None:
                payload = obj if isinstance(obj, str) else json.dumps(obj)
                self.wfile.write(f"data: {payload}\n\n".encode())
                self.wfile.flush()

            def do_GET(self) -> None:
                engine.paths.append(self.path)
                if self.path == "/health":
                    status = engine.next_health()
                    error = engine.error_message if status in ("error", "degraded") else None
                    self._json(200, health_body(status, engine.model, error))
                elif not self._authorized():
                    return
                elif self.path == "/stats":
                    self._json(200, {**STATS, "model": engine.model})
                elif self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": engine.model, "object": "model"}]})
                elif self.path == "/events":
                    engine.events_clients += 1
                    self._sse_start()
                    try:
                        for ev in engine.events:
                            self._sse({**ev, "t": time.time()})
                        while not engine._stopping.wait(0.2):
                            self.wfile.write(b": keep-alive\n\n")
                            self.wfile.flush()
                    except OSError:
                        pass
                    self.close_connection = True
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                engine.paths.append(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if not self._authorized():
                    return
                if self.path != "/v1/chat/completions":
                    self._json(404, {"error": {"message": f"no route {self.path}"}})
                    return
                engine.requests.append(body)
                if engine.chat_status != 200:
                    self._json(engine.chat_status, {"error": {"message": "max_tokens must be positive"}})
                    return
                self._sse_start()
                base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": engine.model}
                try:
                    for piece in engine.chunks:
                        if engine.chunk_delay_s:
                            time.sleep(engine.chunk_delay_s)
                        self._sse({**base, "choices": [{"index": 0, "delta": {"content": piece}}]})
                    self._sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                    usage = {"prompt_tokens": 5, "completion_tokens": len(engine.chunks), "total_tokens": 8}
                    self._sse({**base, "choices": [], "usage": usage, "timings": TIMINGS})
                    self._sse("[DONE]")
                except OSError:
                    engine.cancelled.set()
                self.close_connection = True

        return Handler


def main(argv: list[str]) -> int:
    """`fake_engine.py serve --port N ...`: the process the EngineController tests start instead of the engine."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("command")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="")
    p.add_argument("--config", default="")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--api-key", default="")
    args = p.parse_args(argv)
    load_s = float(os.environ.get("FAKE_LOAD_S", "0.3"))
    engine = FakeEngine(
        port=args.port,
        ready_after_s=None if os.environ.get("FAKE_HEALTH_ERROR") else load_s,
        health=["loading", os.environ.get("FAKE_HEALTH_STATUS", "error")],
        error_message=os.environ.get("FAKE_HEALTH_ERROR", ""),
        model=args.model or "default.gguf",
        chunk_delay_s=0.02,
        events=SPLIT_EVENTS,
    )
    print(f"fake engine: serving {engine.model} on {args.host}:{engine.port}", flush=True)
    if args.config:
        print(f"fake engine: config {args.config}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (print("fake engine: stopping", flush=True), sys.exit(0)))
    engine.start()
    crash = os.environ.get("FAKE_CRASH_AFTER_S")
    if crash:
        time.sleep(float(crash))
        print("fake engine: error: CUDA out of memory while loading layer 7", flush=True)
        os._exit(3)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
