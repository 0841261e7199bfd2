"""The goodput benchmark's client-side limiter: aiolimiter's leaky buckets, one pair per worker process.

This is what a careful user builds without a shared limiter: each of ``P``
worker processes keeps ``1/P`` of the provider's published limits (``N``
requests and ``T`` tokens per window ``W``) with the maintained
`aiolimiter <https://aiolimiter.readthedocs.io>`_ package, and no process
knows what the others send. The configuration is chosen so that the calls
one process *sends* never exceed its share in any window of ``W`` seconds,
hence all processes together never exceed the provider's limits at
dispatch; what the provider sees later (the way there varies) is what the
benchmark measures.

aiolimiter's ``AsyncLimiter(max_rate, time_period)`` is a leaky bucket
(``aiolimiter/leakybucket.py``): a level that drains at ``max_rate /
time_period`` per second, where ``acquire(amount)`` waits until ``level +
amount <= max_rate`` and then adds ``amount``. It is *not* a window of
``max_rate`` per ``time_period``: an empty bucket lets ``max_rate`` through at
once and then drains at the full rate, so in any interval of ``L`` seconds
up to ``max_rate + rate * L`` passes. ``AsyncLimiter(T / P, W)``, read as
its README reads ``AsyncLimiter(100, 30)`` ("at most 100 times in a 30
second period"), lets up to twice the share through in the first window,
and 429s follow. So:

* requests: ``AsyncLimiter(1, W / (N // P))``, as its docs' "Bursting"
  section says for no bursts: a bucket of one, so two calls are at least
  ``s = W / (N // P)`` apart, and any window of ``W`` holds at most
  ``N // P`` of them (the window is half-open, as the provider's is: a call
  exactly ``W`` later finds the first one gone);
* tokens: ``AsyncLimiter(C, C / r)``: a capacity ``C`` of the largest call's
  cost (``prompt + max_tokens``; a bucket cannot hold less than one call)
  and a drain rate ``r = (T / P - C) / (W + s)``, so that ``C + r (W + s)``,
  the most that passes in ``W + s`` seconds, is the share ``T / P``;
* both under one lock, tokens first, then the request slot, and the call
  is sent as soon as the slot is taken. The lock keeps the calls in order
  (aiolimiter wakes its waiters smallest amount first); the token bucket
  counted the call up to one request spacing ``s`` before it was sent, which
  is why its rate is set over ``W + s`` and not ``W``.

What the buckets cost: the token limit is used at ``P (T / P - C) / (T (1 +
s / W))``, e.g. 97.6 % with one process and 95.2 % with two at 100 requests
and 30,000 tokens per second with calls of at most 440 tokens; a window
with little traffic is not saved up beyond ``C``. A 429 (the way to the
provider varies) is retried with the job's backoff, as the retry-on-429
client does, and the retry takes its place in the buckets again.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sluice_lab.deps import require

if TYPE_CHECKING:
    from aiolimiter import AsyncLimiter


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """One process's share of the provider's published limits, and the largest call it sends."""

    requests: int
    tokens: int
    window: float
    processes: int
    #: prompt + max_tokens of the largest call: the token bucket's capacity
    max_cost: int

    def __post_init__(self) -> None:
        if self.processes < 1 or self.requests < self.processes:
            raise ValueError(
                f"{self.processes} processes cannot each keep a share of {self.requests} requests per window"
            )
        if self.tokens / self.processes <= self.max_cost:
            raise ValueError(
                f"a process's share of the token limit ({self.tokens / self.processes:g}) must exceed "
                f"the largest call ({self.max_cost} tokens)"
            )

    @property
    def spacing(self) -> float:
        """Seconds between two calls of one process: ``W / (N // P)``."""
        return self.window / (self.requests // self.processes)

    @property
    def token_rate(self) -> float:
        """Tokens per second the bucket drains: ``(T / P - C) / (W + s)``."""
        return (self.tokens / self.processes - self.max_cost) / (self.window + self.spacing)

    def settings(self) -> dict[str, Any]:
        """The two buckets as AsyncLimiter's arguments, and the share of the limits they allow."""
        return {
            "request_bucket": {"max_rate": 1, "time_period": self.spacing},
            "token_bucket": {"max_rate": self.max_cost, "time_period": self.max_cost / self.token_rate},
            "requests_pct_of_limit": round(
                100.0 * (self.requests // self.processes) * self.processes / self.requests, 2
            ),
            "tokens_pct_of_limit": round(
                100.0 * self.token_rate * self.window * self.processes / self.tokens, 2
            ),
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ClientLimits:
        return cls(**json.loads(text))


class ClientLimiter:
    """The two buckets of one process; :meth:`acquire` returns when a call of ``cost`` tokens may go."""

    def __init__(self, limits: ClientLimits) -> None:
        require("the goodput benchmark's aiolimiter variant", "aiolimiter")
        from aiolimiter import AsyncLimiter

        self.limits = limits
        buckets = limits.settings()
        self._requests: AsyncLimiter = AsyncLimiter(**buckets["request_bucket"])
        self._tokens: AsyncLimiter = AsyncLimiter(**buckets["token_bucket"])
        self._lock = asyncio.Lock()

    async def acquire(self, cost: int) -> None:
        """Wait for ``cost`` tokens, then for a request slot; the caller sends at once."""
        async with self._lock:
            await self._tokens.acquire(cost)
            await self._requests.acquire()
