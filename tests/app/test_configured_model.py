"""The configured model is served where a command names none: `strata --headless` (and so `./start.sh --headless`)
serves the app's settings' model or config, else the config strata-setup made this PC's, else the embedded one;
arguments that name a model or config win."""

import json
from pathlib import Path

import pytest

from app import engine_process
from installer.config import set_default_config


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path / "cfg"))
    seen: list[list[str]] = []
    monkeypatch.setattr(engine_process, "engine_command", lambda: ["strata-engine"])
    monkeypatch.setattr(engine_process.subprocess, "call", lambda cmd: seen.append(cmd) or 0)
    return seen


def test_headless_serves_the_setup_config_then_the_apps_choice(
    calls: list[list[str]], tmp_path: Path
) -> None:
    engine_process.run_headless(["--port", "9000"])
    assert calls[-1] == ["strata-engine", "serve", "--port", "9000"]  # nothing configured: the embedded model
    cfg = tmp_path / "cfg" / "strata-x.json"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("{}")
    set_default_config(cfg)
    engine_process.run_headless(["--port", "9000"])
    assert calls[-1] == ["strata-engine", "serve", "--config", str(cfg.resolve()), "--port", "9000"]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    (tmp_path / "cfg" / "app-settings.json").write_text(json.dumps({"model": str(model)}))
    engine_process.run_headless([])
    assert calls[-1] == ["strata-engine", "serve", "--model", str(model)]
    engine_process.run_headless(["--model=/other.gguf"])
    assert calls[-1] == ["strata-engine", "serve", "--model=/other.gguf"]


def test_a_configured_file_that_is_gone_is_not_served(calls: list[list[str]], tmp_path: Path) -> None:
    cfg = tmp_path / "cfg" / "strata-x.json"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("{}")
    set_default_config(cfg)
    cfg.unlink()
    engine_process.run_headless([])
    assert calls[-1] == ["strata-engine", "serve"]
