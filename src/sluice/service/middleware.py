"""ASGI middleware: a limit on body size, and the request id carried through.

Both are plain ASGI (no BaseHTTPMiddleware), so they add next to nothing to a
request and do not buffer bodies.
"""

from __future__ import annotations

import re
import uuid

import orjson
import structlog
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice import tracing
from sluice.service.errors import error_body

#: A request id we accept from a client as is (anything else is replaced).
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


async def _send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
    body = orjson.dumps(error_body(status, message))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class TooLarge(StarletteHTTPException):
    """Raised while the body streams in past the limit: an HTTP error, so that FastAPI (which
    turns other errors met while reading a body into a 400) answers it as a 413."""


class BodyLimit:
    """413 for a body over ``max_bytes``: by its Content-Length at once, or as it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = (
            f"the request body is larger than {self.max_bytes:,} bytes; send less "
            "(or raise SLUICE_MAX_BODY_BYTES on the server)"
        )
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _send_error(send, 413, message, [])
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise TooLarge(413, message)
            return msg

        await self.app(scope, limited, send)


class RequestId:
    """``X-Request-ID``: the client's (if it looks like an id) or a new one, in the scope's state
    for the routes and the logs, and returned on the response; with the caller's rate limit
    (``RateLimit-*`` headers) once authentication has counted the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid = value.decode("latin-1")
                break
        if not _REQUEST_ID.match(rid):
            rid = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        tracing.tag_request(rid)  # on the request's span, when tracing is on
        raw = rid.encode()

        async def with_id(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                headers = [*msg.get("headers", []), (b"x-request-id", raw)]
                limit = state.get("rate_limit")
                if limit is not None:
                    burst, remaining, rate = limit
                    headers += [
                        (b"ratelimit-limit", str(burst).encode()),
                        (b"ratelimit-remaining", str(remaining).encode()),
                        (b"ratelimit-policy", f"{burst};w={burst / rate:g}".encode()),
                    ]
                msg["headers"] = headers
            await send(msg)

        # Every log line written while the request is served names it (logs.py merges these).
        with structlog.contextvars.bound_contextvars(request_id=rid):
            await self.app(scope, receive, with_id)
