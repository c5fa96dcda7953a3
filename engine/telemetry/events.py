"""Fan-out of timing events from the generation thread to the asyncio side (one queue per /events client).

A slow client never slows the engine: each subscriber's queue is bounded and drops its oldest events when full.
"""

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any


class EventHub:
    def __init__(self, backlog: int = 4096) -> None:
        self.backlog = backlog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subs: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.dropped = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop whose thread serves the subscribers (set at server start)."""
        self._loop = loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def wants(self) -> bool:
        return bool(self._subs)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def publish(self, event: dict[str, Any]) -> None:
        """Thread-safe; a no-op while nobody listens or once the loop is gone."""
        loop = self._loop
        if loop is None or not self._subs:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            loop.call_soon_threadsafe(self._fanout, event)

    def _fanout(self, event: dict[str, Any] | None) -> None:
        for q in self._subs:
            if q.full():
                q.get_nowait()
                self.dropped += 1
            q.put_nowait(event)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator["asyncio.Queue[dict[str, Any] | None]"]:
        """A queue of events for one client (None: the hub closed); call from the loop's thread."""
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=self.backlog)
        self._subs.add(q)
        try:
            yield q
        finally:
            self._subs.discard(q)

    def close(self) -> None:
        """End every subscriber's stream (server shutdown); call from the loop's thread."""
        self._fanout(None)

    def close_soon(self) -> None:
        """`close` from any thread or a signal handler."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.close)
