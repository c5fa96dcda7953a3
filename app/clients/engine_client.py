"""`EngineClient`: every HTTP call the app makes to the local engine, asynchronous on Qt's network stack.

Nothing here blocks the GUI thread: each call returns a small QObject whose signals fire when the answer (or each
streamed piece of it) arrives. Endpoints: /health, /stats, /v1/models, /v1/chat/completions (SSE), /events (SSE).
"""

import json
from typing import Any

from PySide6.QtCore import QObject, QUrl, Signal
from PySide6.QtNetwork import QNetworkAccessManager, QNetworkProxy, QNetworkReply, QNetworkRequest

from app.clients.sse import SseParser

HEALTH_TIMEOUT_MS = 2000
JSON_TIMEOUT_MS = 5000


def _status(reply: QNetworkReply) -> int:
    code = reply.attribute(QNetworkRequest.Attribute.HttpStatusCodeAttribute)
    return int(code) if code is not None else 0


def _read(reply: QNetworkReply) -> bytes:
    """What the reply holds; nothing for a reply whose connection never opened (refused, aborted)."""
    return bytes(reply.readAll().data()) if reply.isOpen() else b""


def _error_text(body: bytes, fallback: str) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`), else the body or `fallback`."""
    try:
        data = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return text[:300] or fallback
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return fallback


class _Call(QObject):
    """Base of one request: owns its reply and tells the client when it is done so the client can drop it."""

    def __init__(self, client: "EngineClient", reply: QNetworkReply) -> None:
        super().__init__()
        self._client = client
        self._reply: QNetworkReply | None = reply
        self.url = reply.url().toString()
        reply.finished.connect(self._on_finished)

    def abort(self) -> None:
        if self._reply is not None:
            self._reply.abort()

    @property
    def running(self) -> bool:
        return self._reply is not None

    def _on_finished(self) -> None:
        reply = self._reply
        if reply is None:
            return
        self._reply = None
        try:
            self._finish(reply)
        finally:
            reply.deleteLater()
            self._client._forget(self)

    def _finish(self, reply: QNetworkReply) -> None:
        raise NotImplementedError

    def _connection_error(self, reply: QNetworkReply) -> str:
        err = reply.error()
        if err == QNetworkReply.NetworkError.ConnectionRefusedError:
            return f"nothing answers at {self.url} (connection refused): is the engine running?"
        if err == QNetworkReply.NetworkError.OperationCanceledError:
            return f"{self.url} did not answer in time"
        return f"{self.url}: {reply.errorString()}"


class JsonCall(_Call):
    """A GET whose answer is JSON: `done(object)` with the parsed body, or `failed(str)`."""

    done = Signal(object)
    failed = Signal(str)

    def _finish(self, reply: QNetworkReply) -> None:
        body = _read(reply)
        status = _status(reply)
        if status == 0:
            self.failed.emit(self._connection_error(reply))
            return
        if status >= 400:
            self.failed.emit(f"{self.url} answered {status}: {_error_text(body, reply.errorString())}")
            return
        try:
            self.done.emit(json.loads(body))
        except ValueError:
            self.failed.emit(f"{self.url} answered {status} with a body that is not JSON: {body[:120]!r}")


class ChatStream(_Call):
    """One streamed chat completion.

    `delta(str)` for each piece of text; then exactly one of `finished(dict)` (keys: finish_reason, usage, timings,
    stopped: True when `abort()` ended it) or `failed(str)`.
    """

    delta = Signal(str)
    finished = Signal(dict)
    failed = Signal(str)

    def __init__(self, client: "EngineClient", reply: QNetworkReply) -> None:
        super().__init__(client, reply)
        self._parser = SseParser()
        self._error_body = b""
        self._info: dict[str, Any] = {"finish_reason": None, "usage": None, "timings": None, "stopped": False}
        self._error: str | None = None
        self.text = ""
        reply.readyRead.connect(self._on_ready)

    def abort(self) -> None:
        if self._reply is not None:
            self._info["stopped"] = True
            self._reply.abort()

    def _on_ready(self) -> None:
        reply = self._reply
        if reply is None:
            return
        chunk = _read(reply)
        if _status(reply) >= 400:
            self._error_body += chunk
            return
        for ev in self._parser.feed(chunk):
            self._handle(ev.data)

    def _handle(self, data: str) -> None:
        if self._error is not None or data.strip() == "[DONE]":
            return
        try:
            obj = json.loads(data)
        except ValueError:
            self._error = f"{self.url} sent a stream piece that is not JSON: {data[:120]!r}"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            self._error = f"the engine stopped this answer: {_error_text(json.dumps(obj).encode(), 'error')}"
            return
        for choice in obj.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                self.text += piece
                self.delta.emit(piece)
            if choice.get("finish_reason"):
                self._info["finish_reason"] = choice["finish_reason"]
        for key in ("usage", "timings"):
            if obj.get(key):
                self._info[key] = obj[key]

    def _finish(self, reply: QNetworkReply) -> None:
        if not self._info["stopped"]:
            self._on_ready_from(reply)
        status = _status(reply)
        if self._info["stopped"]:
            self.finished.emit(dict(self._info))
        elif status >= 400:
            body = self._error_body + _read(reply)
            self.failed.emit(
                f"the engine refused the request ({status}): {_error_text(body, reply.errorString())}"
            )
        elif self._error is not None:
            self.failed.emit(self._error)
        elif reply.error() != QNetworkReply.NetworkError.NoError:
            self.failed.emit(self._connection_error(reply))
        else:
            self.finished.emit(dict(self._info))

    def _on_ready_from(self, reply: QNetworkReply) -> None:
        if _status(reply) < 400 and reply.isOpen() and reply.bytesAvailable():
            for ev in self._parser.feed(_read(reply)):
                self._handle(ev.data)


class EventStream(_Call):
    """The engine's /events stream: `event(dict)` for each event, `closed(str)` with the reason when it ends."""

    event = Signal(dict)
    closed = Signal(str)

    def __init__(self, client: "EngineClient", reply: QNetworkReply) -> None:
        super().__init__(client, reply)
        self._parser = SseParser()
        reply.readyRead.connect(self._on_ready)

    def _on_ready(self) -> None:
        reply = self._reply
        if reply is None or _status(reply) >= 400:
            return
        for ev in self._parser.feed(_read(reply)):
            try:
                obj = json.loads(ev.data)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self.event.emit(obj)

    def _finish(self, reply: QNetworkReply) -> None:
        status = _status(reply)
        if reply.error() == QNetworkReply.NetworkError.OperationCanceledError:
            self.closed.emit("stopped")
        elif status >= 400:
            self.closed.emit(f"{self.url} answered {status}")
        elif reply.error() != QNetworkReply.NetworkError.NoError:
            self.closed.emit(self._connection_error(reply))
        else:
            self.closed.emit("the engine ended the event stream")


class EngineClient(QObject):
    """The one HTTP client for the engine's API (base URL like `http://127.0.0.1:8080`, optional API key)."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:8080", api_key: str = "", parent: QObject | None = None
    ):
        super().__init__(parent)
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._nam = QNetworkAccessManager(self)
        # The engine is on this PC or the LAN: a system HTTP proxy must not sit in between.
        self._nam.setProxy(QNetworkProxy(QNetworkProxy.ProxyType.NoProxy))
        self._live: set[_Call] = set()

    def configure(self, base_url: str, api_key: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key

    def _request(self, path: str, timeout_ms: int) -> QNetworkRequest:
        req = QNetworkRequest(QUrl(self.base_url + path))
        if self.api_key:
            req.setRawHeader(b"Authorization", b"Bearer " + self.api_key.encode())
        req.setTransferTimeout(timeout_ms)
        return req

    def _track(self, call: _Call) -> None:
        self._live.add(call)

    def _forget(self, call: _Call) -> None:
        self._live.discard(call)

    def get_json(self, path: str, timeout_ms: int = JSON_TIMEOUT_MS) -> JsonCall:
        call = JsonCall(self, self._nam.get(self._request(path, timeout_ms)))
        self._track(call)
        return call

    def health(self) -> JsonCall:
        return self.get_json("/health", HEALTH_TIMEOUT_MS)

    def stats(self) -> JsonCall:
        return self.get_json("/stats")

    def models(self) -> JsonCall:
        return self.get_json("/v1/models")

    def chat(self, messages: list[dict[str, str]], **params: Any) -> ChatStream:
        """Start a streamed chat completion. `params`: OpenAI sampling fields (temperature, max_tokens, ...)."""
        # No "model": the engine serves one model and refuses names it does not know.
        body = {"messages": messages, "stream": True, **params}
        body.setdefault("stream_options", {"include_usage": True})
        req = self._request(
            "/v1/chat/completions", 0
        )  # a long prompt may take minutes before its first token
        req.setHeader(QNetworkRequest.KnownHeaders.ContentTypeHeader, "application/json")
        req.setRawHeader(b"Accept", b"text/event-stream")
        call = ChatStream(self, self._nam.post(req, json.dumps(body).encode()))
        self._track(call)
        return call

    def events(self) -> EventStream:
        req = self._request("/events", 0)
        req.setRawHeader(b"Accept", b"text/event-stream")
        call = EventStream(self, self._nam.get(req))
        self._track(call)
        return call

    def abort_all(self) -> None:
        for call in list(self._live):
            call.abort()
