"""Turning an HTTP answer into the three failure kinds of :mod:`sluice.llm.provider`.

Each provider reports a bad key, an unknown model, a quota or an outage with different
statuses and bodies. :func:`error_from_response` reads them all, so that a handler gets the
same :class:`~sluice.llm.provider.ProviderThrottled` / ``ProviderUnavailable`` /
``ProviderRejected`` whichever provider it calls, and the queue does the right thing: pause,
retry with backoff, or dead-letter. Every message is scrubbed of the key
(:mod:`sluice.llm.keys`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from sluice.llm.keys import Secret, redact, safe_url, scrub
from sluice.llm.limit_headers import MAX_RETRY_AFTER, clamp_wait, rate_limits, requested_wait
from sluice.llm.provider import ProviderRejected, ProviderThrottled, ProviderUnavailable

#: Statuses below 500 that are worth retrying as they are: request timeout, conflict, too early.
_TRANSIENT_4XX = frozenset({408, 409, 425})
_AUTH_KINDS = frozenset(
    {"authentication_error", "permission_error", "UNAUTHENTICATED", "PERMISSION_DENIED", "invalid_api_key"}
)
_AUTH_CODES = frozenset(
    {"invalid_api_key", "API_KEY_INVALID", "API_KEY_SERVICE_BLOCKED", "PERMISSION_DENIED"}
)
_MODEL_CODES = frozenset({"model_not_found", "not_found_error", "NOT_FOUND"})
_MODEL_WORDS = re.compile(
    r"\bmodel\b[^.]{0,120}?\b(?:not found|does not exist|is not supported|not available|unknown)"
    r"|\b(?:unknown|invalid|unsupported|no such) model\b",
    re.IGNORECASE,
)
#: Quota errors that only money fixes: OpenAI's 429 ``insufficient_quota`` (its message is the one
#: Gemini's per-minute 429s use too, so only the code counts), Anthropic's 400 on credit.
_NO_CREDIT_CODES = frozenset({"insufficient_quota"})
_NO_CREDIT_WORDS = re.compile(r"credit balance is too low", re.IGNORECASE)
#: Gemini's per-day quotas (a QuotaFailure ``quotaId`` like ``GenerateRequestsPerDayPerProjectPerModel``,
#: or a message naming "requests per day"): they refill only the next day, so they are rejected too.
_PER_DAY_WORDS = re.compile(r"per[ _-]?day", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ErrorBody:
    """What an error answer's body says, in any of the providers' shapes.

    ``kind``: OpenAI's ``type``, Anthropic's ``error.type``, Google's ``status``. ``code``:
    OpenAI's ``code``, or the ``reason`` of Google's ``ErrorInfo``. ``details``: Google's.
    """

    message: str
    kind: str | None = None
    code: str | None = None
    details: list[Any] = field(default_factory=list)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _redact_value(value: Any, secrets: Sequence[Secret]) -> Any:
    """A JSON value with every secret replaced in its strings (keys of objects too)."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {redact(str(k), secrets): _redact_value(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(v, secrets) for v in value]
    return value


def read_error(response: httpx.Response, secrets: Sequence[Secret] = ()) -> ErrorBody:
    """The provider's own account of a failed request (its JSON error, or its text), whole and
    without ``secrets``: a message that is not a string (an object, a list) is rendered as JSON
    after the secrets are taken out of its strings, since JSON escapes could hide them from a
    search of the rendered text. Shortening is :func:`scrub`'s, after redaction."""
    try:
        data: Any = response.json()
    except ValueError:
        data = None
    if isinstance(data, list) and data:
        data = data[0]  # Google answers some calls with a list of errors
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        source: dict[str, Any] = error
    elif isinstance(data, dict):
        source = {**data, "message": error} if isinstance(error, str) else data
    else:
        return ErrorBody(redact(response.text.strip(), secrets) or response.reason_phrase)
    message = source.get("message", source.get("detail"))  # "detail": FastAPI-based servers
    if isinstance(message, str):
        message = redact(message, secrets)
    elif message is None:
        message = response.reason_phrase
    else:
        message = json.dumps(_redact_value(message, secrets), ensure_ascii=False)
    raw_details = source.get("details")
    details: list[Any] = raw_details if isinstance(raw_details, list) else []
    reason = next((_str(d.get("reason")) for d in details if isinstance(d, dict) and d.get("reason")), None)
    return ErrorBody(
        message=message,
        kind=_str(source.get("type")) or _str(source.get("status")),
        code=_str(source.get("code")) or reason,
        details=details,
    )


def _rejection_kind(status: int, body: ErrorBody) -> str:
    if status in (401, 403) or body.kind in _AUTH_KINDS or body.code in _AUTH_CODES:
        return "auth"
    if status == 404 or body.code in _MODEL_CODES or body.kind in _MODEL_CODES:
        return "model"
    if status == 501:
        return "unsupported"
    return "model" if _MODEL_WORDS.search(body.message) else "request"


def _per_day_quota(body: ErrorBody) -> bool:
    """Whether a RESOURCE_EXHAUSTED names a per-day quota (in a QuotaFailure, or its message)."""
    for detail in body.details:
        if not (
            isinstance(detail, dict) and str(detail.get("@type", "")).endswith("google.rpc.QuotaFailure")
        ):
            continue
        violations = detail.get("violations")
        for violation in violations if isinstance(violations, list) else []:
            if isinstance(violation, dict) and any(
                _PER_DAY_WORDS.search(str(violation.get(name, "")))
                for name in ("quotaId", "quotaMetric", "description")
            ):
                return True
    return bool(_PER_DAY_WORDS.search(body.message))


