"""Pure ASGI middleware: the API key check and the request body limit (both before any route runs)."""

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.serve.protocol import error_body

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


async def _send_error(
    send: Send, status: int, body: dict[str, object], headers: list[tuple[bytes, bytes]]
) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class ApiKeyMiddleware:
    """Every path but /health needs `Authorization: Bearer KEY` (or `x-api-key: KEY`) when a key is set."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def _allowed(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
                break
            if name == b"x-api-key":
                given = value.strip()
        return hmac.compare_digest(given, self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or scope["path"] in PUBLIC_PATHS
            or self._allowed(scope)
        ):
            await self.app(scope, receive, send)
            return
        await _send_error(
            send,
            401,
            error_body(
                "missing or wrong API key: send the key the server was started with as 'Authorization: Bearer KEY'",
                "invalid_request_error",
                None,
                "invalid_api_key",
            ),
            [(b"www-authenticate", b"Bearer")],
        )


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes")
        self.limit = limit


class BodyLimitMiddleware:
    """Refuse bodies over `limit` bytes: at once when Content-Length says so, else while reading."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _message(self) -> dict[str, object]:
        mib = self.limit / (1 << 20)
        return error_body(
            f"the request body is larger than the server's limit ({mib:g} MiB, --max-body-mib)",
            "invalid_request_error",
            None,
            "request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.limit:
                    await _send_error(send, 413, self._message(), [(b"connection", b"close")])
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return msg

        await self.app(scope, limited, send)
