"""One shape for every error the API returns, and the handlers that produce it.

Every error body is ``{"error": {"status": 422, "code": "...", "message": "...",
"field": "..."?}}`` (plus NestJS-style ``statusCode`` and ``message`` at the top
level, which that design's clients read), whatever raised it: validation,
an unknown field, a body too large, a missing job, the engine. A client
parses one shape; a message says what to change.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from sluice.errors import (
    BudgetError,
    BudgetNotFound,
    InvalidJobError,
    JobNotFound,
    JobStateError,
    RedisUnavailable,
    StoreUnavailable,
)
from sluice.service.schemas import ErrorOut

_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid",
    429: "too_many_requests",
    500: "internal",
    503: "unavailable",
}


#: What each error status means, as /openapi.json says it.
_DESCRIPTIONS = {
    400: "The body breaks the schema (the ArQueue routes' status for it)",
    401: "No API key, or one that is unknown or revoked",
    403: "The route needs an admin key",
    404: "No such job or budget (another tenant's jobs are not found either)",
    409: "The request conflicts with the current state (e.g. the job is finished, the budget exists)",
    413: "The body is larger than the server accepts",
    415: "The body is not JSON (the ArQueue routes)",
    422: "A field is invalid: error.field names it, error.message says what to change",
    429: "Too many requests from this key, or the queue is too far behind; come back after Retry-After",
    503: "Redis is unavailable or the service is still starting; try again shortly",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}}}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route or router: these error statuses, each with the one error body.

    A status a route can answer is in /openapi.json, so clients (and schemathesis) know
    every answer they may get.
    """
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorOut, "description": _DESCRIPTIONS[status]}
        if status in (429, 503):
            out[status]["headers"] = _RETRY_AFTER
    return out


class ApiError(Exception):
    """An error with its HTTP status; raise it from a route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or _CODES.get(status, "error")
        self.field = field
        self.headers = headers


def error_body(
    status: int, message: str, code: str | None = None, field: str | None = None
) -> dict[str, Any]:
    err: dict[str, Any] = {"status": status, "code": code or _CODES.get(status, "error"), "message": message}
    if field is not None:
        err["field"] = field
    return {"statusCode": status, "message": message, "error": err}


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, field), status_code=status, headers=headers)


def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": "value_error"}
    field = _location(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {field!r}; remove it (see /openapi.json for the fields this route takes)"
    elif first.get("type") == "json_invalid":
        message = f"the body is not valid JSON: {first.get('msg', '')}"
        field = "body"
    else:
        message = f"{field}: {first.get('msg', 'invalid')}"
    body = error_body(422, message, "invalid", field)
    body["error"]["details"] = [
        {"field": _location(tuple(e.get("loc", ()))), "message": e.get("msg", ""), "type": e.get("type", "")}
        for e in errors[:20]
    ]
    return JSONResponse(body, status_code=422)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> str | None:
    """Every method some route takes at this path: Starlette's 405 names the methods of the
    first route that matched the path only (``POST`` for /v1/jobs, which takes GET too)."""
    routes = request.app.router.routes
    allowed = [
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    ]
    return ", ".join(allowed) or None


#: What FastAPI answers (400) when it cannot read the body as text, e.g. bytes that are not UTF-8.
_UNREADABLE_BODY = "There was an error parsing the body"


def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and exc.detail == _UNREADABLE_BODY:
        # Not JSON, as a body that does not parse is (422 from _validation): one answer for both.
        return error_response(422, "the body is not valid JSON: it is not UTF-8 text", field="body")
    headers = dict(exc.headers) if exc.headers else None
    if exc.status_code == 405:
        allow = _allowed_methods(request)
        if allow is not None:
            headers = {**(headers or {}), "Allow": allow}
    return error_response(exc.status_code, str(exc.detail), headers=headers)


def _api(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.message, code=exc.code, field=exc.field, headers=exc.headers)


#: The engine's errors that a route lets through, and what they answer.
ENGINE_ERRORS = (
    JobNotFound,
    BudgetNotFound,
    JobStateError,
    InvalidJobError,
    BudgetError,
    RedisUnavailable,
    StoreUnavailable,
)


def engine_error(exc: Exception) -> ApiError:
    """The answer to an engine error (one of ``ENGINE_ERRORS``; anything else is a 500)."""
    if isinstance(exc, JobNotFound):
        return ApiError(404, str(exc))
    if isinstance(exc, BudgetNotFound):
        return ApiError(404, str(exc), field="budget")
    if isinstance(exc, JobStateError):
        return ApiError(409, str(exc))
    if isinstance(exc, InvalidJobError | BudgetError):
        return ApiError(422, str(exc))
    if isinstance(exc, StoreUnavailable | RedisUnavailable):
        which = "the store (PostgreSQL)" if isinstance(exc, StoreUnavailable) else "the queue's Redis"
        return ApiError(503, f"{which} is unavailable; try again shortly", headers={"Retry-After": "1"})
    return ApiError(500, "internal error")


def _engine(request: Request, exc: Exception) -> JSONResponse:
    return _api(request, engine_error(exc))


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(ApiError, _api)
    for exc in ENGINE_ERRORS:
        app.add_exception_handler(exc, _engine)
