"""The OpenAI answers of a job: whole (chat.completion, text_completion) or streamed as SSE chunks, with usage and
llama-server's timings; a client that leaves cancels its job."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.serve.errors import APIError
from engine.serve.jobs import ClientGone, Job, Receive, Result, sse_event, wait_disconnect
from engine.serve.protocol import new_id, now, timings_dict, usage_dict
from engine.serve.reasoning import AnswerParts, thinks
from engine.serve.reasoning import split as split_reasoning
from engine.serve.tool_calls import CallFormat, ToolCall, openai_tool_calls, parser_for
from installer.version import __version__

if TYPE_CHECKING:
    from engine.pipeline.generate import GenerationRequest, TokenLogprob
    from engine.pipeline.loader import LoadedModel

FINGERPRINT = f"polystrata-{__version__}"
log = logging.getLogger("strata.serve")


class Answers:
    """Part of EngineService: queues jobs (`submit`, `cancel`), names the model (`model_name`) and spells tokens
    (`lm.tokenizer`)."""

    model_name: str
    lm: "LoadedModel | None"

    def _lp_token(self, token: int, logprob: float) -> dict[str, Any]:
        assert self.lm is not None
        raw = self.lm.tokenizer.token_to_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    def chat_logprobs(self, lps: "list[tuple[int, TokenLogprob]]") -> dict[str, Any]:
        """OpenAI's chat `logprobs`: each token with its log-probability, bytes and the likeliest alternatives."""
        content = []
        for token, lp in lps:
            e = self._lp_token(token, lp.logprob)
            e["top_logprobs"] = [self._lp_token(i, v) for i, v in lp.top]
            content.append(e)
        return {"content": content, "refusal": None}

    def completion_logprobs(self, lps: "list[tuple[int, TokenLogprob]]", offset: int) -> dict[str, Any]:
        """OpenAI's legacy completion `logprobs`: parallel lists, `text_offset` counted from `offset`."""
        tokens = [self._lp_token(t, lp.logprob)["token"] for t, lp in lps]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in lps],
            "top_logprobs": [{self._lp_token(i, v)["token"]: v for i, v in lp.top} for _, lp in lps],
            "text_offset": offsets,
        }

    def submit(self, job: Job) -> None:
        raise NotImplementedError

    def cancel(self, job: Job) -> None:
        raise NotImplementedError

    async def run_to_end(self, job: Job, receive: Receive) -> Result:
        """Queue the job and wait for its whole answer; the client leaving cancels it."""
        return (await self.run_all([job], receive))[0]

    async def run_all(self, jobs: list[Job], receive: Receive) -> list[Result]:
        """Queue the jobs (a request's choices: with several slots they run together) and wait for every whole
        answer; the client leaving cancels them all, and the first error ends the request."""
        for job in jobs:
            self.submit(job)
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        getters = [asyncio.ensure_future(job.take()) for job in jobs]
        try:
            waiting: set[asyncio.Future[Any]] = set(getters)
            while waiting:
                done, _ = await asyncio.wait({watcher, *waiting}, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    raise ClientGone
                waiting -= done
        finally:
            watcher.cancel()
            for g in getters:
                g.cancel()
            for job in jobs:
                self.cancel(job)
        items = [g.result()[0] for g in getters]  # a whole answer comes as one item
        for item in items:
            if item[0] == "error":
                raise item[1]
        return [item[1] for item in items]

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
        self,
        job: Job,
        endpoint: str,
        include_usage: bool,
        echo: str = "",
        tools: Sequence[str] = (),
        reasoning: bool | None = None,
    ) -> AsyncIterator[bytes]:
        """The SSE body of a streamed answer. Closing it (the client left) cancels the job. `tools`: the names of
        the tools a chat request lets the model call; its calls come as `tool_calls` deltas as OpenAI sends them
        (id, type and name first, then the arguments), with finish_reason "tool_calls". `reasoning` (not None):
        the answer's <think> block streams as `reasoning_content` deltas (True: the prompt opened it)."""
        chat = endpoint == "chat"
        fmt = self.tool_format() if chat and (tools or reasoning is not None) else None
        read_calls = chat and bool(tools) and fmt is not None
        parts = (
            AnswerParts(tools if read_calls else (), reasoning, fmt)
            if chat and (read_calls or reasoning is not None)
            else None
        )
        n_calls = 0
        base = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": now(),
            "model": self.model_name,
            "system_fingerprint": FINGERPRINT,
        }

        offset = len(echo)  # where the next text starts in the answer (a completion's text_offset)

        def chunk(
            text: str | None,
            finish: str | None = None,
            first: bool = False,
            logprobs: dict[str, Any] | None = None,
            **extra: Any,
        ) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            obj: dict[str, Any] = {**base, "choices": [choice], **extra}
            if include_usage and "usage" not in obj:
                obj["usage"] = None
            return sse_event(obj)

        # A text piece differs from its neighbours only in the text: serialize the rest once.
        head, tail = chunk("\x00").split(b'"\\u0000"', 1)

        def text_chunk(text: str) -> bytes:
            return head + json.dumps(text, ensure_ascii=False).encode() + tail

        # log-probabilities of tokens whose text is held back (a tag may begin there)
        held_lps: list[Any] = []

        def plain(text: str) -> bytes:
            """Answer text given out, with the log-probabilities of the tokens held back until it came."""
            if not held_lps:
                return text_chunk(text)
            lps = self.chat_logprobs(list(held_lps))
            held_lps.clear()
            return chunk(text, logprobs=lps)

        def answer_chunks(text: str, lps: Any = None, final: bool = False) -> bytes:
            """The answer's text through the reasoning split and the tool-call reader (AnswerParts)."""
            nonlocal n_calls
            assert parts is not None
            held_lps.extend(lps or ())
            found = parts.feed(text) if text else []
            if final:
                found += parts.end()
            out = bytearray()
            for kind, value in found:
                if kind == "text":
                    out += plain(value)
                    continue
                held_lps.clear()  # the reasoning's or the call's tokens: not the answer text's
                if kind == "reasoning":
                    out += sse_event({**base, "choices": [{"index": 0, "delta": {"reasoning_content": value},
                                                           "logprobs": None, "finish_reason": None}]})  # fmt: skip
                    continue
                c: ToolCall = value
                (tc,) = openai_tool_calls([c])
                first = {"index": n_calls, "id": tc["id"], "type": "function",
                         "function": {"name": c.name, "arguments": ""}}  # fmt: skip
                for part in (first, {"index": n_calls, "function": {"arguments": c.arguments}}):
                    delta = {"tool_calls": [part]}
                    out += sse_event({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                           "finish_reason": None}]})  # fmt: skip
                n_calls += 1
            return bytes(out)

        try:
            if chat:
                yield chunk("", first=True)
            elif echo:
                yield chunk(echo)
            async for batch in self._items(job):
                out = bytearray()
                for item in batch:
                    if item[0] == "text" and parts is not None and not parts.passing:
                        # text that may hold reasoning or calls
                        out += answer_chunks(item[1], item[2] if len(item) > 2 else None)
                    elif (
                        item[0] == "text" and len(item) > 2 and item[2]
                    ):  # with the tokens' log-probabilities
                        lps = (
                            self.chat_logprobs(item[2]) if chat else self.completion_logprobs(item[2], offset)
                        )
                        out += chunk(item[1], logprobs=lps)
                        offset += len(item[1])
                    elif item[0] == "text":
                        out += text_chunk(item[1])
                        offset += len(item[1])
                    elif item[0] == "error":
                        err: APIError = item[1]
                        out += sse_event(err.body())
                        yield bytes(out)
                        return
                    else:
                        res: Result = item[1]
                        t = res.done.timings
                        timings = timings_dict(t, res.queued_ms)
                        finish = res.done.finish_reason
                        if parts is not None:
                            out += answer_chunks("", final=True)
                            finish = "tool_calls" if n_calls else finish
                        out += chunk(None if chat else "", finish, timings=timings)
                        if include_usage:
                            out += sse_event(
                                {**base, "choices": [], "usage": usage_dict(t), "timings": timings}
                            )
                        out += b"data: [DONE]\n\n"
                yield bytes(out)
        finally:
            self.cancel(job)

    def chat_response(
        self, res: Result | list[Result], tools: Sequence[str] = (), reasoning: bool | None = None
    ) -> dict[str, Any]:
        """`tools`: the names of the tools the request lets the model call; its calls, in the format its template
        teaches, become `tool_calls` (finish_reason "tool_calls"). `reasoning` (not None): the answer's <think>
        block becomes `reasoning_content` (True: the prompt opened it)."""
        results = res if isinstance(res, list) else [res]
        fmt = self.tool_format() if tools or reasoning is not None else None
        channels = fmt is not None and fmt.channels and reasoning is not None
        parser = fmt if tools or channels else None
        content = []
        for r in results:
            text = r.text
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if reasoning is not None and not channels:
                thought, text = split_reasoning(text, reasoning)
                message["content"] = text
                if thought is not None:
                    message["reasoning_content"] = thought
            choice: dict[str, Any] = {"message": message}
            parsed = parser.parse(text, tools) if parser is not None else None
            if channels and parsed is not None:  # harmony: the channels split the answer, calls or not
                message["content"] = parsed.content if parsed.content or not parsed.calls else None
                if parsed.reasoning is not None:
                    message["reasoning_content"] = parsed.reasoning
            if parsed is not None and parsed.calls:
                message.update(content=parsed.content, tool_calls=openai_tool_calls(parsed.calls))
                choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = self.chat_logprobs(r.logprobs) if r.logprobs is not None else None
            content.append(choice)
        return self._whole("chatcmpl", "chat.completion", content, results)

    def reasoning_mode(self, r: Any, gen: "GenerationRequest") -> bool | None:
        """Whether a chat answer's reasoning goes apart (None: it stays in the content), and whether the prompt
        opened the <think> block (True) or the answer does (False)."""
        assert self.lm is not None
        if getattr(r, "reasoning_format", None) == "none":
            return None
        fmt = self.tool_format()
        if fmt is not None and fmt.channels:  # harmony: the analysis channel is the reasoning
            return False
        if not thinks(self.lm.chat.template):
            return None
        tail = self.lm.tokenizer.decode(list(gen.prompt[-16:]))
        return tail.rstrip().endswith("<think>")

    def tool_format(self) -> CallFormat | None:
        """The tool-call format the loaded model's chat template teaches (tool_calls.parser_for); the log says
        once which, or that there is none (calls then come back as text)."""
        assert self.lm is not None
        parser = parser_for(self.lm.chat.template)
        if not getattr(self, "_said_tool_format", False):
            self._said_tool_format = True
            if parser is None:
                log.info("the chat template of %s shows no tool-call format this server reads: tool calls come "
                         "back as text", self.model_name)  # fmt: skip
            else:
                log.info("tool calls of %s are read in the %s format", self.model_name, parser.name)
        return parser

    def completion_response(self, res: Result | list[Result], echo: str) -> dict[str, Any]:
        results = res if isinstance(res, list) else [res]
        content = [
            {
                "text": echo + r.text,
                "logprobs": self.completion_logprobs(r.logprobs, len(echo))
                if r.logprobs is not None
                else None,
            }
            for r in results
        ]
        return self._whole("cmpl", "text_completion", content, results)

    def _whole(
        self, prefix: str, kind: str, content: list[dict[str, Any]], results: list[Result]
    ) -> dict[str, Any]:
        """A whole answer: a choice per result (its `content`: text or message and log-probabilities, and how it
        finished); usage counts the prompt once and every choice's tokens; timings are the first choice's."""
        choices = [
            {"index": i, **c, "finish_reason": c.get("finish_reason", r.done.finish_reason)}
            for i, (c, r) in enumerate(zip(content, results, strict=True))
        ]
        first = results[0].done.timings
        usage = usage_dict(first)
        extra = sum(r.done.timings.generated_tokens for r in results[1:])
        usage["completion_tokens"] += extra
        usage["total_tokens"] += extra
        return {
            "id": new_id(prefix),
            "object": kind,
            "created": now(),
            "model": self.model_name,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
            "usage": usage,
            "timings": timings_dict(first, results[0].queued_ms),
        }
