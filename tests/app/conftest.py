"""Fixtures for the app's tests: Qt offscreen, throw-away data/config dirs, a fake engine over real HTTP."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.fake_engine import FakeEngine

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _app_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversations, settings and log-in entries of each test go to its own folder."""
    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))  # autostart entries
    monkeypatch.delenv("FAKE_CRASH_AFTER_S", raising=False)
    monkeypatch.delenv("FAKE_HEALTH_ERROR", raising=False)


@pytest.fixture
def fake_engine() -> Iterator[FakeEngine]:
    engine = FakeEngine(
        events=[
            {"type": "prompt_chunk", "stage": 0, "tokens": 512, "ms": 140.0},
            {"type": "step", "stage": 0, "ms": 11.0},
            {"type": "step", "stage": 1, "ms": 18.0},
            {"type": "request", "prompt_per_second": 900.0, "predicted_per_second": 31.0},
        ]
    ).start()
    yield engine
    engine.stop()


@pytest.fixture
def fake_engine_command() -> list[str]:
    """Starts tests/app/fake_engine.py instead of `strata-engine` (the controller appends `serve ...`)."""
    return [sys.executable, str(FAKE_ENGINE)]


def chat_once(qtbot: object, app: object, text: str) -> object:
    """Send `text` from the app's chat window and wait for the answer -> the assistant's message (checked)."""
    chat = app.open_chat()  # type: ignore[attr-defined]
    chat.input.setPlainText(text)
    chat.send_button.click()
    qtbot.waitUntil(lambda: not app.chat.busy, timeout=60_000)  # type: ignore[attr-defined]
    answer = app.chat.current.messages[-1]  # type: ignore[attr-defined]
    assert answer.role == "assistant" and answer.content, answer.stats
    return answer
