"""The reconciler: the store and Redis brought back into agreement.

The store is the source of truth for which jobs exist. Two things can leave
a job the store holds as unfinished unknown to Redis: a crash of the API
between writing the row and enqueueing it, and a Redis that lost its data
(restarted without persistence, flushed, failed over to an empty replica).
Each pass pages through the unfinished jobs not updated for ``grace`` seconds
and looks each up in Redis by its engine id:

* the engine holds it (its record names ``job:<uuid>``): nothing to do, or,
  if the engine has finished it and the store missed the events (the stream
  was trimmed past them), the store takes the engine's final state;
* the engine does not: it is enqueued again, under the same engine
  idempotency key, so a racing API cannot make two. Delivery is at least
  once: a job whose run Redis forgot may run again.

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
from sluice.store.sink import engine_key, sink_horizon

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from sluice.engine.job import JobRecord
    from sluice.engine.queue import Queue
    from sluice.store.jobs import JobRef, JobStore, StoredJob
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
        mark_after: float | None = None,
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
        #: a job no event has named, found by its engine idempotency key, gets its engine id
        #: written once it has waited this long (s): half the key's life by default, so that
        #: the row names the job before the key expires, and a job that runs sooner is never
        #: written by the reconciler at all (see ``_engine_ids``)
        self.mark_after = max(grace, queue.idempotency_ttl_ms / 2000) if mark_after is None else mark_after
        self._epoch: bytes | None = None
        self._cursor: tuple[datetime, uuid.UUID] | None = None
        #: how far the unseen jobs were checked (they are the newest; each is checked once)
        self._unseen: tuple[datetime, uuid.UUID] | None = None
        #: how far the unseen jobs past ``mark_after`` were checked and marked
        self._unmarked: tuple[datetime, uuid.UUID] | None = None

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
        mark_before = now - timedelta(seconds=self.mark_after)
        done = Pass()
        if self.ledger is not None:
            # Budgets first: the engine refuses a job whose budget it does not know.
            await self.ledger.restore_missing()
        # Each unseen job once, past the grace, from where the last pass stopped. A row passed
        # by because it was committed after that pass, more than a grace after its time was
        # taken, is left to the sweep of the rest below.
        self._unseen = await self._unseen_sweep(done, self._unseen, older_than, mark_before)
        # And once more when it has waited long enough to be marked.
        self._unmarked = await self._unseen_sweep(done, self._unmarked, mark_before, mark_before)
        epoch: Any = await self.queue.redis.get(self.queue.keys.epoch)
        if full or (self._epoch is not None and epoch != self._epoch):
            self._cursor = self._unseen = self._unmarked = None
            await self._sweep(done, older_than, mark_before, unseen_only=False, pages=None)
        else:
            self._cursor = await self._sweep(
                done, older_than, mark_before, unseen_only=False, pages=1, after=self._cursor
            )
        self._epoch = epoch
        return done

    async def _unseen_sweep(
        self,
        done: Pass,
        last: tuple[datetime, uuid.UUID] | None,
        older_than: datetime,
        mark_before: datetime,
    ) -> tuple[datetime, uuid.UUID] | None:
        checked = await self._sweep(
            done, older_than, mark_before, unseen_only=True, pages=None, after=last, wrap=False
        )
        return checked if checked is not None and (last is None or checked > last) else last

    async def _sweep(
        self,
        done: Pass,
        older_than: datetime,
        mark_before: datetime,
        *,
        unseen_only: bool,
        pages: int | None,
        after: tuple[datetime, uuid.UUID] | None = None,
        wrap: bool = True,
    ) -> tuple[datetime, uuid.UUID] | None:
        """Pages of unfinished jobs checked against Redis; returns where to go on (at the end:
        None, to start again, or with ``wrap=False`` the last job checked). Jobs found by their
        keys are marked if they are older than ``mark_before``."""
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
            found = await self._engine_ids([j for j in jobs if j.engine_id is None])
            await self._mark_seen(
                {j.id: found[j.id] for j in jobs if j.id in found and j.updated_at < mark_before}
            )
            checking = jobs
            if unseen_only:
                # Found by its key, a job is in the engine. Whether it finished there with its
                # events lost is the sweep of the rest's to ask: a read per waiting job here
                # cost a drain of 100,000 jobs that had waited more than the store's own reads.
                checking = [j for j in jobs if j.id not in found]
            views = await self._engine_views([j.engine_id or found.get(j.id) for j in checking])
            for job, (idem, state, finished_ms) in zip(checking, views, strict=True):
                if idem == self.queue.keys.idem(engine_key(job.id)):  # the engine holds it
                    behind = horizon is None or (finished_ms is not None and finished_ms < horizon)
                    if state in FINAL_STATUS and behind:
                        record = await self.queue.get_job(str(job.engine_id or found[job.id]))
                        if record is not None and await self._finish_from(job, record):
                            done.finished += 1
                    continue
                whole = await self.store.get(job.id)
                if whole is None:  # deleted meanwhile
                    continue
                try:
                    added = await self.enqueue(self.queue, whole)
                except (InvalidJobError, BudgetNotFound) as exc:
                    # A row the engine will never take (stored by an older version that checked
                    # less, or naming a budget that neither Redis nor the store's copy knows):
                    # it ends REJECTED, saying why, rather than stop every pass here.
                    await self._reject(job, str(exc))
                    done.rejected += 1
                    continue
                await self._mark_enqueued(job, int(added))
                done.enqueued += 1
            after = (jobs[-1].updated_at, jobs[-1].id)
            if pages is not None:
                pages -= 1
        return after

    async def _engine_ids(self, jobs: list[JobRef]) -> dict[uuid.UUID, int]:
        """The engine ids of jobs no event has named, from their engine idempotency keys.

        The sink does not apply ``added`` (the row says QUEUED from the start), so a job
        learns its engine id from the first event that moves it. One that waits longer than
        the grace is found here, in one read for the page, and nothing is written: the pass
        remembers how far it checked (``_unseen``), so a waiting job is checked once, not
        once per pass. Only a job that waits past ``mark_after`` (half its key's life) gets
        its engine id written (``_mark_seen``). Writing it at the grace cost PostgreSQL a
        row version per waiting job, as much as the sink's own: a drain of 100,000 jobs that
        had waited ran at 0.45-0.48 of the engine's rate with it, 0.56-0.60 with the
        reconciler switched off.
        """
        if not jobs:
            return {}
        prefix = self.queue.keys.idem_prefix
        values: list[Any] = await self.queue.redis.mget([prefix + engine_key(j.id) for j in jobs])
        return {j.id: int(v) for j, v in zip(jobs, values, strict=True) if v is not None and v.isdigit()}

    async def _engine_views(
        self, engine_ids: list[int | None]
    ) -> list[tuple[str | None, str | None, int | None]]:
        """Each job's engine idempotency key, state and finish time (ms), as the engine has
        them ((None, None, None): no such job, or no id to look up): three fields, not the
        whole record."""
        asked = [i for i in engine_ids if i]
        if not asked:
            return [(None, None, None)] * len(engine_ids)
        keys = self.queue.keys
        async with self.queue.redis.pipeline(transaction=False) as pipe:
            for engine_id in asked:
                pipe.hmget(keys.job(str(engine_id)), "idem", "state", "finished")
            replies: list[list[bytes | None]] = await pipe.execute()
        views = {
            i: (_text(idem), _text(state), int(fin) if fin and fin.isdigit() else None)
            for i, (idem, state, fin) in zip(asked, replies, strict=True)
        }
        return [views[i] if i else (None, None, None) for i in engine_ids]

    async def _mark_seen(self, found: dict[uuid.UUID, int]) -> None:
        """The engine ids found by key, written on rows no event has named yet, once: later
        passes look such a job up by its id, not by its key, which expires (the queue's
        idempotency TTL, a day by default) while a delayed or waiting job may not."""
        if not found:
            return
        async with self.store.connection() as raw, raw.transaction():
            await raw.execute("SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off")
            await raw.execute(_MARK_SEEN, list(found), list(found.values()))

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

    async def _mark_enqueued(self, job: JobRef, engine_id: int) -> None:
        async with self.store.db.sessions() as session, session.begin():
            # Unless the sink moved the row meanwhile (it then holds a newer engine id).
            engine_id_now = JobStateRow.engine_id
            unchanged = engine_id_now.is_(None) if job.engine_id is None else engine_id_now == job.engine_id
            await session.execute(
                update(JobStateRow)
                .where(JobStateRow.id == job.id, unchanged)
                .values(engine_id=engine_id, status="QUEUED", updated_at=datetime.now(UTC))
            )


def _text(value: bytes | None) -> str | None:
    return value.decode() if value else None


# By primary key; a row some event named meanwhile keeps the id the event gave it.
_MARK_SEEN = """
UPDATE job_states AS j SET engine_id = d.engine_id
FROM unnest($1::uuid[], $2::bigint[]) AS d(id, engine_id)
WHERE j.id = d.id AND j.engine_id IS NULL
"""
