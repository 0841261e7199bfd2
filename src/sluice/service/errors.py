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

from sluice.errors import (
    BudgetError,
    BudgetNotFound,
    InvalidJobError,
    JobNotFound,
    JobStateError,
    RedisUnavailable,
)

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


def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers) if exc.headers else None
    return error_response(exc.status_code, str(exc.detail), headers=headers)


def _api(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.message, code=exc.code, field=exc.field, headers=exc.headers)


def _engine(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, JobNotFound):
        return error_response(404, str(exc))
    if isinstance(exc, BudgetNotFound):
        return error_response(404, str(exc), field="budget")
    if isinstance(exc, JobStateError):
        return error_response(409, str(exc))
    if isinstance(exc, InvalidJobError | BudgetError):
        return error_response(422, str(exc))
    if isinstance(exc, RedisUnavailable):
        return error_response(
            503, "the queue's Redis is unavailable; try again shortly", headers={"Retry-After": "1"}
        )
    return error_response(500, "internal error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(ApiError, _api)
    for exc in (JobNotFound, BudgetNotFound, JobStateError, InvalidJobError, BudgetError, RedisUnavailable):
        app.add_exception_handler(exc, _engine)
