"""Accepting a job: checked, written to the store, then enqueued.

The order is the guarantee. The engine checks the job first (a job it would
refuse is never stored); the store's row is written next, so the job exists
once the API answers 201; the engine gets it last, under the idempotency key
``job:<uuid>``, so enqueueing it again (the reconciler, after a crash between
the two writes or after Redis lost its data) never makes two.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sluice.engine.backoff import Backoff
from sluice.engine.codec import encode_limited
from sluice.engine.job import JobSpec
from sluice.errors import BudgetNotFound, RedisUnavailable
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
    )


def backoff_json(backoff: Backoff) -> list[Any]:
    return [backoff.kind, backoff.delay, backoff.max_delay, backoff.jitter]


async def enqueue(queue: Queue, job: StoredJob) -> str:
    """Hand a stored job to the engine; returns the engine's id (the same one if it was
    enqueued before)."""
    spec = spec_of(job)
    added = await queue.add(
        spec.name,
        spec.payload,
        priority=spec.priority,
        delay=spec.delay,
        max_attempts=spec.max_attempts,
        backoff=spec.backoff,
        idempotency_key=engine_key(job.id),
        tokens=spec.tokens,
        budget=spec.budget,
        correlation_id=job.correlation_id,
    )
    return added.id


async def submit(
    queue: Queue, store: JobStore, new: NewJob, ledger: BudgetLedger | None = None
) -> tuple[StoredJob, bool]:
    """Store then enqueue one job; returns it and whether this call created it.

    A job whose budget does not exist is refused before anything is written;
    one that Redis lost but the store has a copy of is rebuilt first (``ledger``).
    If Redis is down after the row is written, the job stays QUEUED in the
    store and the reconciler enqueues it when Redis is back: the answer is
    still 201, because the job is kept.
    """
    spec_of(new)  # the engine's checks, before anything is written
    encode_limited(new.payload, queue.max_payload_bytes)  # a payload the queue would refuse
    if new.budget is not None:
        found = (await queue.budgets.get_many([new.budget]))[0]
        if found is None and ledger is not None and new.budget in await ledger.restore_missing():
            found = (await queue.budgets.get_many([new.budget]))[0]
        if found is None:
            raise BudgetNotFound(new.budget)
        if ledger is not None:
            await ledger.remember(new.budget)
    stored, created = await store.create(new)
    if created:
        try:
            await enqueue(queue, stored)
        except RedisUnavailable as exc:
            log.warning(
                "job %s is stored but not enqueued (%s); the reconciler enqueues it when Redis is back",
                stored.id,
                exc,
                extra={"job_id": str(stored.id)},
            )
    return stored, created