def error_from_response(
    provider: str,
    response: httpx.Response,
    *,
    secrets: Sequence[Secret] = (),
    key_env: str | None = None,
    model: str | None = None,
    now: datetime | None = None,
) -> ProviderThrottled | ProviderUnavailable | ProviderRejected:
    """The exception for a failed answer (status 300 and above).

    429 and Google's ``RESOURCE_EXHAUSTED``: :class:`ProviderThrottled` after
    :func:`retry_after` (but a quota only money fixes, such as OpenAI's ``insufficient_quota``,
    or Gemini's exhausted per-day quota, is rejected as ``auth``: pausing would loop all day).
    5xx (Anthropic's 529 "overloaded" too), 408, 409, 425: :class:`ProviderUnavailable`. Other
    statuses: :class:`ProviderRejected` of kind ``auth`` (401, 403, or a body saying the key is
    invalid, as Gemini's 400 does), ``model`` (404, or a body naming an unknown model),
    ``unsupported`` (501), else ``request``.
    The provider's message is in ours, without ``secrets``; ``key_env`` names where the key
    came from and ``model`` the model asked for, for the advice.
    """
    status = response.status_code
    body = read_error(response, secrets)
    said = scrub(body.message, secrets).rstrip(". ") or response.reason_phrase
    where = f"HTTP {status} from {response.request.method} {safe_url(response.request.url)}"
    limits = rate_limits(response.headers, now)
    if body.code in _NO_CREDIT_CODES or _NO_CREDIT_WORDS.search(body.message):
        return ProviderRejected(
            provider,
            f"{where}: {said}. The account has no credit or quota left: add some with the provider "
            "(retrying cannot help)",
            status=status,
            kind="auth",
        )
    if body.kind == "RESOURCE_EXHAUSTED" and _per_day_quota(body):
        return ProviderRejected(
            provider,
            f"{where}: {said}. A per-day quota is used up: it refills only the next day (raise it with "
            "the provider, e.g. a paid tier, or replay the job then; retrying today cannot help)",
            status=status,
            kind="auth",
        )
    if status == 429 or body.kind == "RESOURCE_EXHAUSTED":
        asked = requested_wait(response.headers, body.details, now)
        wait = clamp_wait(asked)
        capped = ""
        if asked is not None and asked > MAX_RETRY_AFTER:
            capped = f" (it asked for {asked:g} s; one pause is at most {MAX_RETRY_AFTER:g} s)"
        return ProviderThrottled(
            provider,
            wait,
            f"rate limited ({where}): {said}; retry in {round(wait, 3):g} s{capped}",
            limits,
            # (a 429 that said nothing usable asked for no wait: the fallback is ours)
            asked=0.0 if asked is None else asked,
        )
    if (status >= 500 and status != 501) or status in _TRANSIENT_4XX:
        return ProviderUnavailable(
            provider, f"{where}: {said}. The provider failed or is overloaded; try again later", status
        )
    if status < 400:
        location = response.headers.get("location")
        moved = f"to {safe_url(location)}" if location else "elsewhere"
        return ProviderRejected(
            provider,
            f"{where}: the server redirects {moved}: set the base URL to where it points",
            status=status,
            kind="request",
        )
    kind = _rejection_kind(status, body)
    advice = {
        "auth": (
            f"The provider refused the API key: check {key_env} (a valid key of this provider, allowed to "
            "use this model)"
            if key_env
            else "The server wants an API key or refused the credentials: configure one"
        ),
        "model": (
            f"Check the model name{f' {model!r}' if model else ''} and that the base URL is the "
            "provider's API"
        ),
        "unsupported": "The server does not implement this endpoint",
        "request": "The provider refused this request, so retrying it cannot help: fix the request",
    }[kind]
    return ProviderRejected(provider, f"{where}: {said}. {advice}", status=status, kind=kind)


def error_from_transport(
    provider: str, exc: httpx.HTTPError, request: httpx.Request, secrets: Sequence[Secret] = ()
) -> ProviderUnavailable:
    """The exception for a call that got no answer: a timeout, a refused or broken connection."""
    timeouts = request.extensions.get("timeout", {})
    where = f"{request.method} {safe_url(request.url)}"
    if isinstance(exc, httpx.PoolTimeout):
        what = (
            f"every connection stayed busy for {timeouts.get('pool')} s: lower the worker's concurrency "
            "or raise the provider's max_connections"
        )
    elif isinstance(exc, httpx.ConnectTimeout):
        what = f"could not connect within {timeouts.get('connect')} s"
    elif isinstance(exc, httpx.TimeoutException):
        what = f"no answer within the timeout of {timeouts.get('read')} s"
    elif isinstance(exc, httpx.ConnectError):
        what = f"cannot connect ({scrub(str(exc), secrets)}): check that the server runs and the base URL"
    else:
        what = f"the connection failed ({type(exc).__name__}: {scrub(str(exc), secrets)})"
    return ProviderUnavailable(provider, f"{where}: {what}")
