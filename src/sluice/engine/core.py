"""What the parts of one queue share, built once: its Redis client, keys, scripts and limits.

A :class:`~sluice.engine.queue.Queue` is a face over parts that each hold this
core and nothing of the queue itself: the token ledger (budgets.py), the
worker protocol (protocol.py), the operator's calls (admin.py), the shared
gates (flow.py), retention (retention.py) and the job records (records.py).
So no part imports another's face, and none imports the Queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio import Redis

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
    max_payload_bytes: int
    idempotency_ttl_ms: int
    events_maxlen: int
    event_result_max_bytes: int

    async def wake(self) -> None:
        """Put the wake marker back, so that idle workers come at once."""
        await self.redis.zadd(self.keys.wake, {"w": 0})
