"""A chat answer's markdown as the transcript shows it: line breaks kept as written (as chat UIs show them), fenced
code blocks highlighted (Pygments) with a "Copy code" link under each."""

import html
import re

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound

_FENCE = re.compile(r"^```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^```[ \t]*$|\Z)", re.DOTALL | re.MULTILINE)
_FORMATTER = HtmlFormatter(noclasses=True, nowrap=True, style="default")


def segments(text: str) -> list[tuple[str, str, str]]:
    """The text as ("text", "", markdown) and ("code", language, code) pieces in order; a fence still open (an
    answer that streams) runs to the end."""
    out: list[tuple[str, str, str]] = []
    at = 0
    for m in _FENCE.finditer(text):
        if m.start() > at:
            out.append(("text", "", text[at : m.start()]))
        out.append(("code", m.group(1).lower(), m.group(2).rstrip("\n")))
        at = m.end()
    if at < len(text):
        out.append(("text", "", text[at:]))
    return out


def hard_breaks(markdown: str) -> str:
    """Each single line break written becomes a line break shown (markdown would join the lines into one
    paragraph); blank lines still part paragraphs."""
    lines = markdown.split("\n")
    for i in range(len(lines) - 1):
        if lines[i].strip() and lines[i + 1].strip() and not lines[i].endswith("  "):
            lines[i] += "  "
    return "\n".join(lines)


def code_html(code: str, language: str) -> str:
    """A code block as HTML the transcript shows: highlighted where the language is named or can be guessed."""
    try:
        lexer = get_lexer_by_name(language) if language else guess_lexer(code)
    except ClassNotFound:
        lexer = None
    body = highlight(code, lexer, _FORMATTER) if lexer is not None else html.escape(code)
    return (
        '<pre style="background-color:#f6f8fa; font-family:monospace; padding:6px;">'
        + body.rstrip("\n").replace("\n", "<br>")
        + "</pre>"
    )
