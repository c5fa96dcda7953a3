"""EngineClient against a fake engine over real HTTP on 127.0.0.1."""

from pytestqt.qtbot import QtBot

from app.clients.engine_client import EngineClient
from tests.app.conftest import free_port
from tests.app.fake_engine import TIMINGS, FakeEngine


def test_health_and_stats(qtbot: QtBot, fake_engine: FakeEngine) -> None:
    client = EngineClient(fake_engine.base_url)
    call = client.health()
    with qtbot.waitSignal(call.done, timeout=3000) as got:
        pass
    assert got.args[0] == {
        "status": "ready",
        "model": "tiny-test.gguf",
        "error": None,
        "queue": {"waiting": 0, "active": 0},
    }
    call = client.stats()
    with qtbot.waitSignal(call.done, timeout=3000) as got:
        pass
    assert [s["layers"] for s in got.args[0]["stages"]] == [[0, 12], [12, 48]]
    assert not client._live


def test_nothing_listening_is_said_plainly(qtbot: QtBot) -> None:
    client = EngineClient(f"http://127.0.0.1:{free_port()}")
    call = client.health()
    with qtbot.waitSignal(call.failed, timeout=3000) as got:
        pass
    assert "connection refused" in got.args[0] and "is the engine running" in got.args[0]


def test_chat_streams_pieces_then_timings(qtbot: QtBot, fake_engine: FakeEngine) -> None:
    client = EngineClient(fake_engine.base_url)
    pieces: list[str] = []
    stream = client.chat([{"role": "user", "content": "hi"}], temperature=0.0, max_tokens=5)
    stream.delta.connect(pieces.append)
    with qtbot.waitSignal(stream.finished, timeout=5000) as got:
        pass
    assert pieces == ["Hello", ", ", "**world**"]
    assert stream.text == "Hello, **world**"
    info = got.args[0]
    assert info["finish_reason"] == "stop" and info["timings"] == TIMINGS and not info["stopped"]
    assert info["usage"]["completion_tokens"] == 3
    body = fake_engine.requests[-1]
    assert body["stream"] is True and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 5


def test_chat_abort_stops_the_server_side(qtbot: QtBot) -> None:
    engine = FakeEngine(chunks=["tok "] * 200, chunk_delay_s=0.02).start()
    try:
        client = EngineClient(engine.base_url)
        stream = client.chat([{"role": "user", "content": "long"}])
        with qtbot.waitSignal(stream.delta, timeout=3000):
            pass
        with qtbot.waitSignal(stream.finished, timeout=3000) as got:
            stream.abort()
        assert got.args[0]["stopped"] is True
        assert 0 < stream.text.count("tok") < 200
        assert engine.cancelled.wait(3.0), "the server never saw the client go away"
    finally:
        engine.stop()


def test_chat_error_body_is_shown(qtbot: QtBot) -> None:
    engine = FakeEngine(chat_status=400).start()
    try:
        stream = EngineClient(engine.base_url).chat([{"role": "user", "content": "x"}], max_tokens=0)
        with qtbot.waitSignal(stream.failed, timeout=3000) as got:
            pass
        assert got.args[0] == "the engine refused the request (400): max_tokens must be positive"
    finally:
        engine.stop()


def test_api_key_is_sent(qtbot: QtBot) -> None:
    engine = FakeEngine(api_key="s3cret").start()
    try:
        bad = EngineClient(engine.base_url).stats()
        with qtbot.waitSignal(bad.failed, timeout=3000) as got:
            pass
        assert "401" in got.args[0] and "invalid API key" in got.args[0]
        good = EngineClient(engine.base_url, api_key="s3cret").stats()
        with qtbot.waitSignal(good.done, timeout=3000):
            pass
    finally:
        engine.stop()


def test_event_stream(qtbot: QtBot, fake_engine: FakeEngine) -> None:
    client = EngineClient(fake_engine.base_url)
    events: list[dict] = []
    stream = client.events()
    stream.event.connect(events.append)
    qtbot.waitUntil(lambda: len(events) == 4, timeout=3000)
    assert [e["type"] for e in events] == ["prompt_chunk", "step", "step", "request"]
    with qtbot.waitSignal(stream.closed, timeout=3000) as got:
        client.abort_all()
    assert got.args[0] == "stopped"
