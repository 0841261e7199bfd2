"""Flow controls shared by every worker of a queue: the gates of the dispatch script.

They are plain fields of the queue's ``control`` hash, read by the dispatch
script on every call, so a change reaches every worker on every machine at
its next dispatch. Whatever reopens a gate (resume, a raised limit) puts the
wake marker back so idle workers come at once; a gate that opens with time
(a rate window, a throttle) tells each refused worker when to come back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.engine.budgets import TOKEN_RATE_BUDGET, Budgets, BudgetState
from sluice.engine.clock import queue_now_ms
from sluice.engine.job import MAX_TOKENS
from sluice.engine.transport import reads, writes
from sluice.errors import ConfigurationError

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.keys import QueueKeys
    from sluice.engine.scripts import Scripts


@dataclass(frozen=True, slots=True)
class FlowState:
    """The queue's flow controls and how full their windows are now."""

    paused: bool
    #: Unix ms until which a provider throttle holds dispatch (None: not throttled)
    throttled_until_ms: int | None
    concurrency: int | None
    active: int
    rate_max: int | None
    rate_per_seconds: float | None
    starts_in_window: int
    token_limit: int | None
    token_per_seconds: float | None
    tokens_in_window: int


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{what} must be an integer >= 1 (or None to remove the limit), got {value!r}"
        )
    return value


def _window_ms(per: object) -> int:
    if isinstance(per, bool) or not isinstance(per, int | float) or not math.isfinite(per):
        raise ConfigurationError(f"per must be a number of seconds, got {per!r}")
    if not 0.001 <= per <= 86_400:
        raise ConfigurationError(f"per must be from 0.001 to 86400 seconds, got {per!r}")
    return max(1, round(per * 1000))


class FlowControl:
    """Queue methods that set the shared gates (mixed into :class:`Queue`)."""

    redis: Redis
    keys: QueueKeys
    budgets: Budgets
    scripts: Scripts

    async def _wake(self) -> None:
        await self.redis.zadd(self.keys.wake, {"w": 0})

    @writes
    async def set_global_concurrency(self, limit: int | None) -> None:
        """At most ``limit`` jobs of this queue run at once, over all workers (None: no limit).

        Each worker's own ``concurrency`` still applies beside it.
        """
        if limit is None:
            await self.redis.hdel(self.keys.control, "concurrency")
        else:
            await self.redis.hset(
                self.keys.control, "concurrency", _positive_int("global concurrency", limit)
            )
        await self._wake()

    @writes
    async def set_rate_limit(self, max_starts: int | None, per: float = 1.0) -> None:
        """At most ``max_starts`` job starts in any ``per`` seconds, over all workers.

        A sliding window: every ``max_starts + 1`` consecutive starts span at
        least ``per`` seconds. None removes the limit.
        """
        if max_starts is None:
            await self.redis.hdel(self.keys.control, "rate_max", "rate_ms")
        else:
            await self.redis.hset(
                self.keys.control,
                mapping={"rate_max": _positive_int("max_starts", max_starts), "rate_ms": _window_ms(per)},
            )
        await self._wake()

    @writes
    async def set_token_rate_limit(self, tokens: int | None, per: float = 60.0) -> None:
        """At most ``tokens`` estimated tokens dispatched in any ``per`` seconds.

        Jobs reserve their ``tokens`` estimate when dispatched; the usage the
        handler reports replaces it at completion, so the window holds what
        was really used as soon as it is known. None removes the limit.
        """
        k = self.keys
        if tokens is None:
            await self.redis.hdel(k.control, "tpm")
            await self._wake()
            return
        limit = _positive_int("tokens", tokens)
        if limit > MAX_TOKENS:
            raise ConfigurationError(f"tokens must be at most {MAX_TOKENS}, got {tokens!r}")
        win_ms = _window_ms(per)
        if win_ms < 1000:
            raise ConfigurationError(f"a token-rate window must be at least 1 second, got {per!r}")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                k.budget_prefix + TOKEN_RATE_BUDGET,
                mapping={"limit": limit, "win": "roll", "win_ms": win_ms},
            )
            pipe.hsetnx(k.budget_prefix + TOKEN_RATE_BUDGET, "used", 0)
            pipe.hset(k.control, "tpm", 1)
            pipe.zadd(k.wake, {"w": 0})
            await pipe.execute()

    @writes
    async def pause(self) -> None:
        """Dispatch nothing until :meth:`resume`; running jobs go on."""
        await self.redis.hset(self.keys.control, "paused", 1)

    @writes
    async def resume(self) -> None:
        """Undo :meth:`pause`; idle workers wake at once."""
        await self.redis.hdel(self.keys.control, "paused")
        await self._wake()

    @writes
    async def throttle(self, seconds: float) -> None:
        """Dispatch nothing for ``seconds`` from now (Redis's clock); 0 lifts the throttle.

        Unlike a handler's ``Throttled``, which only ever extends the pause,
        this replaces it: an operator may shorten or lift it.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= 86_400:
            raise ConfigurationError(f"seconds must be from 0 to 86400, got {seconds!r}")
        if seconds == 0:
            await self.redis.hdel(self.keys.control, "throttled_until")
            await self._wake()
        else:
            until = await queue_now_ms(self) + round(seconds * 1000)
            await self.redis.hset(self.keys.control, "throttled_until", until)

    @reads
    async def flow(self, *, now: int | None = None) -> FlowState:
        """The flow controls as set, and how full their windows are now."""
        k = self.keys
        t = now if now is not None else await queue_now_ms(self)
        raw: dict[bytes, bytes] = await self.redis.hgetall(k.control)  # type: ignore[assignment]
        c = {key.decode(): value.decode() for key, value in raw.items()}
        rate_ms = int(c["rate_ms"]) if "rate_ms" in c else None
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(k.active)
            pipe.zcount(k.starts, f"({t - rate_ms}" if rate_ms else "-inf", "+inf")
            active, starts = await pipe.execute()
        tpm: BudgetState | None = None
        if c.get("tpm") == "1":
            (tpm,) = await self.budgets.get_many([TOKEN_RATE_BUDGET], now=t)
        until = int(c["throttled_until"]) if "throttled_until" in c else 0
        return FlowState(
            paused=c.get("paused") == "1",
            throttled_until_ms=until if until > t else None,
            concurrency=int(c["concurrency"]) if "concurrency" in c else None,
            active=int(active),
            rate_max=int(c["rate_max"]) if "rate_max" in c else None,
            rate_per_seconds=rate_ms / 1000 if rate_ms else None,
            starts_in_window=int(starts) if rate_ms else 0,
            token_limit=tpm.limit if tpm else None,
            token_per_seconds=tpm.window_seconds if tpm else None,
            tokens_in_window=tpm.used if tpm else 0,
        )
