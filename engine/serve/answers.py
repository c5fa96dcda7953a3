"""The OpenAI answers of a job: whole (chat.completion, text_completion) or streamed as SSE chunks, with usage and
llama-server's timings; a client that leaves cancels its job."""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.serve.errors import APIError
from engine.serve.jobs import ClientGone, Job, Receive, Result, sse_event, wait_disconnect
from engine.serve.protocol import new_id, now, timings_dict, usage_dict
from installer.version import __version__

FINGERPRINT = f"polystrata-{__version__}"


class Answers:
    """Part of EngineService: queues jobs (`submit`, `cancel`) and names the model (`model_name`)."""

    model_name: str

    def submit(self, job: Job) -> None:
        raise NotImplementedError

    def cancel(self, job: Job) -> None:
        raise NotImplementedError

    async def run_to_end(self, job: Job, receive: Receive) -> Result:
        """Queue the job and wait for its whole answer; the client leaving cancels it."""
        self.submit(job)
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        getter = asyncio.ensure_future(job.take())
        try:
            done, _ = await asyncio.wait({watcher, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                raise ClientGone
            item = getter.result()[0]  # a whole answer comes as one item
        finally:
            watcher.cancel()
            getter.cancel()
            self.cancel(job)
        if item[0] == "error":
            raise item[1]
        return item[1]

    async def _items(self, job: Job) -> AsyncIterator[list[tuple[Any, ...]]]:
        while True:
            batch = await job.take()
            yield batch
            if batch[-1][0] in ("done", "error"):
                return

    async def relay(self, job: Job, encode: Callable[[tuple[Any, ...]], bytes]) -> AsyncIterator[bytes]:
        """A job's items (text, then its end: done or error) as bytes, `encode` one item, a batch a chunk; closing
        it (the client left) cancels the job. Other dialects' streams (llama-server's, Ollama's) are this."""
        try:
            async for batch in self._items(job):
                yield b"".join(encode(item) for item in batch)
        finally:
            self.cancel(job)

    async def stream(
        self, job: Job, endpoint: str, include_usage: bool, echo: str = ""
    ) -> AsyncIterator[bytes]:
        """The SSE body of a streamed answer. Closing it (the client left) cancels the job."""
        chat = endpoint == "chat"
        base = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": now(),
            "model": self.model_name,
            "system_fingerprint": FINGERPRINT,
        }

        def chunk(text: str | None, finish: str | None = None, first: bool = False, **extra: Any) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj: dict[str, Any] = {**base, "choices": [choice], **extra}
            if include_usage and "usage" not in obj:
                obj["usage"] = None
            return sse_event(obj)

        # A text piece differs from its neighbours only in the text: serialize the rest once.
        head, tail = chunk("\x00").split(b'"\\u0000"', 1)

        def text_chunk(text: str) -> bytes:
            return head + json.dumps(text, ensure_ascii=False).encode() + tail

        try:
            if chat:
                yield chunk("", first=True)
            elif echo:
                yield chunk(echo)
            async for batch in self._items(job):
                out = bytearray()
                for item in batch:
                    if item[0] == "text":
                        out += text_chunk(item[1])
                    elif item[0] == "error":
                        err: APIError = item[1]
                        out += sse_event(err.body())
                        yield bytes(out)
                        return
                    else:
                        res: Result = item[1]
                        t = res.done.timings
                        timings = timings_dict(t, res.queued_ms)
                        out += chunk(None if chat else "", res.done.finish_reason, timings=timings)
                        if include_usage:
                            out += sse_event(
                                {**base, "choices": [], "usage": usage_dict(t), "timings": timings}
                            )
                        out += b"data: [DONE]\n\n"
                yield bytes(out)
        finally:
            self.cancel(job)

    def chat_response(self, res: Result) -> dict[str, Any]:
        message = {"role": "assistant", "content": res.text, "refusal": None}
        return self._whole("chatcmpl", "chat.completion", {"message": message}, res)

    def completion_response(self, res: Result, echo: str) -> dict[str, Any]:
        return self._whole("cmpl", "text_completion", {"text": echo + res.text}, res)

    def _whole(self, prefix: str, kind: str, content: dict[str, Any], res: Result) -> dict[str, Any]:
        """A whole answer: its one choice (`content` and how it finished), usage and timings."""
        t = res.done.timings
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": res.done.finish_reason}
        return {
            "id": new_id(prefix),
            "object": kind,
            "created": now(),
            "model": self.model_name,
            "system_fingerprint": FINGERPRINT,
            "choices": [choice],
            "usage": usage_dict(t),
            "timings": timings_dict(t, res.queued_ms),
        }
