"""The real server as a subprocess (`python -m engine.cli serve ... --port 0`), for the serve tests."""

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse

KEY = "test-key-123"
READY_TIMEOUT_S = 90.0


@dataclass
class ServerProc:
    proc: subprocess.Popen[str]
    url: str
    key: str | None
    log: list[str] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=30.0, **kw)

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=60.0, **kw)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_status(self, wanted: set[str], timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(
                    f"the server exited ({self.proc.returncode}):\n" + "\n".join(self.log[-30:])
                )
            try:
                last = httpx.get(self.url + "/health", timeout=5.0).json()
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if last.get("status") in wanted:
                return last
            time.sleep(0.05)
        raise AssertionError(f"/health never said {wanted}: last {last}\n" + "\n".join(self.log[-30:]))

    def events_of(
        self, request: dict[str, Any], path: str = "/v1/completions"
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(the /events stream around one request to `path`, until its `request` event; the request's answer). The
        stream's content type is checked on the way."""
        events: list[dict[str, Any]] = []
        connected = threading.Event()

        def listen() -> None:
            with (
                httpx.Client(headers=self.headers, timeout=30) as c,
                connect_sse(c, "GET", self.url + "/events") as s,
            ):
                assert s.response.headers["content-type"].startswith("text/event-stream")
                connected.set()
                for sse in s.iter_sse():
                    events.append(json.loads(sse.data))
                    if events[-1]["type"] == "request":
                        return

        t = threading.Thread(target=listen)
        t.start()
        assert connected.wait(10)
        deadline = time.monotonic() + 10
        while self.get("/stats").json()["events"]["subscribers"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        answer = self.post(path, request)
        assert answer.status_code == 200, answer.text
        t.join(30)
        assert not t.is_alive()
        return events, answer.json()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(
    model: Path | None,
    *args: str,
    key: str | None = KEY,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
) -> ServerProc:
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--port", "0", *args]
    if model is not None:
        cmd += ["--model", str(model)]
    if key:
        cmd += ["--api-key", key]
    full = dict(os.environ)
    full.pop("STRATA_API_KEY", None)
    full.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full)
    assert proc.stderr is not None
    log: list[str] = []
    url = None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line.rstrip())
        if "listening on http://" in line:
            url = line.split("listening on ", 1)[1].split()[0]
            break
    if url is None:
        proc.kill()
        raise AssertionError("the server did not start:\n" + "\n".join(log[-30:]))

    def drain() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            log.append(line.rstrip())

    threading.Thread(target=drain, daemon=True).start()
    server = ServerProc(proc, url, key, log)
    if wait_ready:
        server.wait_status({"ready"})
    return server
