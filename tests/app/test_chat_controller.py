"""ChatController and the conversation store, against the fake engine over HTTP."""

import json
from pathlib import Path

from pytestqt.qtbot import QtBot

from app.clients.engine_client import EngineClient
from app.controllers.chat import ChatController, speed_line
from app.controllers.conversations import Conversation, ConversationStore, Message, title_from
from app.settings import Sampling
from tests.app.conftest import free_port
from tests.app.fake_engine import FakeEngine


def make_chat(engine: FakeEngine | None, root: Path, **kw: object) -> ChatController:
    url = engine.base_url if engine else f"http://127.0.0.1:{free_port()}"
    return ChatController(EngineClient(url), ConversationStore(root), **kw)  # type: ignore[arg-type]


def test_send_streams_and_saves(qtbot: QtBot, fake_engine: FakeEngine, tmp_path: Path) -> None:
    chat = make_chat(
        fake_engine, tmp_path, system_prompt="Be brief.", sampling=Sampling(temperature=0.3, seed=5)
    )
    updates: list[int] = []
    chat.messageUpdated.connect(updates.append)
    with qtbot.waitSignal(chat.busyChanged, check_params_cb=lambda b: b is False, timeout=5000):
        assert chat.send("  What is a stratum?  ")
    msgs = chat.current.messages
    assert [(m.role, m.content) for m in msgs] == [
        ("user", "What is a stratum?"),
        ("assistant", "Hello, **world**"),
    ]
    assert msgs[1].stats == "3 tokens at 50.0 tok/s, prompt 5 tokens at 500 tok/s"
    assert updates[:3] == [1, 1, 1]
    sent = fake_engine.requests[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a stratum?"},
    ]
    assert sent["temperature"] == 0.3 and sent["seed"] == 5
    on_disk = json.loads((tmp_path / f"{chat.current.id}.json").read_text())
    assert on_disk["title"] == "What is a stratum?"
    assert on_disk["messages"][1]["content"] == "Hello, **world**"
    assert [c.id for c in chat.conversations] == [chat.current.id]


def test_no_second_send_while_streaming(qtbot: QtBot, tmp_path: Path) -> None:
    engine = FakeEngine(chunks=["a"] * 50, chunk_delay_s=0.02).start()
    try:
        chat = make_chat(engine, tmp_path)
        assert chat.send("one")
        assert not chat.send("two")
        assert chat.busy
        qtbot.waitUntil(lambda: bool(chat.current.messages[-1].content), timeout=3000)
        with qtbot.waitSignal(chat.busyChanged, timeout=3000):
            chat.stop()
        answer = chat.current.messages[-1]
        assert answer.stats.startswith("stopped") and 0 < len(answer.content) < 50
        assert len(engine.requests) == 1
    finally:
        engine.stop()


def test_regenerate_replaces_the_last_answer(qtbot: QtBot, fake_engine: FakeEngine, tmp_path: Path) -> None:
    chat = make_chat(fake_engine, tmp_path)
    with qtbot.waitSignal(chat.busyChanged, check_params_cb=lambda b: not b, timeout=5000):
        chat.send("hi")
    fake_engine.chunks = ["Second", " try"]
    with qtbot.waitSignal(chat.busyChanged, check_params_cb=lambda b: not b, timeout=5000):
        assert chat.regenerate()
    assert [m.content for m in chat.current.messages] == ["hi", "Second try"]
    assert fake_engine.requests[-1]["messages"] == [{"role": "user", "content": "hi"}]
    assert chat.last_reply() == "Second try"
    assert chat.transcript() == "**You:**\n\nhi\n\n**Assistant:**\n\nSecond try"


def test_engine_down_gives_an_error_and_keeps_the_question(qtbot: QtBot, tmp_path: Path) -> None:
    chat = make_chat(None, tmp_path)
    with qtbot.waitSignal(chat.error, timeout=5000) as got:
        chat.send("anyone there?")
    assert "connection refused" in got.args[0]
    assert chat.current.messages[0].content == "anyone there?"
    assert len(chat.current.messages) == 1  # the error is not kept as the assistant's reply
    assert not chat.busy
    saved = chat.store.load(chat.current.id)
    assert [m.role for m in saved.messages] == ["user"]  # nor saved as one


def test_conversations_open_new_delete(qtbot: QtBot, fake_engine: FakeEngine, tmp_path: Path) -> None:
    chat = make_chat(fake_engine, tmp_path)
    with qtbot.waitSignal(chat.busyChanged, check_params_cb=lambda b: not b, timeout=5000):
        chat.send("first chat")
    first = chat.current.id
    chat.new_conversation()
    assert chat.current.messages == [] and chat.current.id != first
    with qtbot.waitSignal(chat.busyChanged, check_params_cb=lambda b: not b, timeout=5000):
        chat.send("second chat")
    second = chat.current.id
    assert {c.title for c in chat.conversations} == {"first chat", "second chat"}
    chat.open(first)
    assert chat.current.messages[0].content == "first chat"
    chat.delete(first)
    assert chat.current.messages == []
    assert [c.id for c in chat.conversations] == [second]
    assert not (tmp_path / f"{first}.json").exists()


def test_store_skips_broken_files(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    conv = Conversation(title="ok", messages=[Message("user", "x")], sampling=Sampling(top_k=7))
    store.save(conv)
    (tmp_path / "broken.json").write_text("{")
    listed = store.list()
    assert [c.id for c in listed] == [conv.id] and listed[0].sampling.top_k == 7
    assert len(store.problems) == 1 and "broken.json cannot be read" in store.problems[0]


def test_title_and_speed_line() -> None:
    assert title_from("  a\nb  ") == "a b"
    assert len(title_from("x" * 100)) == 60 and title_from("x" * 100).endswith("…")
    assert speed_line({"usage": {"completion_tokens": 4, "prompt_tokens": 2}}) == "4 tokens, prompt 2 tokens"
    assert speed_line({"finish_reason": "length"}) == "cut at the token limit"
