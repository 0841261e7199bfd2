"""What the HTTP providers share: the client, reading rate-limit headers, and turning an HTTP
answer into the three failure kinds of :mod:`sluice.llm.provider`.

Each provider says "slow down" in its own words (OpenAI: ``retry-after-ms``, ``retry-after``,
``x-ratelimit-reset-*`` as durations like ``6m0s``; Anthropic: ``retry-after`` and
``anthropic-ratelimit-*-reset`` as RFC 3339 times; Gemini: a ``google.rpc.RetryInfo`` in the
error body) and reports a bad key, an unknown model or an outage with different statuses and
bodies. :func:`error_from_response` reads them all, so that a handler gets the same
:class:`~sluice.llm.provider.ProviderThrottled` / ``ProviderUnavailable`` /
``ProviderRejected`` whichever provider it calls, and the queue does the right thing: pause,
retry with backoff, or dead-letter.

Keys: a provider keeps its key only in its client's headers and in a :class:`Secret` (whose
repr hides it), and every message taken from an answer or a transport error is scrubbed of
it before it becomes part of an exception: some servers echo the key they were sent.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any, Self

import httpx

from sluice.engine.context import current_job
from sluice.errors import ConfigurationError
from sluice.llm import pricing
from sluice.llm.provider import (
    ProviderRejected,
    ProviderThrottled,
    ProviderUnavailable,
    RateLimits,
    Usage,
)

#: LLM answers can take minutes (long outputs, reasoning models); connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
DEFAULT_MAX_CONNECTIONS = 100
#: Seconds to pause when a 429 says nothing usable about when to come back (nothing, or only a
#: wait of zero or in the past).
FALLBACK_RETRY_AFTER = 1.0
#: The shortest pause a 429 gets, whatever it says. A wait of zero or in the past is not
#: believed (FALLBACK_RETRY_AFTER); a real one of a few ms is, within this floor: the queue
#: pauses that long, and repeated 429s make its pacers run slower for a while
#: (docs/architecture.md, "After a 429"), so a provider that keeps saying "retry in 1 ms"
#: costs a few calls, not a storm.
#: (It was 0.5 s, which cost a paced queue about half a second of its limit per 429.)
MIN_RETRY_AFTER = 0.025
#: The longest pause one 429 gets: the whole queue stops for it, so one absurd header
#: (``retry-after: 1e12``) must not stop it for days. A limit still exhausted after this many
#: seconds costs one more cheap 429 and another pause.
MAX_RETRY_AFTER = 300.0
#: The longest provider message repeated in ours.
MAX_MESSAGE_CHARS = 500
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
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")


class Secret:
    """An API key that does not show itself: its repr and str are ``Secret('***')``."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


def read_key(
    env: Mapping[str, str], names: Sequence[str], *, provider: str, required: bool, hint: str = ""
) -> tuple[Secret | None, str | None]:
    """The key from the first of ``names`` set in ``env``, and that variable's name.

    Whitespace around it is dropped (a pasted newline is the usual mistake). A missing key is a
    :class:`~sluice.errors.ConfigurationError` naming the variable when ``required``; a key that
    an HTTP header cannot carry is one always. Neither message contains the key.
    """
    for name in names:
        value = env.get(name, "").strip()
        if not value:
            continue
        if not _HEADER_SAFE.fullmatch(value):
            raise ConfigurationError(
                f"{provider}: {name} holds characters an HTTP header cannot carry (spaces, line "
                "breaks or non-ASCII letters inside the key): set it again to the key exactly as the "
                "provider shows it"
            )
        return Secret(value), name
    if required:
        wanted = " (or ".join(names) + ")" * (len(names) - 1)
        raise ConfigurationError(
            f"{provider}: no API key: set {wanted} in the environment to the provider's API key" + hint
        )
    return None, None


def check_base_url(provider: str, base_url: str, setting: str = "base_url") -> str:
    """``base_url`` without a trailing slash; ConfigurationError unless it is an http(s) URL."""
    url = base_url.strip().rstrip("/")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ConfigurationError(f"{provider}: {setting} {safe_url(url)!r} is not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigurationError(
            f"{provider}: {setting} {safe_url(url)!r} must start with http:// or https:// and name a host, "
            "e.g. http://localhost:11434/v1"
        )
    return url


