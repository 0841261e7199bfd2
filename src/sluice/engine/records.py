"""Reading job records: one, many in one round trip, or only a job's state.

A part of a queue (core.py): the producer's calls (queue.py) and the
operator's (admin.py) read records through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.engine.job import JobRecord, JobState
from sluice.engine.keys import check_job_id
from sluice.engine.transport import reads

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.core import QueueCore


class JobRecords:
    """The job records of one queue."""

    def __init__(self, core: QueueCore) -> None:
        self._keys = core.keys
        self._core = core

    @property
    def redis(self) -> Redis:
        return self._core.redis

    @reads
    async def get_job(self, job_id: str) -> JobRecord | None:
        """The parsed record of one job, or None if it does not exist (any more)."""
        check_job_id(job_id)
        raw: dict[bytes, bytes] = await self.redis.hgetall(self._keys.job(job_id))  # type: ignore[assignment]
        if not raw:
            return None
        return JobRecord.from_hash(job_id, raw, self._keys.idem_prefix)

    @reads
    async def get_jobs(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        """Many records in one round trip (a pipeline), in the order asked."""
        for job_id in job_ids:
            check_job_id(job_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self._keys.job(job_id))
            raws = await pipe.execute()
        return [
            JobRecord.from_hash(i, raw, self._keys.idem_prefix) if raw else None
            for i, raw in zip(job_ids, raws, strict=True)
        ]

    @reads
    async def job_state(self, job_id: str) -> JobState | None:
        """A job's state alone (None: no such job)."""
        check_job_id(job_id)
        raw: bytes | None = await self.redis.hget(self._keys.job(job_id), "state")  # type: ignore[assignment]
        return JobState(raw.decode()) if raw else None
