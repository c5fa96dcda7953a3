"""End to end: the app starts the real `strata-engine serve` on a tiny model (CPU), chats with it, charts its events,
shows its split, and stops it."""

import re
from pathlib import Path

import pytest
from pytestqt.qtbot import QtBot

from app.application import StrataApp
from app.controllers.engine import EngineState
from app.settings import AppSettings, Sampling
from tests.app.conftest import chat_once, free_port
from tests.app.fake_nvml import FakeNvml


@pytest.mark.slow
def test_real_engine_chat_charts_stop(qtbot: QtBot, tmp_path: Path) -> None:
    from engine.testing.tiny_models import write_tiny_model

    model = tmp_path / "tiny-qwen3moe.gguf"
    write_tiny_model(model, "qwen3moe")
    settings = AppSettings(
        model=str(model),
        device="cpu",
        port=free_port(),
        max_context=256,
        sampling=Sampling(temperature=0.0, max_tokens=8),
    )
    app = StrataApp(settings, tray_reason=None, nvml=FakeNvml([]), save=lambda s: None, poll_ms=100)
    app.exit_app = lambda: None
    qtbot.addWidget(app.window)
    try:
        app.start()
        qtbot.waitUntil(lambda: app.engine.state in (EngineState.READY, EngineState.CRASHED), timeout=120_000)
        assert app.engine.state == EngineState.READY, "\n".join(app.engine.log_tail())
        assert app.window.state_label.text() == "Ready"
        assert app.engine.model_name == "tiny-qwen3moe"

        answer = chat_once(qtbot, app, "Hello")
        chat = app.chat_window
        m = re.match(r"(\d+) tokens at [\d.]+ tok/s, prompt \d+ tokens at \d+ tok/s", answer.stats)
        assert m, answer.stats
        n = int(m.group(1))
        assert 1 <= n <= 8
        qtbot.waitUntil(lambda: answer.stats in chat.transcript.toPlainText(), timeout=2000)

        # the chart controller saw the engine's own events: a prompt chunk and one step per token
        qtbot.waitUntil(lambda: len(app.charts.requests) == 1, timeout=10_000)
        assert len(app.charts.chunks[0]) >= 1 and len(app.charts.steps[0]) >= n - 1
        _, prompt_tps, decode_tps = app.charts.requests[0]
        assert prompt_tps > 0 and decode_tps > 0
        qtbot.waitUntil(lambda: app.window.engine_page.table.rowCount() == 1, timeout=10_000)
        assert app.window.engine_page.table.item(0, 3).text() == "0–1"  # the tiny model's two layers

        with qtbot.waitSignal(
            app.engine.stateChanged, check_params_cb=lambda s: s == "stopped", timeout=15_000
        ):
            app.window.stop_button.click()
        assert app.engine.exit_code is not None
    finally:
        app.shutdown()
