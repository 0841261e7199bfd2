"""What the parts of one queue share, built once: its Redis client, keys, scripts and limits.

A :class:`~sluice.engine.queue.Queue` is a face over parts that each hold this
core and nothing of the queue itself: the token ledger (budgets.py), the
worker protocol (protocol.py), the operator's calls (admin.py), the shared
gates (flow.py), retention (retention.py) and the job records (records.py).
So no part imports another's face, and none imports the Queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.engine.clock import fixed_now

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.commands import Call, Commands
    from sluice.engine.keys import QueueKeys
    from sluice.engine.scripts import Scripts


@dataclass(frozen=True, slots=True, eq=False)
class QueueCore:
    """One queue's client, keys, scripts and limits (see :class:`~sluice.engine.queue.Queue`)."""

    name: str
    prefix: str
    keys: QueueKeys
    #: a client the queue uses (a RedisCluster comes wrapped: see connection.adopt)
    redis: Redis
    scripts: Scripts
    #: every script call's KEYS and ARGV (see sluice.engine.commands)
    commands: Commands
    max_payload_bytes: int
    idempotency_ttl_ms: int
    events_maxlen: int
    event_result_max_bytes: int

    async def run(self, call: Call) -> Any:
        """Send one script call on the queue's client; returns the script's reply."""
        return await self.scripts.run(call)

    async def now_ms(self) -> int:
        """Redis's clock on the queue's server, in ms (the test clock if one is set)."""
        fixed = fixed_now()
        return fixed if fixed is not None else int(await self.run(self.commands.now()))

    async def wake(self) -> None:
        """Put the wake marker back, so that idle workers come at once."""
        await self.redis.zadd(self.keys.wake, {"w": 0})
