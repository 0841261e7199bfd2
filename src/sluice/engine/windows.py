"""Rate windows: a provider's limits as it states them, several per kind.

A provider publishes limits per second, minute or day, often several at once
(500 requests a minute and 10,000 a day; 30,000 tokens a minute and a
million a day). Each kind (requests, tokens) has at most :data:`MAX_WINDOWS`
windows: the shortest is the paced limit (control ``rate_max``/``rate_ms``;
the ``#tpm`` budget), the longer ones are hard caps with no pacer of their
own, exact sliding logs counted over their length plus the headroom like the
paced one (docs/architecture.md, "Several windows per kind"). This module
checks the limits as given and names where they live; ``flow.py`` stores them
through ``lua/pace.lua``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from sluice.engine.job import MAX_TOKENS
from sluice.errors import ConfigurationError

#: Windows per kind at most: the paced one and two caps. Dispatch counts each on every call
#: that looks at the kind's gate, so the number is bounded.
MAX_WINDOWS = 3
#: The largest request limit of a window longer than the shortest: the ``starts`` log keeps
#: one entry (about 100 bytes) per start in the longest window, so this caps it near 100 MB.
MAX_REQUEST_CAP = 1_000_000
#: The largest request limit of the shortest (paced) window.
MAX_REQUESTS = 10**9
#: The longest window (s): a day.
MAX_WINDOW_SECONDS = 86_400
#: Window names a provider's page uses, in seconds.
UNITS: dict[str, int] = {"second": 1, "minute": 60, "hour": 3600, "day": 86_400}

#: What a mapping of limits is: window ("minute", or seconds) -> limit.
Limits = Mapping[str, int] | Mapping[int, int] | Mapping[float, int] | Mapping[str | float, int]


@dataclass(frozen=True, slots=True)
class RateWindow:
    """One window of the queue's request-rate or token-rate limits, and how full it is."""

    #: "requests" or "tokens"
    kind: str
    limit: int
    per_seconds: float
    #: starts (requests) or estimated tokens (tokens) the window counts now
    in_window: int
    #: True for the shortest window of its kind, whose pacer spaces the starts; the
    #: others are hard caps
    paced: bool


def window_ms(per: object, what: str = "per", least: float = 0.001) -> int:
    """A window given in seconds (or a unit's name), as whole ms."""
    if isinstance(per, str):
        if per not in UNITS:
            raise ConfigurationError(
                f"{what} {per!r} is not a window: use one of {', '.join(UNITS)}, or a number of seconds"
            )
        per = UNITS[per]
    if isinstance(per, bool) or not isinstance(per, int | float) or not math.isfinite(per):
        raise ConfigurationError(f"{what} must be a number of seconds, got {per!r}")
    if not least <= per <= MAX_WINDOW_SECONDS:
        raise ConfigurationError(
            f"{what} must be from {least:g} to {MAX_WINDOW_SECONDS} seconds, got {per!r}"
        )
    return max(1, round(per * 1000))


def seconds_text(ms: int) -> str:
    """A window in seconds as the scripts print it (Lua's %.14g): 60, 2.5, 0.12."""
    return f"{ms / 1000:.14g}"


def check_limits(kind: str, given: object) -> list[tuple[int, int]]:
    """The windows of one kind ("requests" or "tokens") as (ms, limit), shortest first.

    ``given`` maps a window ("second", "minute", "hour", "day", or seconds) to
    its limit; an empty mapping removes every window of the kind. A longer
    window must admit more than a shorter one: otherwise the shorter never
    matters, and the one paced (the shortest) would not be the one that binds.
    """
    example = {"requests": '{"minute": 500, "day": 10_000}'}.get(kind, '{"minute": 30_000, "day": 1_000_000}')
    if not isinstance(given, Mapping):
        raise ConfigurationError(f"{kind} must be a dict of window -> limit, e.g. {example}; got {given!r}")
    if len(given) > MAX_WINDOWS:
        raise ConfigurationError(
            f"{kind}: at most {MAX_WINDOWS} windows, got {len(given)}; keep the ones that bind "
            "(usually per minute and per day)"
        )
    least = 0.001 if kind == "requests" else 1
    windows: dict[int, int] = {}
    for per, limit in given.items():
        ms = window_ms(per, f"{kind} window", least)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"{kind} per {per!r} must be an integer >= 1, got {limit!r}")
        if ms in windows:
            raise ConfigurationError(f"{kind}: the window of {seconds_text(ms)} s is given twice")
        windows[ms] = limit
    pairs = sorted(windows.items())
    for i, (ms, limit) in enumerate(pairs):
        most = MAX_TOKENS if kind == "tokens" else MAX_REQUESTS if i == 0 else MAX_REQUEST_CAP
        if limit > most:
            raise ConfigurationError(_too_many(kind, ms, limit, most, first=i == 0))
        if i > 0 and limit <= pairs[i - 1][1]:
            shorter_ms, shorter = pairs[i - 1]
            raise ConfigurationError(
                f"{kind}: {limit} per {seconds_text(ms)} s must be more than {shorter} per "
                f"{seconds_text(shorter_ms)} s: a longer window must admit more than a shorter one "
                "(else the shorter one never matters: leave it out)"
            )
    return pairs


def _too_many(kind: str, ms: int, limit: int, most: int, *, first: bool) -> str:
    text = f"{kind} per {seconds_text(ms)} s must be at most {most:,}, got {limit:,}"
    if kind == "requests" and not first:
        text += (
            ": the request log keeps one entry (about 100 bytes) per start in the longest window; "
            "leave out a cap that high"
        )
    return text


def encode_request_caps(pairs: list[tuple[int, int]]) -> str:
    """Control ``rate_caps``: the request windows beyond the paced one, as 'ms:limit ...'."""
    return " ".join(f"{ms}:{limit}" for ms, limit in pairs)


def decode_request_caps(text: str | None) -> list[tuple[int, int]]:
    """Control ``rate_caps`` as (ms, limit) pairs."""
    out = []
    for word in (text or "").split():
        ms, _, limit = word.partition(":")
        out.append((int(ms), int(limit)))
    return out[: MAX_WINDOWS - 1]


def decode_token_caps(text: str | None) -> list[int]:
    """Control ``tok_caps``: the windows (ms) of the token caps beyond the paced one."""
    return [int(ms) for ms in (text or "").split()][: MAX_WINDOWS - 1]
