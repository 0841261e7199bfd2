"""The worker protocol: what a worker says to a queue, and what the queue answers.

Three calls, each one Lua script: :meth:`WorkerProtocol.step` (hand in the
outcomes finished since the last call, promote due jobs, lease as many new
ones as there are free slots), :meth:`~WorkerProtocol.extend` (renew the
leases of running jobs) and :meth:`~WorkerProtocol.reap` (return jobs whose
lease expired). The worker (pump.py, upkeep.py) is their user; tests that drive time
call them with ``now`` in hand; everyone else leaves ``now`` out, and the
scripts read Redis's clock (see lua/includes/clock.lua). Producers never need them, which is why they
live on ``queue.protocol`` and not on the :class:`~sluice.engine.queue.Queue`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from sluice.engine.commands import Outcome
from sluice.engine.transport import writes
from sluice.engine.wireformat import LEASED_FIELDS

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.core import QueueCore

__all__ = ["LEASED_FIELDS", "Outcome", "StepReply", "WorkerProtocol"]


class StepReply(NamedTuple):
    """What one dispatch step answered."""

    codes: list[int]
    #: when something may next become runnable, on Redis's clock (ms), or -1
    next_due: int
    #: the script's "now" (Redis's clock unless a test passed one)
    now: int
    #: the queue's epoch: random, made anew if Redis lost its data (see JobContext.idempotency_key)
    epoch: str
    jobs: list[Any]

    @classmethod
    def parse(cls, reply: list[Any]) -> StepReply:
        """Split the dispatch script's flat reply: {n, codes..., next_due, now, epoch, jobs...}."""
        n = reply[0]
        epoch = reply[3 + n]
        return cls(
            reply[1 : 1 + n],
            reply[1 + n],
            reply[2 + n],
            epoch.decode() if isinstance(epoch, bytes) else str(epoch),
            reply[4 + n :],
        )


class WorkerProtocol:
    """The worker's side of one queue: ``queue.protocol``."""

    def __init__(self, core: QueueCore) -> None:
        self._core = core
        self.keys = core.keys

    @property
    def redis(self) -> Redis:
        return self._core.redis

    @writes
    async def step(
        self,
        *,
        now: int | None = None,
        want: int,
        lease_ms: int,
        worker_id: str,
        outcomes: Sequence[Outcome] = (),
        request_id: str = "",
    ) -> StepReply:
        """Record ``outcomes`` (fenced by token), promote due jobs, lease up to ``want``.

        An outcome is ``(job_id, token, kind, value, retry_in_ms, tokens_used)``
        and kind a :class:`~sluice.engine.wireformat.Kind` (a THROTTLED value: retry
        after, ms); ``retry_in_ms`` is how long a FAILED retry waits (from the script's
        now), and tokens_used -1 when not reported (see lua/includes/finish.lua). Returns the
        per-outcome codes, the next due time (ms on Redis's clock, or -1) and the leased jobs
        as flat groups of LEASED_FIELDS values (engine/wireformat.py).

        ``request_id`` (unique per call of this worker) makes the call safe to send again
        when its reply was lost: sent again with the same id, it is answered from what it
        did the first time instead of being run twice. The worker's pump sends this call on
        a connection of its own (``core.commands.dispatch``, see pump.py).
        """
        call = self._core.commands.dispatch(
            now=now,
            want=want,
            lease_ms=lease_ms,
            worker_id=worker_id,
            outcomes=outcomes,
            request_id=request_id,
        )
        return StepReply.parse(await self._core.run(call))

    @writes
    async def extend(
        self, *, now: int | None = None, lease_ms: int, leases: Sequence[tuple[str, bytes]]
    ) -> list[int]:
        """Renew leases; per job 1 renewed, 2 renewed but cancel requested, 0 lost, -1 gone."""
        if not leases:
            return []
        return list(
            await self._core.run(self._core.commands.extend(now=now, lease_ms=lease_ms, leases=leases))
        )

    @writes
    async def reap(self, *, now: int | None = None, limit: int = 200) -> tuple[int, int]:
        """Return expired leases to waiting (or dead); returns (returned, dead-lettered)."""
        back, dead = await self._core.run(self._core.commands.reap(now=now, limit=limit))
        return int(back), int(dead)

    @writes
    async def trim(self, *, now: int | None = None, limit: int = 200) -> tuple[int, bool]:
        """Forget up to ``limit`` finished jobs past the queue's retention, oldest first;
        returns (jobs forgotten, whether more are due)."""
        forgotten, more = await self._core.run(self._core.commands.trim(now=now, limit=limit))
        return int(forgotten), bool(more)
