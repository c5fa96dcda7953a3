"""An incremental parser for Server-Sent Events (the `text/event-stream` format the engine streams)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SseEvent:
    data: str
    event: str = "message"


class SseParser:
    """Feed it bytes as they arrive; it returns the complete events, keeping any partial line for the next call."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event = "message"

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buf += chunk
        out: list[SseEvent] = []
        while True:
            cut = self._buf.find(b"\n")
            if cut < 0:
                return out
            raw, self._buf = self._buf[:cut], self._buf[cut + 1 :]
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if self._data:
                    out.append(SseEvent("\n".join(self._data), self._event))
                self._data, self._event = [], "message"
            elif line.startswith(":"):
                continue  # a comment: keep-alive
            else:
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "data":
                    self._data.append(value)
                elif name == "event":
                    self._event = value
