"""The chat transcript's markdown: line breaks kept, code blocks highlighted with a copy link, plain titles."""

from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication
from pytestqt.qtbot import QtBot

from app.controllers.conversations import Message, title_from
from app.ui.chat_window import Transcript
from app.ui.markdown import code_html, hard_breaks, segments

ANSWER = "First line\nsecond line\n\nCode:\n```python\ndef f(x):\n    return x + 1\n```\nAfter."


def test_fenced_code_is_cut_out_and_an_open_fence_runs_to_the_end() -> None:
    assert segments(ANSWER) == [
        ("text", "", "First line\nsecond line\n\nCode:\n"),
        ("code", "python", "def f(x):\n    return x + 1"),
        ("text", "", "\nAfter."),
    ]
    assert segments("Streaming:\n```js\nlet a =")[-1] == ("code", "js", "let a =")


def test_single_line_breaks_are_kept_and_blank_lines_part_paragraphs() -> None:
    assert hard_breaks("a\nb\n\nc") == "a  \nb\n\nc"


def test_code_is_highlighted_where_the_language_is_known() -> None:
    got = code_html("def f(x):\n    return x + 1", "python")
    assert got.startswith("<pre") and "color:" in got and "<br>" in got
    assert "&lt;b&gt;" in code_html("<b>", "no-such-language")  # escaped, not interpreted


def test_titles_have_no_markdown_marks() -> None:
    assert title_from("**Bold** question about `code`\n# heading") == "Bold question about code heading"


def test_the_transcript_shows_breaks_and_copies_code(qtbot: QtBot) -> None:
    t = Transcript()
    qtbot.addWidget(t)
    t.render_all([Message("user", "hi"), Message("assistant", ANSWER)])
    text = t.toPlainText()
    assert "First line\nsecond line" in text or "First line\u2028second line" in text
    assert "def f(x):" in text and "Copy code" in text and "```" not in text
    t.anchorClicked.emit(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == "def f(x):\n    return x + 1"
