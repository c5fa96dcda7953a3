"""Reasoning apart from the answer: models that think in `<think>...</think>` before answering (Qwen3, DeepSeek-R1,
GLM-4.5, QwQ) give their thinking as `reasoning_content` and the answer as `content`, as DeepSeek's API, vLLM and
llama-server do (`reasoning_format: "none"` keeps it all in `content`).

Where the chat template opens the `<think>` itself at the end of the prompt (DeepSeek-R1, the thinking-only Qwen3
2507 models), the answer begins inside it; otherwise a `<think>` at the very start of the answer opens it. An
answer cut before `</think>` is reasoning only."""

from collections.abc import Collection
from typing import Any, Literal

from engine.serve.tool_calls import CallFormat, HermesCalls, partial_tag

OPEN, CLOSE = "<think>", "</think>"
Piece = tuple[Literal["reasoning", "text"], str]


def thinks(template: str) -> bool:
    """Whether a chat template knows the <think> block (its models may reason before answering)."""
    return OPEN in template


def split(text: str, opened: bool) -> tuple[str | None, str]:
    """A whole answer -> (its reasoning or None, the answer). `opened`: the prompt ended inside <think>."""
    s = text
    if not opened:
        start = s.lstrip()
        if not start.startswith(OPEN):
            return None, text
        s = start[len(OPEN) :]
    i = s.find(CLOSE)
    if i < 0:
        return s.strip() or None, ""
    return s[:i].strip() or None, s[i + len(CLOSE) :].lstrip()


class ThinkStream:
    """`split` for a streamed answer: `feed` each text piece, then `end`; each gives ("reasoning", str) and
    ("text", str) pieces in order. Only a partial tag at the end of what came so far waits for the next piece."""

    def __init__(self, opened: bool) -> None:
        self.state = "think" if opened else "start"
        self.held = ""
        self.fresh = True  # no reasoning given out yet (its leading whitespace is dropped)

    def feed(self, text: str) -> list[Piece]:
        self.held += text
        return self._drain(final=False)

    def end(self) -> list[Piece]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self.state == "start":
                s = self.held.lstrip()
                if s.startswith(OPEN):
                    self.held, self.state = s[len(OPEN) :], "think"
                    continue
                if not final and OPEN.startswith(s):  # only whitespace, or the tag's first characters
                    return out
                self.state = "answer"
            elif self.state == "think":
                if self.fresh:
                    self.held = self.held.lstrip()
                i = self.held.find(CLOSE)
                if i >= 0:
                    self._reasoning(out, self.held[:i].rstrip())
                    self.held, self.state = self.held[i + len(CLOSE) :], "after"
                    continue
                keep = 0 if final else partial_tag(self.held, CLOSE)
                self._reasoning(out, self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            elif self.state == "after":  # the whitespace between </think> and the answer
                s = self.held.lstrip()
                if not s and not final:
                    self.held = ""
                    return out
                self.held, self.state = s, "answer"
            else:
                if self.held:
                    out.append(("text", self.held))
                    self.held = ""
                return out

    def _reasoning(self, out: list[Piece], text: str) -> None:
        if text:
            out.append(("reasoning", text))
            self.fresh = False


class AnswerParts:
    """A streamed chat answer as its parts, in order: ("reasoning", str), ("text", str) and ("call", ToolCall);
    the reasoning split first (`think` as in `ThinkStream`, None: no split), then the tool calls read from the
    answer (`tools`: the names the request declared, or a mapping of them to their parameters' schemas; none: no
    calls read) in the format the model's template teaches (`fmt`, default Hermes). A channel format (harmony)
    gives the reasoning, the text and the calls at once, tools or not."""

    def __init__(self, tools: Collection[str], think: bool | None, fmt: CallFormat | None = None) -> None:
        fmt = fmt or HermesCalls()
        self.thinking = ThinkStream(think) if think is not None and not fmt.channels else None
        self.calls = fmt.stream(tools) if tools or fmt.channels else None

    @property
    def passing(self) -> bool:
        """Every later piece is answer text as it comes: no calls to read, and past any reasoning."""
        return self.calls is None and (self.thinking is None or self.thinking.state == "answer")

    def feed(self, text: str) -> list[tuple[str, Any]]:
        pieces: list[Piece] = [("text", text)] if self.thinking is None else self.thinking.feed(text)
        return self._calls(pieces, final=False)

    def end(self) -> list[tuple[str, Any]]:
        return self._calls(self.thinking.end() if self.thinking is not None else [], final=True)

    def _calls(self, pieces: list[Piece], final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, value in pieces:
            if kind == "text" and self.calls is not None:
                out += self.calls.feed(value)
            elif value:
                out.append((kind, value))
        if final and self.calls is not None:
            out += self.calls.end()
        return out
