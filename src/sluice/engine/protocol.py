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

from sluice.engine.clock import script_now as _clock
from sluice.engine.transport import writes
from sluice.engine.wireformat import LEASED_FIELDS

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.core import QueueCore

#: One finished attempt as the worker reports it: (job id, token, kind (a
#: wireformat.Kind), value, retry in ms from now (kind FAILED), tokens used or -1).
Outcome = tuple[str, bytes, bytes, bytes, int, int]

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
        as flat groups of LEASED_FIELDS values (engine/wireformat.py). See :meth:`step_command`
        for ``request_id``.
        """
        keys, args = self.step_command(
            now=now,
            want=want,
            lease_ms=lease_ms,
            worker_id=worker_id,
            outcomes=outcomes,
            request_id=request_id,
        )
        return StepReply.parse(await self._core.scripts.dispatch(keys=keys, args=args))

    def step_command(
        self,
        *,
        now: int | None = None,
        want: int,
        lease_ms: int,
        worker_id: str,
        outcomes: Sequence[Outcome] = (),
        request_id: str = "",
    ) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV of one dispatch call, for callers that send it themselves.

        The worker's pump does: it owns a connection of its own for this one
        script (see pump.py), and parses the answer with :meth:`StepReply.parse`.
        ``request_id`` (unique per call of this worker) makes the call safe to
        send again when its reply was lost: sent again with the same id, it is
        answered from what it did the first time instead of being run twice.
        """
        k = self.keys
        q = self._core
        keys = [k.waiting, k.delayed, k.active, k.events, k.stats, k.wake, k.job_prefix, k.dead, *k.flow]
        keys += (k.calls, k.epoch, k.retention, k.finished_prefix)
        args: list[Any] = [
            _clock(now),
            want,
            lease_ms,
            worker_id,
            q.events_maxlen,
            q.event_result_max_bytes,
            len(outcomes),
            request_id,
        ]
        job_prefix = k.job_prefix
        for outcome in outcomes:
            if len(outcome) != 6:
                raise ValueError(
                    f"an outcome is (job id, token, kind, value, retry in ms, tokens used), got {outcome!r}"
                )
            keys.append(job_prefix + outcome[0])
            args += outcome
        return keys, args

    @writes
    async def extend(
        self, *, now: int | None = None, lease_ms: int, leases: Sequence[tuple[str, bytes]]
    ) -> list[int]:
        """Renew leases; per job 1 renewed, 2 renewed but cancel requested, 0 lost, -1 gone."""
        if not leases:
            return []
        keys = [self.keys.active, *(self.keys.job(job_id) for job_id, _ in leases)]
        args: list[Any] = [_clock(now), lease_ms]
        for job_id, token in leases:
            args += (job_id, token)
        return list(await self._core.scripts.extend(keys=keys, args=args))

    @writes
    async def reap(self, *, now: int | None = None, limit: int = 200) -> tuple[int, int]:
        """Return expired leases to waiting (or dead); returns (returned, dead-lettered)."""
        k = self.keys
        q = self._core
        back, dead = await q.scripts.reap(
            keys=[
                k.active,
                k.waiting,
                k.dead,
                k.events,
                k.stats,
                k.wake,
                k.job_prefix,
                *k.flow,
                k.retention,
                k.finished_prefix,
            ],
            args=[_clock(now), limit, q.events_maxlen],
        )
        return int(back), int(dead)

    @writes
    async def trim(self, *, now: int | None = None, limit: int = 200) -> tuple[int, bool]:
        """Forget up to ``limit`` finished jobs past the queue's retention, oldest first;
        returns (jobs forgotten, whether more are due)."""
        k = self.keys
        forgotten, more = await self._core.scripts.trim(
            keys=[k.retention, k.finished_prefix, k.dead, k.job_prefix, k.reservation_prefix],
            args=[_clock(now), limit],
        )
        return int(forgotten), bool(more)
