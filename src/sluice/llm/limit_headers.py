"""What an answer's headers say of the rate limits, and how long a 429 asks to wait.

Each provider says "slow down" in its own words (OpenAI: ``retry-after-ms``, ``retry-after``,
``x-ratelimit-reset-*`` as durations like ``6m0s``; Anthropic: ``retry-after`` and
``anthropic-ratelimit-*-reset`` as RFC 3339 times; Gemini: a ``google.rpc.RetryInfo`` in the
error body). :func:`rate_limits` and :func:`requested_wait` read them all; :func:`clamp_wait`
turns a wait into the pause the queue takes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from sluice.llm.provider import RateLimits

#: Seconds to pause when a 429 says nothing usable about when to come back (nothing, or only a
#: wait of zero or in the past).
FALLBACK_RETRY_AFTER = 1.0
#: The shortest pause a 429 gets, whatever it says. A wait of zero or in the past is not
#: believed (FALLBACK_RETRY_AFTER); a real one of a few ms is, within this floor: the queue
#: pauses that long, and repeated 429s make its pacers run slower for a while
#: (docs/architecture.md, "After a 429"), so a provider that keeps saying "retry in 1 ms"
#: costs a few calls, not a storm. (A longer floor costs a paced queue that much of its
#: limit per 429.)
MIN_RETRY_AFTER = 0.025
#: The longest pause one 429 gets: the whole queue stops for it, so one absurd header
#: (``retry-after: 1e12``) must not stop it for days. A limit still exhausted after this many
#: seconds costs one more cheap 429 and another pause.
MAX_RETRY_AFTER = 300.0
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


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