def safe_url(url: httpx.URL | str) -> str:
    """``url`` without its query and user:password: what an error message may show."""
    try:
        u = httpx.URL(str(url))
    except httpx.InvalidURL:
        return "(an invalid URL)"
    port = f":{u.port}" if u.port is not None else ""
    return f"{u.scheme}://{u.host}{port}{u.path}"


def redact(text: str, secrets: Sequence[Secret]) -> str:
    """``text`` with every secret replaced by ``[redacted]``, at its full length."""
    for secret in secrets:
        text = text.replace(secret.reveal(), "[redacted]")
    return text


def scrub(text: str, secrets: Sequence[Secret]) -> str:
    """``text`` with every secret replaced, then shortened to :data:`MAX_MESSAGE_CHARS`.

    In that order: shortening first could cut a key in two, and the half before the cut would
    no longer match the key and stay in the message.
    """
    text = " ".join(redact(text, secrets).split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def _redact_value(value: Any, secrets: Sequence[Secret]) -> Any:
    """A JSON value with every secret replaced in its strings (keys of objects too)."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {redact(str(k), secrets): _redact_value(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(v, secrets) for v in value]
    return value


def make_client(
    base_url: str,
    headers: Mapping[str, str],
    *,
    timeout: float | httpx.Timeout | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> httpx.AsyncClient:
    """An AsyncClient for one provider: its base URL and headers, a timeout (seconds for every
    phase but connecting, which gets at most 10 s; default :data:`DEFAULT_TIMEOUT`), and at most
    ``max_connections`` connections (a worker's concurrent calls beyond that wait for one).
    Redirects are not followed: a moved API is a configuration to fix, not to guess."""
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, httpx.Timeout):
        timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(base_url=base_url, headers=dict(headers), timeout=timeout, limits=limits)


# ---- reading headers ---------------------------------------------------------------------------


def parse_duration(text: str | None) -> float | None:
    """Seconds of a duration as OpenAI writes resets (``20ms``, ``1s``, ``6m0s``, ``1h2m3.5s``)
    or as Google writes delays (``12s``, ``0.5s``), or of a bare number of seconds; None if unreadable."""
    if not text:
        return None
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        return value if math.isfinite(value) and value >= 0 else None
    total, pos = 0.0, 0
    for part in _DURATION_PART.finditer(text):
        if part.start() != pos:
            return None
        total += float(part.group(1)) * _UNIT_SECONDS[part.group(2)]
        pos = part.end()
    return total if 0 < pos == len(text) else None


def _seconds_until(text: str | None, now: datetime) -> float | None:
    """Seconds from ``now`` to an RFC 3339 or HTTP date (negative when past); None if unreadable."""
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return (when - now).total_seconds()


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _anthropic_reset(headers: httpx.Headers, name: str, now: datetime) -> float | None:
    seconds = _seconds_until(headers.get(f"anthropic-ratelimit-{name}-reset"), now)
    return None if seconds is None else max(0.0, seconds)


def _count_or_none(value: int | None) -> int | None:
    return value if value is not None and value >= 0 else None


def transit_ms(headers: httpx.Headers, round_trip_ms: float) -> float | None:
    """The round trip less the time the provider says it spent (OpenAI's ``openai-processing-ms``):
    what the network and both ends' queues took; None when the answer does not say."""
    spent = _int(headers.get("openai-processing-ms"))
    if spent is None or round_trip_ms < spent:
        return None
    return round_trip_ms - spent


def rate_limits(headers: httpx.Headers, now: datetime | None = None) -> RateLimits:
    """What an answer's headers say of the limits: OpenAI's ``x-ratelimit-*`` or Anthropic's
    ``anthropic-ratelimit-*`` (its ``tokens-*`` are the tightest of input and output tokens;
    without them, ``input-tokens-*``). Resets are seconds from ``now``."""
    now = now or datetime.now(UTC)
    if any(name.startswith("anthropic-ratelimit-") for name in headers):
        tokens = "tokens" if "anthropic-ratelimit-tokens-limit" in headers else "input-tokens"
        return RateLimits(
            limit_requests=_int(headers.get("anthropic-ratelimit-requests-limit")),
            remaining_requests=_int(headers.get("anthropic-ratelimit-requests-remaining")),
            reset_requests=_anthropic_reset(headers, "requests", now),
            limit_tokens=_int(headers.get(f"anthropic-ratelimit-{tokens}-limit")),
            remaining_tokens=_int(headers.get(f"anthropic-ratelimit-{tokens}-remaining")),
            reset_tokens=_anthropic_reset(headers, tokens, now),
        )
    return RateLimits(
        limit_requests=_int(headers.get("x-ratelimit-limit-requests")),
        remaining_requests=_int(headers.get("x-ratelimit-remaining-requests")),
        reset_requests=parse_duration(headers.get("x-ratelimit-reset-requests")),
        limit_tokens=_int(headers.get("x-ratelimit-limit-tokens")),
        remaining_tokens=_int(headers.get("x-ratelimit-remaining-tokens")),
        reset_tokens=parse_duration(headers.get("x-ratelimit-reset-tokens")),
    )


def _resets(headers: httpx.Headers, now: datetime) -> list[tuple[int | None, float]]:
    """(remaining, seconds to reset) of every limit the headers describe with a reset."""
    found: list[tuple[int | None, float]] = []
    for name in ("requests", "tokens"):
        reset = parse_duration(headers.get(f"x-ratelimit-reset-{name}"))
        if reset is not None:
            found.append((_int(headers.get(f"x-ratelimit-remaining-{name}")), reset))
    for name in ("requests", "tokens", "input-tokens", "output-tokens"):
        reset = _anthropic_reset(headers, name, now)
        if reset is not None:
            found.append((_int(headers.get(f"anthropic-ratelimit-{name}-remaining")), reset))
    return found


def _retry_info_delay(details: Sequence[Any]) -> float | None:
    for detail in details:
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("google.rpc.RetryInfo"):
            return parse_duration(str(detail.get("retryDelay", "")))
    return None


def requested_wait(
    headers: httpx.Headers, details: Sequence[Any] = (), now: datetime | None = None
) -> float | None:
    """Seconds a 429 asks to wait, as it says them (unclamped), or None when it says nothing usable.

    In order, the first that gives a wait above zero: ``retry-after-ms``; ``retry-after``
    (seconds or an HTTP date); Gemini's ``RetryInfo.retryDelay`` in the error ``details``; the
    resets of the limits that are exhausted (remaining 0), or of all limits described when none
    says 0, the longest. A wait of zero or in the past is skipped: a refusal that says "now"
    contradicts itself (or the clocks disagree), so it tells nothing about when to come back.
    """
    now = now or datetime.now(UTC)
    ms = parse_duration(headers.get("retry-after-ms"))
    if ms is not None and ms > 0:
        return ms / 1000
    text = headers.get("retry-after")
    seconds = parse_duration(text)
    if seconds is None:
        seconds = _seconds_until(text, now)
    if seconds is not None and seconds > 0:
        return seconds
    seconds = _retry_info_delay(details)
    if seconds is not None and seconds > 0:
        return seconds
    resets = _resets(headers, now)
    exhausted = [reset for remaining, reset in resets if remaining == 0]
    candidates = exhausted or [reset for _, reset in resets]
    longest = max(candidates, default=0.0)
    return longest if longest > 0 else None


def clamp_wait(seconds: float | None) -> float:
    """The pause for a wait a 429 asked for: :data:`FALLBACK_RETRY_AFTER` when it asked for none,
    else the wait within :data:`MIN_RETRY_AFTER` and :data:`MAX_RETRY_AFTER`."""
    if seconds is None or not math.isfinite(seconds):
        return FALLBACK_RETRY_AFTER if seconds is None else MAX_RETRY_AFTER
    return min(max(seconds, MIN_RETRY_AFTER), MAX_RETRY_AFTER)


def retry_after(headers: httpx.Headers, details: Sequence[Any] = (), now: datetime | None = None) -> float:
    """Seconds to pause for a 429: :func:`requested_wait`, clamped by :func:`clamp_wait` (never
    less than :data:`MIN_RETRY_AFTER` nor more than :data:`MAX_RETRY_AFTER`; when the answer
    says nothing usable, :data:`FALLBACK_RETRY_AFTER`)."""
    return clamp_wait(requested_wait(headers, details, now))


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


# ---- reading errors ----------------------------------------------------------------------------


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


# ---- the providers' common part ----------------------------------------------------------------


def cost_of(provider: str, reported_model: str | None, model: str, usage: Usage) -> float | None:
    """What ``usage`` cost: the price of the model the answer names (a dated version, say), else
    of the model asked for; None when the pricing table knows neither, or when the answer
    reported no usage (its zeros are unknown, and a price of zero would say "free")."""
    if not usage.reported:
        return None
    price = pricing.cost(provider, reported_model, usage) if reported_model else None
    return price if price is not None else pricing.cost(provider, model, usage)


class HTTPProvider:
    """What the HTTP providers share: a name, a client, the key's whereabouts, one ``post``.

    Use one per event loop (the client's connections belong to it) and close it with
    :meth:`aclose` (or ``async with``).
    """

    def __init__(
        self,
        *,
        name: str,
        base_url: str,
        headers: Mapping[str, str],
        key: Secret | None,
        key_env: str | None,
        default_model: str | None,
        timeout: float | httpx.Timeout | None,
        max_connections: int,
    ) -> None:
        self.name = name
        self.base_url = base_url
        #: the model to use when the caller has no preference (``provider_from_env`` sets it)
        self.default_model = default_model
        self._key = key
        self._key_env = key_env
        self._client = make_client(base_url, headers, timeout=timeout, max_connections=max_connections)

    def __repr__(self) -> str:
        key = f"from {self._key_env}" if self._key is not None else "none"
        return f"{type(self).__name__}(name={self.name!r}, base_url={self.base_url!r}, key={key})"

    async def post(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        headers: Mapping[str, str] | None = None,
        model: str,
        paced: bool = True,
    ) -> tuple[dict[str, Any], RateLimits]:
        """POST ``body`` as JSON to ``path``; the answer's JSON object and rate limits, or one of
        the three provider errors. ``paced``: the call a job was dispatched for (a completion, not
        an embedding on the way): the running job notes it leaving (JobContext.note_sent)."""
        secrets = [self._key] if self._key is not None else []
        request = self._client.build_request("POST", path, json=body, headers=headers)
        job = current_job() if paced else None
        # Only the attempt's first call is the one its dispatch counted: it alone is reported
        # (the pacer's measured headroom, engine/lag.py; the provider's view, provider_view.py).
        if job is not None and not job.note_sent():
            job = None
        sent = time.monotonic()
        try:
            response = await self._client.send(request)
        except httpx.HTTPError as exc:
            raise error_from_transport(self.name, exc, request, secrets) from None
        if not response.is_success:
            raise error_from_response(
                self.name, response, secrets=secrets, key_env=self._key_env, model=model
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise self.unexpected(path, "the body is not a JSON object")
        limits = rate_limits(response.headers)
        if job is not None:
            # (a negative figure, which some servers send, is taken as not said: reporting
            # must never fail a call that was served)
            job.note_provider_limits(
                limit_requests=_count_or_none(limits.limit_requests),
                remaining_requests=_count_or_none(limits.remaining_requests),
                limit_tokens=_count_or_none(limits.limit_tokens),
                remaining_tokens=_count_or_none(limits.remaining_tokens),
                transit_ms=transit_ms(response.headers, (time.monotonic() - sent) * 1000),
            )
        return data, limits

    def unexpected(self, path: str, what: str) -> ProviderUnavailable:
        """A success answer we cannot read (a proxy's page, an incompatible server): retried."""
        return ProviderUnavailable(
            self.name,
            f"the answer to POST {safe_url(self.base_url + path)} is a success, but {what}; is "
            f"{safe_url(self.base_url)} the API of {self.name}?",
            200,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
