"""A Server-Sent Events response that notices a client leaving at once, whatever the ASGI server's spec version.

Starlette's StreamingResponse only listens for `http.disconnect` under ASGI < 2.4; under 2.4 it learns of a gone
client only when a write fails, which may be long after (a queued request writes nothing). Here a watcher task
waits for the disconnect and cancels the body, whose `finally` then cancels the generation.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger("strata.serve")


class EventStreamResponse(StreamingResponse):
    def __init__(self, body: AsyncIterator[bytes], status_code: int = 200) -> None:
        super().__init__(body, status_code=status_code, headers=SSE_HEADERS, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        pump_task = asyncio.ensure_future(pump())
        watch_task = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if pump_task.done() and not pump_task.cancelled():
                exc = pump_task.exception()
                if exc is not None and not isinstance(exc, OSError):  # OSError: the client is gone
                    log.error("an event stream failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        finally:
            for t in (pump_task, watch_task):
                t.cancel()
            for t in (pump_task, watch_task):
                with contextlib.suppress(asyncio.CancelledError, OSError, Exception):
                    await t
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
