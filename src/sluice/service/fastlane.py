"""The fast lane: an ordinary job submission answered without FastAPI's per-request machinery.

At a high submission rate, FastAPI's routing, dependency solving and response
building cost about as much CPU as accepting the job itself (a profile of
``POST /jobs``; docs/decisions/0016 has the figures). Submissions are the one
hot path, so they get a lane of their own, in front of the routes:

* it takes only the ordinary case: ``POST`` to ``/jobs``, ``/v1/jobs`` or
  ``/enqueue`` with a JSON body the route's model accepts and a key the
  process has looked up in the last ``KEY_CACHE_SECONDS``;
* anything else (a body that fails validation, another content type, no key,
  a key not cached, the service still starting) goes on to FastAPI untouched,
  its body replayed: every error keeps the route's own answer, because the
  route gives it;
* once a request is taken, it runs the very functions the route runs
  (``authorize`` for the rate limit, ``admit`` for backpressure, the route's
  ``accept_*``) and answers the same status, headers and bytes; the tests
  send the same requests through the lane and through FastAPI and compare.

Nothing with an effect happens before the lane decides: parsing, validating
and reading the key cache have none, so a request handed on is counted
(rate limit) and served exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.service.context import DEFAULT_TENANT, Caller, Services, admit, authorize, cached_key
from sluice.service.errors import ENGINE_ERRORS, ApiError, engine_error, error_response
from sluice.service.routes_arqueue import accept_arq
from sluice.service.routes_compat import accept_nest
from sluice.service.routes_v1 import accept_job
from sluice.service.schemas import ArqTaskIn, JobIn, JobOut, NestJobIn
from sluice.store.keys import ApiKey, digest


@dataclass(frozen=True, slots=True)
class _Lane:
    """One route the lane serves: its body model, and what it answers once admitted."""

    model: type[BaseModel]
    accept: Callable[[Services, Caller, Any, str], Awaitable[BaseModel]]
    parse: Callable[[type[BaseModel], bytes], BaseModel]


def _fastapi_parse(model: type[BaseModel], body: bytes) -> BaseModel:
    # As FastAPI reads a JSON body: json.loads, then the model in Python mode.
    return model.model_validate(json.loads(body))


def _json_parse(model: type[BaseModel], body: bytes) -> BaseModel:
    # As the ArQueue route reads its body itself.
    return model.model_validate_json(body)


_LANES: dict[str, _Lane] = {
    "/jobs": _Lane(NestJobIn, accept_nest, _fastapi_parse),
    "/v1/jobs": _Lane(JobIn, accept_job, _fastapi_parse),
    "/enqueue": _Lane(ArqTaskIn, accept_arq, _json_parse),
}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _api_key(scope: Scope) -> str | None:
    """The key as the route's security dependencies read it, when it is plainly there: a
    ``Bearer`` credential, else ``X-API-Key``. None hands the request on (the route says why)."""
    authorization = _header(scope, b"authorization")
    if authorization:
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return credentials.strip()
    key = _header(scope, b"x-api-key")
    return key or None


def _is_json(scope: Scope) -> bool:
    value = _header(scope, b"content-type")
    return value is not None and value.split(";")[0].strip().lower() == "application/json"


class FastLane:
    """ASGI middleware: ordinary submissions served here, everything else by ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        #: requests this lane answered, and those it handed on (for tests and metrics)
        self.served = 0
        self.handed_on = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = _LANES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        svc: Services | None = getattr(scope["app"].state, "services", None) if lane else None
        if lane is None or svc is None or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        try:
            body = await _read_body(receive)
        except StarletteHTTPException as exc:  # the body limit, met while it streamed in
            await error_response(exc.status_code, str(exc.detail))(scope, receive, send)
            return
        if body is None:  # the client went away
            return
        key = _cached_key(svc, scope) if svc.auth else None
        parsed = _parsed(lane, body) if key is not None or not svc.auth else None
        if parsed is None:
            self.handed_on += 1
            await self.app(scope, _replay(body, receive), send)
            return
        self.served += 1
        state = scope.setdefault("state", {})
        try:
            who = await authorize(svc, *key, state) if key is not None else Caller(DEFAULT_TENANT, admin=True)
            await admit(svc)
            out = await lane.accept(svc, who, parsed, state["request_id"])
        except ApiError as exc:
            response = _error(exc)
        except ENGINE_ERRORS as exc:
            response = _error(engine_error(exc))
        else:
            created = not isinstance(out, JobOut) or bool(out.created)
            response = Response(
                out.__pydantic_serializer__.to_json(out, by_alias=True),
                status_code=201 if created else 200,
                media_type="application/json",
            )
        await response(scope, receive, send)


def _error(exc: ApiError) -> Response:
    return error_response(exc.status, exc.message, code=exc.code, field=exc.field, headers=exc.headers)


def _cached_key(svc: Services, scope: Scope) -> tuple[str, ApiKey] | None:
    """The request's key (its digest, and what it is) when the process knows it as live; None
    when the route must look (no key, one not looked up lately, an unknown or revoked one)."""
    key = _api_key(scope)
    if key is None:
        return None
    hashed = digest(key)
    known, found = cached_key(svc, hashed)
    return (hashed, found) if known and found is not None else None


def _parsed(lane: _Lane, body: bytes) -> BaseModel | None:
    try:
        return lane.parse(lane.model, body)
    except (ValueError, ValidationError, RecursionError):  # JSON and Unicode errors are ValueErrors
        return None


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body read already, then whatever the client sends next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
