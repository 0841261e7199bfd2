"""The reconciler: the store and Redis brought back into agreement.

The store is the source of truth for which jobs exist. Two things can leave
a job the store holds as unfinished unknown to Redis: a crash of the API
between writing the row and enqueueing it, and a Redis that lost its data
(restarted without persistence, flushed, failed over to an empty replica).
Each pass pages through the unfinished jobs not updated for ``grace`` seconds
and looks each up in Redis by its id, which the engine shares:

* the engine holds it: nothing to do, or, if the engine has finished it and
  the store missed the events (the stream was trimmed past them), the store
  takes the engine's final state;
* the engine does not: it is enqueued again, under its id and the same engine
  idempotency key, so a racing API cannot make two. Delivery is at least
  once: a job whose run Redis forgot may run again.

A job an earlier version enqueued under a number of its own is looked up by
that number while the store keeps it (``JobStore.legacy_engine_ids``).

Budgets Redis lost are rebuilt from the store's copy first (``ledger.py``):
the engine refuses a job that names a budget it does not know.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import update

from sluice.errors import BudgetNotFound, InvalidJobError
from sluice.store.schema import JobStateRow
from sluice.store.sink import sink_horizon

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from sluice.engine.job import JobRecord
    from sluice.engine.queue import Queue
    from sluice.store.job import JobRef, StoredJob
    from sluice.store.jobs import JobStore
    from sluice.store.ledger import BudgetLedger

log = logging.getLogger("sluice.store.reconcile")

#: Store status of an engine state that is final.
FINAL_STATUS = {
    "completed": "COMPLETED",
    "dead": "DEAD_LETTER",
    "cancelled": "CANCELLED",
    "rejected": "REJECTED",
    "exhausted": "EXHAUSTED",
}
PAGE = 500


@dataclass
class Pass:
    """What one pass did."""

    looked: int = 0
    enqueued: int = 0
    finished: int = 0
    rejected: int = 0


class Reconciler:
    """``run()`` every ``interval`` seconds until stopped; ``reconcile()`` once (tests)."""

    def __init__(
        self,
        queue: Queue,
        store: JobStore,
        enqueue: Callable[[Queue, StoredJob], Awaitable[str]],
        *,
        grace: float = 30.0,
        interval: float = 10.0,
        ledger: BudgetLedger | None = None,
        lead: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.queue = queue
        self.ledger = ledger
        #: passes run only while this returns True (the process whose sink leads: one
        #: reconciler at a time, as one sink); None: always
        self.lead = lead
        self.store = store
        self.enqueue = enqueue
        self.grace = grace
        self.interval = interval
        self._epoch: bytes | None = None
        self._cursor: tuple[datetime, uuid.UUID] | None = None
        #: how far the unseen jobs were checked (they are the newest; each is checked once)
        self._unseen: tuple[datetime, uuid.UUID] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                done = await self.reconcile() if self.lead is None or await self.lead() else Pass()
                if done.enqueued or done.finished:
                    log.warning(
                        "reconciler: %d jobs enqueued again (Redis did not know them), %d finished from "
                        "the engine's records (their events were missed)",
                        done.enqueued,
                        done.finished,
                        extra={"enqueued": done.enqueued, "finished": done.finished},
                    )
            except asyncio.CancelledError:
                raise
            except Exception:  # an outage of either server: the next pass tries again
                log.exception("reconciler: a pass failed; the next one tries again")
            try:
                async with asyncio.timeout(self.interval):
                    await stop.wait()
            except TimeoutError:
                pass

    async def reconcile(self, *, now: datetime | None = None, full: bool = False) -> Pass:
        """One pass: the jobs no event has named yet (never enqueued, or the sink is behind),
        then a page of the rest, continuing where the last pass stopped; every page of the rest
        when Redis's epoch changed (it lost its data) or ``full``."""
        now = now or datetime.now(UTC)
        older_than = now - timedelta(seconds=self.grace)
        done = Pass()
        if self.ledger is not None:
            # Budgets first: the engine refuses a job whose budget it does not know.
            await self.ledger.restore_missing()
        # Each unseen job once, past the grace, from where the last pass stopped. A row passed
        # by because it was committed after that pass, more than a grace after its time was
        # taken, is left to the sweep of the rest below.
        self._unseen = await self._unseen_sweep(done, self._unseen, older_than)
        epoch: Any = await self.queue.redis.get(self.queue.keys.epoch)
        if full or (self._epoch is not None and epoch != self._epoch):
            self._cursor = self._unseen = None
            await self._sweep(done, older_than, unseen_only=False, pages=None)
        else:
            self._cursor = await self._sweep(done, older_than, unseen_only=False, pages=1, after=self._cursor)
        self._epoch = epoch
        return done

    async def _unseen_sweep(
        self,
        done: Pass,
        last: tuple[datetime, uuid.UUID] | None,
        older_than: datetime,
    ) -> tuple[datetime, uuid.UUID] | None:
        checked = await self._sweep(done, older_than, unseen_only=True, pages=None, after=last, wrap=False)
        return checked if checked is not None and (last is None or checked > last) else last

    async def _sweep(
        self,
        done: Pass,
        older_than: datetime,
        *,
        unseen_only: bool,
        pages: int | None,
        after: tuple[datetime, uuid.UUID] | None = None,
        wrap: bool = True,
    ) -> tuple[datetime, uuid.UUID] | None:
        """Pages of unfinished jobs checked against Redis; returns where to go on (at the end:
        None, to start again, or with ``wrap=False`` the last job checked)."""
        # A job the engine finished but the store did not is finished here only if its last
        # event is behind the sink's horizon: handed to the sink, or trimmed from the stream
        # unread (lost). One the sink has still to read is the sink's to write.
        horizon = await sink_horizon(self.queue)
        while pages is None or pages > 0:
            jobs = await self.store.unfinished(
                self.queue.name, older_than=older_than, after=after, limit=PAGE, unseen_only=unseen_only
            )
            if not jobs:
                return None if wrap else after
            done.looked += len(jobs)
            await self._check(done, jobs, horizon)
            after = (jobs[-1].updated_at, jobs[-1].id)
            if pages is not None:
                pages -= 1
        return after

    async def _check(self, done: Pass, jobs: list[JobRef], horizon: int | None) -> None:
        """A page of jobs against the engine's records: finished from them, or enqueued again."""
        engine_ids = {j.id: str(j.id) for j in jobs}
        views = await self._engine_views(list(engine_ids.values()))
        missing = [j.id for j, view in zip(jobs, views, strict=True) if view[0] is None]
        legacy = await self.store.legacy_engine_ids(missing)
        if legacy:
            engine_ids.update(legacy)
            views = await self._engine_views(list(engine_ids.values()))
        for job, (state, finished_ms) in zip(jobs, views, strict=True):
            engine_id = engine_ids[job.id]
            if state is not None:  # the engine holds it
                behind = horizon is None or (finished_ms is not None and finished_ms < horizon)
                if state in FINAL_STATUS and behind:
                    record = await self.queue.get_job(engine_id)
                    if record is not None and await self._finish_from(job, record):
                        done.finished += 1
                continue
            whole = await self.store.get(job.id)
            if whole is None:  # deleted meanwhile
                continue
            try:
                await self.enqueue(self.queue, whole)
            except (InvalidJobError, BudgetNotFound) as exc:
                # A row the engine will never take (stored by an older version that checked
                # less, or naming a budget that neither Redis nor the store's copy knows):
                # it ends REJECTED, saying why, rather than stop every pass here.
                await self._reject(job, str(exc))
                done.rejected += 1
                continue
            if job.id in legacy:
                await self.store.forget_legacy_ids([job.id])
            await self._mark_enqueued(job)
            done.enqueued += 1

    async def _engine_views(self, engine_ids: list[str]) -> list[tuple[str | None, int | None]]:
        """Each job's state and finish time (ms), as the engine has them ((None, None): no
        such job): two fields, not the whole record."""
        if not engine_ids:
            return []
        keys = self.queue.keys
        async with self.queue.redis.pipeline(transaction=False) as pipe:
            for engine_id in engine_ids:
                pipe.hmget(keys.job(engine_id), "state", "finished")
            replies: list[list[bytes | None]] = await pipe.execute()
        return [(_text(state), int(fin) if fin and fin.isdigit() else None) for state, fin in replies]

    async def _finish_from(self, job: JobRef, record: JobRecord) -> bool:
        status = FINAL_STATUS.get(record.state.value)
        if status is None:
            return False
        values = {"status": status, "attempts": record.attempt, "updated_at": datetime.now(UTC)}
        if status == "COMPLETED":
            values["result"] = record.result
            if record.finished_ms is not None:
                values["completed_at"] = datetime.fromtimestamp(record.finished_ms / 1000, UTC)
        if record.error is not None:
            values["error"] = record.error
        async with self.store.db.sessions() as session, session.begin():
            await session.execute(update(JobStateRow).where(JobStateRow.id == job.id).values(**values))
        return True

    async def _reject(self, job: JobRef, error: str) -> None:
        log.error(
            "reconciler: job %s cannot be enqueued and is REJECTED: %s",
            job.id,
            error,
            extra={"job_id": str(job.id), "error": error},
        )
        async with self.store.db.sessions() as session, session.begin():
            await session.execute(
                update(JobStateRow)
                .where(JobStateRow.id == job.id)
                .values(status="REJECTED", error=error, updated_at=datetime.now(UTC))
            )

    async def _mark_enqueued(self, job: JobRef) -> None:
        async with self.store.db.sessions() as session, session.begin():
            # Unless the sink moved the row meanwhile (an event newer than the page's read).
            await session.execute(
                update(JobStateRow)
                .where(JobStateRow.id == job.id, JobStateRow.updated_at == job.updated_at)
                .values(status="QUEUED", updated_at=datetime.now(UTC))
            )


def _text(value: bytes | None) -> str | None:
    return value.decode() if value else None
