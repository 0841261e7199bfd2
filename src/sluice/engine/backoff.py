"""Retry delays: exponential with jitter, or fixed.

Jitter spreads retries of jobs that failed together (a provider outage) so
they do not come back as one burst. The delay is computed by the worker that
saw the failure, which passes the due time to the script: Lua's random
generator is deterministic inside Redis and would make every job agree.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from sluice.engine.codec import dumps
from sluice.errors import InvalidJobError

BackoffKind = Literal["exponential", "fixed"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long to wait before retrying a failed attempt.

    ``exponential``: ``delay * 2 ** (attempt - 1)``, capped at ``max_delay``;
    ``fixed``: always ``delay``. Then ``jitter`` (0 to 1) takes a random part
    of up to that fraction away, so ``jitter=1`` is "full jitter".
    All durations are in seconds.
    """

    kind: BackoffKind = "exponential"
    delay: float = 1.0
    max_delay: float = 300.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in ("exponential", "fixed"):
            raise InvalidJobError(f"backoff kind {self.kind!r} is unknown; use 'exponential' or 'fixed'")
        for field, value in (("delay", self.delay), ("max_delay", self.max_delay)):
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise InvalidJobError(
                    f"backoff {field} must be a finite number of seconds >= 0, got {value!r}"
                )
        if not isinstance(self.jitter, int | float) or not 0 <= self.jitter <= 1:
            raise InvalidJobError(f"backoff jitter must be between 0 and 1, got {self.jitter!r}")

    @classmethod
    def exponential(cls, delay: float = 1.0, max_delay: float = 300.0, jitter: float = 0.5) -> Backoff:
        return cls("exponential", delay, max_delay, jitter)

    @classmethod
    def fixed(cls, delay: float, jitter: float = 0.0) -> Backoff:
        return cls("fixed", delay, delay, jitter)

    def seconds(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """The delay before the retry that follows failed attempt number ``attempt``."""
        if self.kind == "fixed":
            base = self.delay
        else:
            base = min(self.max_delay, self.delay * 2.0 ** min(max(attempt - 1, 0), 60))
        return base * (1.0 - self.jitter * rand())

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> Backoff:
        raw: Any = orjson.loads(data)
        if not (isinstance(raw, list) and len(raw) == 4):
            raise ValueError(f"backoff must be a 4-item list, got {raw!r}")
        return cls(raw[0], float(raw[1]), float(raw[2]), float(raw[3]))


@functools.lru_cache(maxsize=256)
def _to_json(backoff: Backoff) -> bytes:
    """One encoding per distinct backoff (most jobs share one), written once, not once a job."""
    return dumps([backoff.kind, backoff.delay, backoff.max_delay, backoff.jitter])


DEFAULT_BACKOFF = Backoff()
