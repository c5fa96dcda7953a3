"""API key, binding rules, background loading and a model that fails to load."""

import json
from pathlib import Path

import httpx
import pytest

from engine.cli import main
from engine.serve.cli import is_loopback
from tests.engine.serve.harness import ServerProc, start_server

PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/models", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("GET", "/metrics", None),
    ("GET", "/stats", None),
    ("GET", "/events", None),
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-key", "Bearer test-key-12", "Basic dGVzdA==", "test-key-123"]
)
def test_missing_or_wrong_key_is_401(
    server: ServerProc, method: str, path: str, body: dict | None, auth: str | None
) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "API key" in err["message"]
    assert r.headers["www-authenticate"] == "Bearer"


def test_right_key_passes_and_health_is_public(server: ServerProc) -> None:
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ready"
    assert httpx.get(server.url + "/v1/models", headers=server.headers, timeout=30).status_code == 200
    assert (
        httpx.get(server.url + "/v1/models", headers={"x-api-key": server.key or ""}, timeout=30).status_code
        == 200
    )
    assert (
        httpx.get(
            server.url + "/v1/models", headers={"Authorization": f"bearer {server.key}"}, timeout=30
        ).status_code
        == 200
    )


def test_is_loopback() -> None:
    assert (
        is_loopback("127.0.0.1")
        and is_loopback("127.1.2.3")
        and is_loopback("::1")
        and is_loopback("localhost")
    )
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("::")
    assert not is_loopback("myhost.lan")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5"])
def test_non_loopback_without_key_refuses_to_start(
    tiny_model: Path, host: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    rc = main(["serve", "--model", str(tiny_model), "--host", host, "--port", "0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"refusing to listen on {host} without an API key" in err and "--api-key" in err


def test_bad_options_refuse_to_start(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", str(tmp_path / "missing.gguf"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny_model), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny_model), "--max-context", "4"]) == 2
    assert "--max-context" in capsys.readouterr().err


def test_loading_then_error_with_reason(tmp_path: Path) -> None:
    """A file that is not a GGUF: the server comes up, /health says loading then error with the reason, and
    generation requests get 503 with that reason; no API key is needed on 127.0.0.1."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file" * 100)
    srv = start_server(bad, key=None, wait_ready=False)
    try:
        first = httpx.get(srv.url + "/health", timeout=30).json()
        assert first["status"] in ("loading", "error")
        h = srv.wait_status({"error", "ready"})
        assert h["status"] == "error" and "broken.gguf" in h["error"]
        r = httpx.post(
            srv.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
            timeout=30,
        )
        assert r.status_code == 503
        assert (
            r.json()["error"]["code"] == "model_load_failed" and "broken.gguf" in r.json()["error"]["message"]
        )
        assert httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["status"] == "error"
        assert srv.alive()
    finally:
        srv.stop()


def test_config_file(tiny_model: Path, tmp_path: Path) -> None:
    """--config gives the model and args; flags on the command line win over the file."""
    cfg = tmp_path / "strata-tiny.json"
    cfg.write_text(
        json.dumps({"model": str(tiny_model), "args": ["--max-context", "256", "--alias", "from-config"]})
    )
    srv = start_server(None, "--config", str(cfg), "--max-queue", "3", "--threads", "1", key=None)
    try:
        card = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
        assert card["meta"]["n_ctx"] == 256
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "from-config", "prompt": "hi", "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code == 200
        assert httpx.get(srv.url + "/stats", timeout=30).json()["queue"]["max"] == 3
    finally:
        srv.stop()


def test_shutdown_ends_streams_and_queue(tiny_model: Path) -> None:
    """SIGTERM with an event stream open, a long generation streaming and a request queued: each client gets
    its end at once and the process exits well within uvicorn's grace period."""
    import signal
    import threading
    import time

    srv = start_server(
        tiny_model, "--threads", "1", "--parallel", "1", key=None
    )  # one slot: the second waits
    got: dict[str, str] = {}

    def events() -> None:
        with httpx.stream("GET", srv.url + "/events", timeout=30) as r:
            for _ in r.iter_lines():
                pass
        got["events"] = "closed"

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 1800, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            got["stream"] = [line for line in r.iter_lines() if line][-1]

    def queued() -> None:
        got["queued"] = httpx.post(srv.url + "/v1/completions", json={"prompt": "y"}, timeout=30).text

    threads = [threading.Thread(target=f) for f in (events, stream, queued)]
    try:
        threads[0].start()
        threads[1].start()
        deadline = time.monotonic() + 10
        while not httpx.get(srv.url + "/stats", timeout=5).json()["queue"]["active"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        threads[2].start()
        while not httpx.get(srv.url + "/stats", timeout=5).json()["queue"]["waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(10)
        assert time.perf_counter() - t0 < 1.5
        for t in threads:
            t.join(5)
        assert got["events"] == "closed"
        assert "shutting_down" in got["stream"] and "shutting_down" in got["queued"]
    finally:
        srv.stop()
