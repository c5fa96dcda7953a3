"""EngineController with a real QProcess running tests/app/fake_engine.py (HTTP on a free port)."""

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytestqt.qtbot import QtBot

from app.clients.engine_client import EngineClient
from app.controllers.engine import EngineController, EngineState
from app.settings import AppSettings
from tests.app.conftest import free_port


@pytest.fixture
def make_engine(qtbot: QtBot, fake_engine_command: list[str]) -> Iterator:
    made: list[EngineController] = []

    def make(command: list[str] | None = None, **settings: object) -> EngineController:
        s = AppSettings(port=free_port(), **settings)  # type: ignore[arg-type]
        ctl = EngineController(EngineClient(), s, command or fake_engine_command, poll_ms=50)
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        ctl.shutdown()


def test_start_loading_ready_stop(qtbot: QtBot, make_engine) -> None:
    engine = make_engine()
    states: list[str] = []
    engine.stateChanged.connect(states.append)
    events: list[dict] = []
    engine.engineEvent.connect(events.append)
    engine.start()
    port = str(engine.settings.port)
    assert engine.command()[-5:] == ["serve", "--host", "127.0.0.1", "--port", port]
    qtbot.waitUntil(lambda: engine.state == EngineState.READY, timeout=10000)
    assert states[:3] == ["starting", "loading", "ready"]
    assert engine.health["model"] == "default.gguf"
    qtbot.waitUntil(lambda: len(events) >= 2 and bool(engine.stats), timeout=5000)
    assert events[0]["type"] == "step" and engine.stats["arch"] == "qwen3moe"
    assert any("fake engine: serving" in line for line in engine.log_tail())
    with qtbot.waitSignal(engine.stateChanged, check_params_cb=lambda s: s == "stopped", timeout=8000):
        engine.stop()
    assert engine.exit_code == 0
    assert not engine.running


def test_crash_shows_log_tail_and_restart_works(
    qtbot: QtBot, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    monkeypatch.setenv("FAKE_CRASH_AFTER_S", "0.4")
    with qtbot.waitSignal(engine.crashed, timeout=10000) as got:
        engine.start()
    assert engine.state == EngineState.CRASHED
    assert (
        got.args[0]
        == "the engine exited with code 3: fake engine: error: CUDA out of memory while loading layer 7"
    )
    assert engine.log_tail(2)[0] == "fake engine: error: CUDA out of memory while loading layer 7"
    monkeypatch.delenv("FAKE_CRASH_AFTER_S")
    engine.restart()
    qtbot.waitUntil(lambda: engine.state == EngineState.READY, timeout=10000)


def test_restart_while_running_comes_back(qtbot: QtBot, make_engine) -> None:
    engine = make_engine()
    engine.start()
    qtbot.waitUntil(lambda: engine.state == EngineState.READY, timeout=10000)
    states: list[str] = []
    engine.stateChanged.connect(states.append)
    engine.restart()
    qtbot.waitUntil(lambda: engine.state == EngineState.READY, timeout=10000)
    assert states[0] == "stopping" and "stopped" in states and states[-1] == "ready"


def test_port_in_use_is_refused_before_start(qtbot: QtBot, make_engine) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        engine = make_engine()
        engine.settings = engine.settings.with_changes(port=busy.getsockname()[1])
        with qtbot.waitSignal(engine.startRefused, timeout=2000) as got:
            engine.start()
    assert "already in use" in got.args[0] and "choose another port in Settings" in got.args[0]
    assert engine.state == EngineState.STOPPED


def test_bad_settings_are_refused(qtbot: QtBot, make_engine, tmp_path: Path) -> None:
    engine = make_engine(model=str(tmp_path / "nope.gguf"))
    with qtbot.waitSignal(engine.startRefused, timeout=2000) as got:
        engine.start()
    assert "nope.gguf does not exist" in got.args[0]


def test_missing_executable_is_a_crash_with_a_reason(qtbot: QtBot, make_engine, tmp_path: Path) -> None:
    engine = make_engine(command=[str(tmp_path / "no-such-engine")])
    with qtbot.waitSignal(engine.crashed, timeout=5000) as got:
        engine.start()
    assert "could not be started" in got.args[0] and "reinstall" in got.args[0]
    assert engine.state == EngineState.CRASHED
    engine.stop()
    assert engine.state == EngineState.STOPPED


def test_a_degraded_engine_says_which_stage(
    qtbot: QtBot, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_HEALTH_ERROR", "stage 2 at 192.168.1.20:7000 does not answer")
    monkeypatch.setenv("FAKE_HEALTH_STATUS", "degraded")
    engine = make_engine()
    engine.start()
    qtbot.waitUntil(lambda: engine.state == EngineState.DEGRADED, timeout=10000)
    assert engine.message == "stage 2 at 192.168.1.20:7000 does not answer"
    assert engine.running
    with qtbot.waitSignal(engine.stateChanged, check_params_cb=lambda s: s == "stopped", timeout=8000):
        engine.stop()


def test_health_error_is_shown(qtbot: QtBot, make_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_HEALTH_ERROR", "CUDA out of memory on GPU 1")
    engine = make_engine()
    engine.start()
    qtbot.waitUntil(lambda: engine.state == EngineState.ERROR, timeout=10000)
    assert engine.message == "CUDA out of memory on GPU 1"
    assert engine.running  # the process lives: stop or restart is the user's call
    with qtbot.waitSignal(engine.stateChanged, check_params_cb=lambda s: s == "stopped", timeout=8000):
        engine.stop()


@pytest.mark.skipif(os.name == "nt", reason="signals are Unix's")
def test_a_killed_engine_says_which_signal_and_not_a_ready_line(qtbot: QtBot, make_engine) -> None:
    """The reported case: after `kill -9` the dialog gave "model ... ready in 3.9 s" (the last log line) as the
    reason. Now: the signal, and the last line that reports an error, or that there is none."""
    engine = make_engine()
    engine.start()
    qtbot.waitUntil(lambda: engine.state == EngineState.READY, timeout=10000)
    with qtbot.waitSignal(engine.crashed, timeout=10000) as got:
        os.kill(engine._proc.processId(), signal.SIGKILL)
    assert (
        got.args[0] == "the engine was ended by signal 9 (SIGKILL) (no error in its log: see its last lines)"
    )


def test_the_reason_is_the_last_error_line() -> None:
    from app.controllers.engine import ended_how, last_error

    log = [
        "loading",
        "engine: error: CUDA out of memory while loading layer 7",
        "model x ready in 3.9 s",
        "[app] x",
    ]
    assert last_error(log) == "engine: error: CUDA out of memory while loading layer 7"
    assert last_error(["model x ready in 3.9 s"]) == ""
    assert ended_how(3, False) == "exited with code 3"
