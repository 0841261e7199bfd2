"""Accepting a job: checked, written to the store, then enqueued.

The order is the guarantee. The engine checks the job first (a job it would
refuse is never stored); the store's row is written next, so the job exists
once the API answers 201; the engine gets it last, under the idempotency key
``job:<uuid>``, so enqueueing it again (the reconciler, after a crash between
the two writes or after Redis lost its data) never makes two.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from sluice.engine.backoff import Backoff
from sluice.engine.codec import encode_limited
from sluice.engine.job import JobSpec
from sluice.errors import BudgetNotFound, RedisUnavailable, SluiceError
from sluice.store.jobs import NewJob, StoredJob
from sluice.store.sink import engine_key

if TYPE_CHECKING:
    from sluice.engine.queue import Queue
    from sluice.store.jobs import JobStore
    from sluice.store.ledger import BudgetLedger

log = logging.getLogger("sluice.service")

#: Retries of jobs made through the NestJS routes wait 1000 * 2^attempt ms, as that design does.
NEST_BACKOFF = Backoff("exponential", 2.0, 86_400.0, 0.0)


def spec_of(job: StoredJob | NewJob) -> JobSpec:
    """The engine's job for a stored one (its checks run here)."""
    kind, delay, max_delay, jitter = job.backoff
    return JobSpec(
        job.type,
        job.payload,
        priority=job.priority,
        delay=job.delay_ms / 1000,
        max_attempts=job.max_attempts,
        backoff=Backoff(kind, delay, max_delay, jitter),
        tokens=job.tokens,
        budget=job.budget,
        correlation_id=job.correlation_id,
    )


def backoff_json(backoff: Backoff) -> list[Any]:
    return [backoff.kind, backoff.delay, backoff.max_delay, backoff.jitter]


def engine_spec(job: StoredJob) -> JobSpec:
    """The engine's job for a stored one, under its engine idempotency key."""
    return dataclasses.replace(spec_of(job), idempotency_key=engine_key(job.id))


async def enqueue(queue: Queue, job: StoredJob) -> str:
    """Hand a stored job to the engine; returns the engine's id (the same one if it was
    enqueued before)."""
    (added,) = await queue.add_bulk([engine_spec(job)])
    return added.id


class Intake:
    """Accepts jobs: each is checked alone, and the ones that arrive together are written
    together: one INSERT for all of them, then one add to the engine.

    The batches form by themselves: the first submission starts a write at
    once; those arriving while it runs wait for the next, which takes all of
    them (up to ``max_batch``). An idle service answers one job as fast as
    before, and a busy one pays one round trip to PostgreSQL and one to Redis
    per batch rather than per job, so that the API keeps up with submissions
    instead of queueing them. If Redis is down after the rows are written, the
    jobs stay QUEUED in the store and the reconciler enqueues them when Redis
    is back: the answer is still 201, because they are kept.
    """

    def __init__(
        self, queue: Queue, store: JobStore, ledger: BudgetLedger | None = None, *, max_batch: int = 500
    ) -> None:
        self.queue = queue
        self.store = store
        self.ledger = ledger
        self.max_batch = max_batch
        self._pending: list[tuple[NewJob, asyncio.Future[tuple[StoredJob, bool]]]] = []
        self._writer: asyncio.Task[None] | None = None
        #: batches written, and the jobs in them (for tests and metrics)
        self.batches = 0
        self.jobs = 0

    async def submit(self, new: NewJob) -> tuple[StoredJob, bool]:
        """Store then enqueue one job; returns it and whether this call created it.

        A job whose budget does not exist is refused before anything is written;
        one that Redis lost but the store has a copy of is rebuilt first.
        """
        await self.check(new)
        done: asyncio.Future[tuple[StoredJob, bool]] = asyncio.get_running_loop().create_future()
        self._pending.append((new, done))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_all(), name="sluice-intake")
        return await done

    async def check(self, new: NewJob) -> None:
        """What the engine would refuse, refused before anything is stored."""
        spec_of(new)
        encode_limited(new.payload, self.queue.max_payload_bytes)
        if new.budget is not None:
            ledger = self.ledger
            found = (await self.queue.budgets.get_many([new.budget]))[0]
            if found is None and ledger is not None and new.budget in await ledger.restore_missing():
                found = (await self.queue.budgets.get_many([new.budget]))[0]
            if found is None:
                raise BudgetNotFound(new.budget)
            if ledger is not None:
                await ledger.remember(new.budget)

    async def _write_all(self) -> None:
        """Batches until none is waiting, on one connection (a fresh one after a failure)."""
        try:
            while self._pending:
                try:
                    async with self.store.connection() as conn:
                        while self._pending and await self._write_next(conn):
                            pass
                except Exception as exc:  # noqa: BLE001 - no connection: the batch answers it
                    self._fail(self._take(), exc)
        finally:
            self._writer = None

    def _take(self) -> list[tuple[NewJob, asyncio.Future[tuple[StoredJob, bool]]]]:
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        return batch

    @staticmethod
    def _fail(batch: list[tuple[NewJob, asyncio.Future[tuple[StoredJob, bool]]]], exc: Exception) -> None:
        for _, done in batch:
            if not done.done():
                done.set_exception(exc)

    async def _write_next(self, conn: Any) -> bool:
        """One batch; False when it failed (the connection may be broken)."""
        batch = self._take()
        try:
            results = await self._write([new for new, _ in batch], conn)
        except Exception as exc:  # noqa: BLE001 - each waiting request answers it
            self._fail(batch, exc)
            return False
        for (_, done), result in zip(batch, results, strict=True):
            if not done.done():
                done.set_result(result)
        return True

    async def _write(self, news: list[NewJob], conn: Any) -> list[tuple[StoredJob, bool]]:
        results = await self.store.create_many(news, conn=conn)
        self.batches += 1
        self.jobs += len(news)
        created = [stored for stored, new in results if new]
        if created:
            try:
                await self.queue.add_bulk([engine_spec(job) for job in created])
            except (RedisUnavailable, SluiceError) as exc:
                log.warning(
                    "%d job(s) are stored but not enqueued (%s); the reconciler enqueues them when "
                    "Redis is back",
                    len(created),
                    exc,
                    extra={"job_ids": [str(j.id) for j in created]},
                )
        return results
