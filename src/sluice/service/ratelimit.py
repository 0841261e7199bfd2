"""A request rate limit per API key, shared by every API process through Redis.

The limit is a GCRA (generic cell rate algorithm): one Redis key per API key
holds the "theoretical arrival time" of the next request, and one script call
per request moves it on or refuses. It keeps a steady rate with a burst
allowance, uses one small string per key (no list of timestamps), and its
work is constant, whatever the rate. The script reads Redis's clock, so API
processes on machines whose clocks disagree still share one limit.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.errors import RedisUnavailable

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

log = logging.getLogger("sluice.service")
#: An outage is logged at most once this often (seconds).
_QUIET = 30.0
#: Replies of a Redis that cannot serve now (a replica after failover, out of memory, busy).
_UNAVAILABLE = ("READONLY", "OOM", "BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN")

# KEYS[1]: the key's arrival-time record. ARGV[1]: microseconds between requests at the
# steady rate; ARGV[2]: the burst (requests that may come at once).
# Returns {allowed (1/0), retry after (us), remaining burst}.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tolerance = interval * tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local next_tat = tat + interval
local allowed_from = next_tat - tolerance
if allowed_from > now then
  return {0, math.ceil(allowed_from - now), 0}
end
redis.call('SET', KEYS[1], string.format('%.0f', next_tat), 'PX', math.ceil((next_tat - now) / 1000) + 1000)
return {1, 0, math.floor((now - allowed_from) / interval)}
"""


@dataclass(frozen=True, slots=True)
class Verdict:
    """One request's answer: whether it may go on, when to come back if not (seconds,
    rounded up), and how many more requests the burst allows now."""

    allowed: bool
    retry_after: int
    remaining: int


class RateLimiter:
    """``rate`` requests per second per key, with ``burst`` at once (0 rate: no limit)."""

    def __init__(self, redis: Redis, prefix: str, *, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = max(burst, 1)
        self._prefix = f"{prefix}:ratelimit:"
        self._script: AsyncScript | None = redis.register_script(_GCRA) if rate > 0 else None
        self._interval_us = math.ceil(1_000_000 / rate) if rate > 0 else 0
        self._warned = -_QUIET

    @property
    def enabled(self) -> bool:
        return self._script is not None

    async def check(self, who: str) -> Verdict:
        """Count one request of ``who`` (a key's digest) against its limit.

        Without Redis the request is let through (and the outage logged, once per
        ``_QUIET`` seconds): the limit protects the service, and a submission it
        would block can still be stored, to be enqueued when Redis is back.
        """
        if self._script is None:
            return Verdict(True, 0, self.burst)
        try:
            allowed, wait_us, remaining = await self._script(
                keys=[self._prefix + who], args=[self._interval_us, self.burst]
            )
        except (RedisConnectionError, RedisTimeoutError, OSError, RedisUnavailable, ResponseError) as exc:
            if isinstance(exc, ResponseError) and not str(exc).startswith(_UNAVAILABLE):
                raise
            now = time.monotonic()
            if now - self._warned > _QUIET:
                self._warned = now
                log.warning("rate limit: Redis is unavailable (%s); requests are not limited", exc)
            return Verdict(True, 0, self.burst)
        return Verdict(bool(allowed), math.ceil(int(wait_us) / 1_000_000), int(remaining))
