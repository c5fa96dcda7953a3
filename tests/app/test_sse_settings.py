"""The SSE parser and the app settings (pure code, no Qt event loop)."""

import json
from pathlib import Path

import pytest

from app.clients.sse import SseParser
from app.settings import AppSettings, Sampling, SettingsError, load_settings, save_settings


def test_sse_parser_joins_events_split_anywhere() -> None:
    stream = b'data: {"a": 1}\r\n\r\n: keep-alive\n\nevent: x\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n'
    for cut in range(len(stream)):
        p = SseParser()
        events = p.feed(stream[:cut]) + p.feed(stream[cut:])
        assert [(e.event, e.data) for e in events] == [
            ("message", '{"a": 1}'),
            ("x", "line1\nline2"),
            ("message", "[DONE]"),
        ]


def test_sse_parser_keeps_partial_line() -> None:
    p = SseParser()
    assert p.feed(b"data: hel") == []
    assert p.feed(b"lo\n") == []
    assert [e.data for e in p.feed(b"\n")] == ["hello"]


def test_serve_args_follow_settings(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    s = AppSettings(model=str(model), device="cpu", port=9001, max_context=2048, api_key="k")
    assert s.serve_args() == [
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
        "--max-context",
        "2048",
        "--model",
        str(model),
        "--device",
        "cpu",
    ]  # the key is not on the command line, where `ps` shows it: in the engine's environment
    assert s.engine_env() == {"STRATA_API_KEY": "k"} and AppSettings().engine_env() == {}
    assert AppSettings().serve_args() == ["--host", "127.0.0.1", "--port", "8080"]
    assert s.api_url == "http://127.0.0.1:9001/v1"
    assert AppSettings(host="0.0.0.0", port=5).base_url == "http://127.0.0.1:5"
    assert s.validate() == []


def test_validate_says_what_is_wrong(tmp_path: Path) -> None:
    problems = AppSettings(
        model=str(tmp_path / "missing.gguf"), device="tpu", port=0, host="0.0.0.0"
    ).validate()
    text = "\n".join(problems)
    assert "missing.gguf does not exist" in text
    assert "device 'tpu'" in text
    assert "port 0" in text
    assert "no API key" in text
    assert len(problems) == 4


def test_settings_round_trip_and_first_run(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    assert load_settings(path) == (AppSettings(), False)
    s = AppSettings(port=8123, sampling=Sampling(temperature=0.2, seed=7), extra_args=("--kv", "int8"))
    save_settings(s, path)
    loaded, existed = load_settings(path)
    assert existed and loaded == s
    assert json.loads(path.read_text())["sampling"]["seed"] == 7


def test_unreadable_settings_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("{not json")
    with pytest.raises(SettingsError, match=r"s\.json cannot be read"):
        load_settings(path)


def test_sampling_request_fields() -> None:
    assert Sampling(seed=None).request_fields().keys() == {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
    }
    assert Sampling(seed=3).request_fields()["seed"] == 3
