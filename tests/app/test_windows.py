"""The windows and the tray, driven like a user would, on top of a fake engine process and a fake two-card NVML."""

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication
from pytestqt.qtbot import QtBot

from app.application import StrataApp
from app.controllers.engine import EngineState
from app.settings import AppSettings
from tests.app.conftest import free_port
from tests.app.fake_engine import FakeEngine
from tests.app.fake_nvml import two_cards
from tests.app.test_nodes import FAKE_NODE, SEED_PC

Make = Callable[..., StrataApp]


@pytest.fixture
def make_app(qtbot: QtBot, fake_engine_command: list[str]) -> Iterator[Make]:
    made: list[StrataApp] = []

    def make(
        tray: bool = True, autostart: bool = True, make_wizard: object = None, **settings: object
    ) -> StrataApp:
        s = AppSettings(port=free_port(), autostart_engine=autostart, **settings)  # type: ignore[arg-type]
        saved: list[AppSettings] = []
        app = StrataApp(
            s,
            engine_command=fake_engine_command,
            node_command=FAKE_NODE,
            tray_reason=None if tray else "this desktop has no system tray",
            nvml=two_cards(),
            probe_fn=lambda: SEED_PC,
            save=saved.append,
            poll_ms=50,
            make_wizard=make_wizard,  # type: ignore[arg-type]
        )
        app.saved = saved  # type: ignore[attr-defined]
        app.quits = []  # type: ignore[attr-defined]
        app.exit_app = lambda: app.quits.append(True)  # type: ignore[attr-defined]
        qtbot.addWidget(app.window)
        made.append(app)
        return app

    yield make
    for app in made:
        app.shutdown()
        if app.chat_window is not None:
            app.chat_window.deleteLater()


def ready(qtbot: QtBot, app: StrataApp) -> None:
    qtbot.waitUntil(lambda: app.engine.state == EngineState.READY, timeout=10000)


def test_main_window_follows_the_engine(qtbot: QtBot, make_app: Make) -> None:
    app = make_app()
    win = app.window
    app.start()
    assert win.state_label.text() in ("Starting", "Loading the model")
    assert not win.start_button.isEnabled() and win.stop_button.isEnabled()
    ready(qtbot, app)
    assert win.state_label.text() == "Ready"
    assert win.model_label.text() == "Model: default.gguf"
    assert win.url_label.text() == app.settings.api_url
    page = win.engine_page
    qtbot.waitUntil(lambda: page.table.rowCount() == 2, timeout=5000)
    assert [page.table.item(1, c).text() for c in range(7)] == [
        "1",
        "this PC",
        "cuda:1",
        "12–47",
        "3000 of 4608",
        "70.0%",
        "19.0 ms",
    ]
    assert page.picture.layers == 48 and [(s.begin, s.end) for s in page.picture.segments] == [
        (0, 12),
        (12, 48),
    ]
    assert "routed experts in VRAM: 4536 of 6144" in page.split_note.text()
    assert "fake engine: serving default.gguf" in page.log.toPlainText()
    # charts: the engine's events and the sampled cards arrive, the flagged card is marked on its row
    win.tabs.setCurrentWidget(win.charts_page)
    qtbot.waitUntil(lambda: app.charts.events_seen >= 2 and len(app.charts.gpus) == 2, timeout=5000)
    win.show()
    win.charts_page.redraw()
    assert set(win.charts_page.gpu_rows) == {"local:0", "local:1"}
    assert "GPU 0 (NVIDIA GeForce RTX 3090)" == win.charts_page.gpu_rows["local:0"].title()
    assert "decode now" in win.charts_page.summary.text()
    rows = win.charts_page.stage_rows
    assert set(rows) == {0, 1} and rows[1].title() == "Stage 1 · layers 12-47 on cuda:1"
    assert rows[1].text.text() == (
        "per step (median of the last 5 s): compute 18.00 ms · waiting 0.50 ms · transfer 1.20 ms"
    )
    with qtbot.waitSignal(app.engine.stateChanged, check_params_cb=lambda s: s == "stopped", timeout=8000):
        win.stop_button.click()
    assert win.start_button.isEnabled() and win.state_label.text() == "Stopped"
    assert page.table.rowCount() == 0


