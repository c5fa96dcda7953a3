"""What the queue holds and hands back: one request's job (the worker thread pushes its output; the request's
coroutine takes it in batches), its whole result, and the client's going away."""

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.serve.protocol import new_id

if TYPE_CHECKING:
    from engine.pipeline.generate import DoneEvent, GenerationRequest, TokenLogprob

Receive = Callable[[], Awaitable[dict[str, Any]]]


@dataclass
class Job:
    """One request waiting for or holding the model.

    The worker thread appends what it produces; the request's coroutine takes everything ready at once. The
    loop is woken once per batch, not once per token, so a fast model does not flood it with wake-ups."""

    endpoint: str  # chat | completions
    req: "GenerationRequest"
    stream: bool
    loop: asyncio.AbstractEventLoop
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: new_id("req"))
    created: float = field(default_factory=time.perf_counter)
    started: float | None = None
    generated: int = 0
    finished: bool = False  # its answer or error was pushed (the worker's view)
    _items: list[tuple[Any, ...]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _signalled: bool = False

    def push(self, *item: Any) -> None:
        """From the worker thread: hand an item to the request's coroutine (a gone loop cancels the job)."""
        with self._lock:
            self._items.append(item)
            if self._signalled:
                return
            self._signalled = True
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:
            self.cancelled.set()

    async def take(self) -> list[tuple[Any, ...]]:
        """In the loop: everything pushed so far (waits for at least one item)."""
        while True:
            with self._lock:
                self._signalled = False
                self._ready.clear()
                if self._items:
                    batch, self._items = self._items, []
                    return batch
            await self._ready.wait()


@dataclass
class Result:
    text: str
    done: "DoneEvent"
    queued_ms: float
    logprobs: "list[tuple[int, TokenLogprob]] | None" = None  # (token, its log-probabilities) where asked for


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