def test_crash_dialog_and_restart(qtbot: QtBot, make_app: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CRASH_AFTER_S", "0.3")
    app = make_app()
    app.start(show=False)
    dialog = app.window.crash_dialog
    qtbot.waitUntil(dialog.isVisible, timeout=10000)
    assert dialog.text.startswith("The engine exited with code 3")
    assert "CUDA out of memory while loading layer 7" in dialog.tail.toPlainText()
    assert app.window.message.text().startswith("The engine exited with code 3")
    assert app.window.restart_button.isEnabled()
    monkeypatch.delenv("FAKE_CRASH_AFTER_S")
    dialog.restart_button.click()
    assert not dialog.isVisible()
    ready(qtbot, app)


def test_close_keeps_the_server_in_the_tray(qtbot: QtBot, make_app: Make) -> None:
    app = make_app(tray=True)
    app.start()
    ready(qtbot, app)
    assert not app.window.tray_banner.isVisible()
    app.window.close()
    assert not app.window.isVisible()
    assert app.engine.state == EngineState.READY and app.quits == []
    tray = app.tray
    assert tray is not None
    assert tray.state_action.text() == f"Engine: ready · {app.settings.api_url}"
    tray.copy_action.trigger()
    assert QGuiApplication.clipboard().text() == app.settings.api_url
    tray.window_action.trigger()
    assert app.window.isVisible()
    tray.chat_action.trigger()
    assert app.chat_window is not None and app.chat_window.isVisible()
    with qtbot.waitSignal(app.engine.stateChanged, check_params_cb=lambda s: s == "stopped", timeout=8000):
        tray.stop_action.trigger()
    assert tray.start_action.isEnabled() and not tray.stop_action.isEnabled()
    assert tray.state_action.text() == "Engine: stopped"
    tray.start_action.trigger()
    ready(qtbot, app)
    tray.quit_action.trigger()
    assert app.quits == [True] and app.engine.state == EngineState.STOPPED


def test_without_a_tray_the_window_says_so_and_closing_quits(qtbot: QtBot, make_app: Make) -> None:
    app = make_app(tray=False)
    app.start()
    ready(qtbot, app)
    assert app.tray is None
    assert app.window.tray_banner.isVisible()
    assert "No tray icon: this desktop has no system tray" in app.window.tray_banner.text()
    app.window.close()
    assert app.quits == [True] and app.engine.state == EngineState.STOPPED


def test_chat_window_streams_stops_regenerates(qtbot: QtBot, make_app: Make) -> None:
    app = make_app(autostart=False)
    fake = FakeEngine(port=app.settings.port).start()  # an engine that is already up, as after a start
    try:
        chat = app.open_chat()
        assert chat.start_button.isVisible() and "not running" in chat.banner.text()
        assert not chat.send_button.isEnabled()  # nothing to answer: the banner offers to start the engine
        chat.input.setPlainText("Hi there")
        qtbot.keyClick(chat.input, Qt.Key.Key_Return)
        assert chat.input.toPlainText() == "Hi there" and not app.chat.current.messages  # Enter sends nothing
        app.engine._set_state(EngineState.READY)  # as after a start: the engine answers
        assert chat.send_button.isEnabled()
        chat.settings_toggle.click()
        qtbot.waitUntil(lambda: chat.sampling.isVisible(), timeout=2000)
        QApplication.processEvents()
        assert chat.conv_list.width() >= 150  # the panel's fields no longer squeeze the conversation list
        chat.sampling.temperature.setValue(0.25)
        chat.sampling.system.setPlainText("Answer briefly.")
        chat.input.setPlainText("Hi there")
        qtbot.keyClick(chat.input, Qt.Key.Key_Return)
        assert chat.input.toPlainText() == ""
        qtbot.waitUntil(lambda: not app.chat.busy, timeout=5000)
        qtbot.waitUntil(lambda: "Hello, world" in chat.transcript.toPlainText(), timeout=2000)
        text = chat.transcript.toPlainText()
        assert (
            "You\nHi there" in text and "Assistant\nHello, world" in text and "3 tokens at 50.0 tok/s" in text
        )
        assert "font-weight:700" in chat.transcript.toHtml().split("world")[0][-200:]  # **world** is bold
        body = fake.requests[-1]
        assert body["temperature"] == 0.25 and body["messages"][0] == {
            "role": "system",
            "content": "Answer briefly.",
        }
        assert chat.conv_list.count() == 1 and chat.conv_list.item(0).text() == "Hi there"
        chat.copy_button.click()
        assert QGuiApplication.clipboard().text() == "Hello, **world**"
        fake.chunks = ["Other", " answer"]
        chat.regen_button.click()
        qtbot.waitUntil(lambda: not app.chat.busy, timeout=5000)
        qtbot.waitUntil(lambda: "Other answer" in chat.transcript.toPlainText(), timeout=2000)
        assert "Hello, world" not in chat.transcript.toPlainText()
        fake.chunks, fake.chunk_delay_s = ["x"] * 100, 0.02
        chat.input.setPlainText("long one")
        chat.send_button.click()
        qtbot.waitUntil(
            lambda: chat.stop_button.isEnabled() and "x" in app.chat.current.messages[-1].content,
            timeout=5000,
        )
        assert not chat.send_button.isEnabled()
        chat.stop_button.click()
        qtbot.waitUntil(lambda: not app.chat.busy, timeout=3000)
        qtbot.waitUntil(lambda: "stopped" in chat.transcript.toPlainText(), timeout=2000)
        chat.new_button.click()
        assert chat.transcript.toPlainText() == "" and chat.conv_list.count() == 1
        chat.conv_list.itemClicked.emit(chat.conv_list.item(0))
        assert "Other answer" in chat.transcript.toPlainText()
    finally:
        fake.stop()


def test_settings_page_validates_and_saves(qtbot: QtBot, make_app: Make, tmp_path: Path) -> None:
    app = make_app(autostart=False)
    page = app.window.settings_page
    page.host.setCurrentText("0.0.0.0")
    page.model.setText(str(tmp_path / "missing.gguf"))
    assert not page.save()
    assert "missing.gguf does not exist" in page.problems.text() and "no API key" in page.problems.text()
    assert app.saved == []  # type: ignore[attr-defined]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    page.model.setText(str(model))
    page.api_key.setText("k1")
    page.port.setValue(9123)
    assert page.save()
    saved = app.saved[-1]  # type: ignore[attr-defined]
    assert (saved.model, saved.host, saved.api_key, saved.port) == (str(model), "0.0.0.0", "k1", 9123)
    assert app.engine.settings == saved and app.engine.api_url == "http://127.0.0.1:9123/v1"
    assert app.window.url_label.text() == "http://127.0.0.1:9123/v1"  # the top bar follows the save
    assert app.window.model_label.text() == f"Model: {model}"


def test_a_save_while_the_engine_runs_says_a_restart_applies_it(qtbot: QtBot, make_app: Make) -> None:
    app = make_app()
    app.start()
    qtbot.waitUntil(lambda: app.engine.state == EngineState.READY, timeout=10000)
    served = app.engine.api_url
    page = app.window.settings_page
    page.port.setValue(app.settings.port + 1)
    assert page.save()
    assert app.engine.pending and app.window.url_label.text() == served  # what still answers
    qtbot.wait(600)  # health polls refresh the bar: the note stays
    assert "restart it to apply the new ones" in app.window.message.text() and app.window.message.isVisible()


def test_refused_start_points_at_settings(qtbot: QtBot, make_app: Make, tmp_path: Path) -> None:
    app = make_app(autostart=False, model=str(tmp_path / "gone.gguf"))
    app.window.start_button.click()
    assert app.window.tabs.currentWidget() is app.window.settings_page
    assert "gone.gguf does not exist" in app.window.message.text()
    assert app.engine.state == EngineState.STOPPED


def test_workers_page(qtbot: QtBot, make_app: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAKE_NODE_SERVE", raising=False)
    app = make_app(autostart=False)
    app.start()
    page = app.window.workers_page
    qtbot.waitUntil(
        lambda: app.nodes.serve_supported is not None and bool(app.nodes.cards) and not app.nodes.refreshing,
        timeout=10000,
    )
    assert "GPU 1: NVIDIA GeForce GTX 1080 Ti, 11 GB VRAM - not supported" in page.cards.text()
    assert not page.add_button.isEnabled()
    assert page.agent_status.text().startswith(
        "Not available: the node agent in this build (strata-node) has no"
    )
    assert not page.empty.isHidden() and page.agent_list.isHidden()
    assert "No agents found yet." in page.empty.text()


def test_add_this_pc_starts_the_agent(qtbot: QtBot, make_app: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NODE_SERVE", "1")
    app = make_app(autostart=False)
    app.start()
    page = app.window.workers_page
    qtbot.waitUntil(page.add_button.isEnabled, timeout=10000)
    page.add_button.click()

    # The agent's events arrive one by one: wait for the whole picture, then check each part of it.
    def shown() -> bool:
        text = page.agent_status.text()
        return "482-913" in text and "port 7460" in text and not page.stop_button.isHidden()

    qtbot.waitUntil(shown, timeout=10000)
    assert "key fingerprint <b>3F2A-91C0-7B1E-55D0</b>" in page.agent_status.text()
    assert "port 7460 on every address of this PC" in page.agent_status.text()
    assert not page.stop_button.isHidden() and not page.add_button.isEnabled()
    page.stop_button.click()
    qtbot.waitUntil(page.add_button.isEnabled, timeout=10000)


def test_agent_starts_at_login_when_ticked(
    qtbot: QtBot, make_app: Make, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAKE_NODE_SERVE", "1")
    app = make_app(autostart=False)
    app.start()
    page = app.window.workers_page
    qtbot.waitUntil(page.autostart.isEnabled, timeout=10000)
    entry = tmp_path / "xdg-config" / "autostart" / "polystrata-node.desktop"
    assert not page.autostart.isChecked() and not entry.exists()
    page.autostart.click()
    assert page.autostart.isChecked() and entry.exists()
    assert "fake_node.py serve --host 0.0.0.0\n" in entry.read_text()
    assert page.autostart_status.text() == f"Entry: {entry}."
    page.autostart.click()
    assert not entry.exists() and not page.autostart.isChecked() and page.autostart_status.text() == ""


def test_pairing_from_the_workers_page(
    qtbot: QtBot, make_app: Make, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAKE_NODE_STATE", str(tmp_path / "nodes.json"))
    app = make_app(autostart=False)
    app.start()
    page = app.window.workers_page
    qtbot.waitUntil(lambda: not app.nodes.refreshing and app.nodes.serve_supported is not None, timeout=10000)
    page.pair_button.click()
    assert page.problem.text().startswith(
        "Give the worker PC's address, the pairing code and the key fingerprint"
    )
    page.address.setText("192.168.1.30")
    page.code.setText("482-913")
    page.fingerprint.setText("AAAA-BBBB")
    page.pair_button.click()
    qtbot.waitUntil(lambda: page.agent_list.count() == 1, timeout=10000)
    assert page.agent_list.item(0).text() == (
        "pc-b (192.168.1.30) · paired · key AAAA-BBBB · NVIDIA GeForce RTX 3070"
    )
    page.agent_list.setCurrentRow(0)
    assert page.exclude_button.isEnabled() and not page.include_button.isEnabled()
    page.exclude_button.click()
    qtbot.waitUntil(lambda: "excluded" in page.agent_list.item(0).text(), timeout=10000)


def test_strata_command_line(tmp_path: Path) -> None:
    import subprocess

    exe = Path(sys.executable).with_name("strata")
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().startswith("strata ")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--headless" in out.stdout
    settings = tmp_path / "config"
    settings.mkdir()
    (settings / "app-settings.json").write_text('{"autostart_engine": false}')
    env = {**__import__("os").environ, "STRATA_CONFIG_DIR": str(settings), "QT_QPA_PLATFORM": "offscreen"}
    out = subprocess.run(
        [str(exe), "--quit-after", "0.5"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr


def test_first_run_wizard_configures_and_starts_the_engine(
    qtbot: QtBot, make_app: Make, tmp_path: Path
) -> None:
    from PySide6.QtWidgets import QWizard

    from app.controllers.wizard import WizardController

    model = tmp_path / "mine.gguf"
    model.write_bytes(b"GGUF....")
    ctl = WizardController(probe_fn=lambda: SEED_PC, models_dir=lambda: tmp_path / "models")
    app = make_app(make_wizard=lambda: ctl)
    app.start(first_run=True)
    assert app.engine.state == EngineState.STOPPED  # nothing starts before the wizard is done
    wizard = app.wizard
    assert wizard is not None and wizard.isVisible()
    qtbot.waitUntil(wizard.gpu_page.isComplete, timeout=3000)
    wizard.next()
    assert wizard.model_page.list.count() >= 7  # the real catalog
    wizard.model_page.other.setText(str(model))
    wizard.model_page.other.returnPressed.emit()
    for _ in range(3):
        wizard.next()
    wizard.button(QWizard.WizardButton.FinishButton).click()
    saved = app.saved[-1]  # type: ignore[attr-defined]
    assert saved.wizard_done and saved.config == str(ctl.config_path) and saved.model == ""
    assert app.window.settings_page.config.text() == saved.config
    ready(qtbot, app)
    assert (
        "--config" in app.engine.command() and f"fake engine: config {saved.config}" in app.engine.log_tail()
    )
    qtbot.waitUntil(lambda: app.wizard is None, timeout=2000)


def test_skipping_the_wizard_starts_the_default_engine(qtbot: QtBot, make_app: Make) -> None:
    from app.controllers.wizard import WizardController

    app = make_app(make_wizard=lambda: WizardController(probe_fn=lambda: SEED_PC))
    app.start(first_run=True)
    assert app.wizard is not None
    app.wizard.reject()
    assert app.saved[-1].wizard_done  # type: ignore[attr-defined]
    ready(qtbot, app)


def test_the_lan_is_browsed_only_when_the_worker_pcs_page_opens(
    qtbot: QtBot, make_app: Make, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No mDNS query at start: `strata-node discover` runs the first time the user opens the page (or asks)."""
    log = tmp_path / "node.log"
    monkeypatch.setenv("FAKE_NODE_LOG", str(log))
    app = make_app(autostart=False)
    app.start()
    qtbot.waitUntil(lambda: log.exists() and "status" in log.read_text(), timeout=10000)
    qtbot.waitUntil(lambda: not app.nodes.refreshing, timeout=10000)
    assert "discover" not in log.read_text()
    app.window.tabs.setCurrentWidget(app.window.workers_page)
    qtbot.waitUntil(lambda: "discover" in log.read_text(), timeout=10000)
    qtbot.waitUntil(lambda: not app.nodes.refreshing, timeout=10000)
    app.window.tabs.setCurrentWidget(app.window.settings_page)
    app.window.tabs.setCurrentWidget(app.window.workers_page)
    assert log.read_text().count("discover") == 1  # once, then when asked ("Look again")
