"""Job records in the store: create (once per idempotency key), read, list.

The API writes a job here first, then enqueues it: a job the API answered 201
for is in PostgreSQL whatever happens to the process or to Redis next (the
reconciler enqueues what was not). Concurrent submissions of one idempotency
key race on a unique index, not on a read: ``INSERT ... ON CONFLICT DO
NOTHING`` lets exactly one win, and the others read the winner's row. The jobs
themselves, as the store gives them out (:class:`StoredJob`), are ``store/job.py``'s.
"""

from __future__ import annotations

import base64
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import Select, and_, delete, func, or_, select, text, tuple_
from sqlalchemy.dialects.postgresql import insert

from sluice.errors import InvalidJobError
from sluice.store.ids import new_job_id
from sluice.store.job import Attempt, JobRef, NewJob, StoredJob, new_stored, stored_from_record
from sluice.store.schema import AttemptRow, JobRow, JobStateRow, LegacyIdRow

if TYPE_CHECKING:
    from sluice.store.database import Database

#: Most jobs one list call returns.
MAX_PAGE = 500
#: Seconds a batch's INSERT may take before the batch fails (503) and its connection is replaced.
WRITE_TIMEOUT = 30.0


# One statement for a whole batch: the rows in their order (WITH ORDINALITY), so that of two with
# one key the first is the one inserted; and the state of each job inserted, QUEUED.
_INSERT_MANY = """
WITH inserted AS (
    INSERT INTO jobs (id, tenant, queue, type, priority, max_attempts, payload, idempotency_key,
                      correlation_id, tokens, budget, delay_ms, backoff, created_at)
    SELECT t.id, t.tenant, t.queue, t.type, t.priority, t.max_attempts, t.payload::jsonb,
           t.idem, t.cid, t.tokens, t.budget, t.delay_ms, t.backoff::jsonb, $14
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[], $7::text[],
                $8::text[], $9::text[], $10::bigint[], $11::text[], $12::bigint[], $13::text[])
         WITH ORDINALITY AS t(id, tenant, queue, type, priority, max_attempts, payload, idem, cid,
                              tokens, budget, delay_ms, backoff, n)
    ORDER BY t.n
    ON CONFLICT (tenant, idempotency_key) DO NOTHING
    RETURNING id, tenant, queue
)
INSERT INTO job_states (id, tenant, queue, created_at, status, updated_at)
SELECT id, tenant, queue, $14, 'QUEUED', $14 FROM inserted
RETURNING id
"""
_BY_KEYS = """
SELECT j.*, s.status, s.attempts, s.result, s.error, s.updated_at, s.processed_at,
       s.completed_at
FROM jobs j
JOIN job_states s ON s.id = j.id
JOIN unnest($1::text[], $2::text[]) AS k(tenant, idem)
  ON j.tenant = k.tenant AND j.idempotency_key = k.idem
"""


@dataclass(frozen=True, slots=True)
class Page:
    jobs: list[StoredJob]
    #: pass it back to get the next page; None: this was the last
    next_cursor: str | None


def _encode_cursor(job: StoredJob) -> str:
    raw = orjson.dumps([job.created_at.isoformat(), str(job.id)])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, job_id = orjson.loads(raw)
        return datetime.fromisoformat(at), uuid.UUID(job_id)
    except (ValueError, TypeError) as exc:
        raise InvalidJobError(f"cursor {cursor!r} is not one this API gave out ({exc})") from None


class JobStore:
    """Job rows: the API's writes and reads."""

    def __init__(self, db: Database) -> None:
        self.db = db
        #: whether job_legacy_ids was found empty (it never fills again)
        self._legacy_empty = False

    async def create(self, new: NewJob, *, now: datetime | None = None) -> tuple[StoredJob, bool]:
        """Store a new job as QUEUED; returns it and True, or, if its idempotency key was used
        by this tenant before, the first job and False (concurrent callers included)."""
        at = now or datetime.now(UTC)
        values = {
            "id": new_job_id(),
            "tenant": new.tenant,
            "queue": new.queue,
            "type": new.type,
            "priority": new.priority,
            "max_attempts": new.max_attempts,
            "payload": new.payload,
            "idempotency_key": new.idempotency_key,
            "correlation_id": new.correlation_id,
            "tokens": new.tokens,
            "budget": new.budget,
            "delay_ms": new.delay_ms,
            "backoff": new.backoff,
            "created_at": at,
        }
        stmt = insert(JobRow).values(**values)
        if new.idempotency_key is not None:
            stmt = stmt.on_conflict_do_nothing(index_elements=["tenant", "idempotency_key"])
        async with self.db.sessions() as session, session.begin():
            row = (await session.execute(stmt.returning(JobRow))).scalar_one_or_none()
            if row is not None:
                state = JobStateRow(
                    id=row.id,
                    tenant=row.tenant,
                    queue=row.queue,
                    created_at=at,
                    status="QUEUED",
                    attempts=0,
                    updated_at=at,
                )
                session.add(state)
                await session.flush()
                return StoredJob.of(row, state), True
            first = (
                await session.execute(
                    _joined().where(
                        JobRow.tenant == new.tenant, JobRow.idempotency_key == new.idempotency_key
                    )
                )
            ).one_or_none()
        assert first is not None, "the conflicting row was committed before ON CONFLICT answered"
        return StoredJob.of(*first), False

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        """One of the pool's connections, as asyncpg's own, for several :meth:`create_many`
        calls in a row: the pool checks a connection (a round trip) each time it lends one."""
        async with self.db.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            yield raw

    async def create_many(
        self,
        news: Sequence[NewJob],
        *,
        now: datetime | None = None,
        ids: Sequence[uuid.UUID] | None = None,
        conn: Any = None,
    ) -> list[tuple[StoredJob, bool]]:
        """Store many new jobs in one statement; per job, in order, what :meth:`create` returns.

        The service's intake groups the submissions that arrive together into
        one call: one round trip and one commit for all of them, where the ORM
        path costs far more CPU per job (docs/decisions/0016 has the figures).
        Raw asyncpg with arrays (``unnest``), so the statement is the same
        whatever the batch size and is prepared once per connection. A key used
        twice in one batch, or by a concurrent call, names one job: the first
        (committed) one.
        """
        if not news:
            return []
        at = now or datetime.now(UTC)
        if ids is None:
            ids = [new_job_id() for _ in news]
        elif len(ids) != len(news):
            raise ValueError(f"{len(ids)} ids for {len(news)} jobs")
        columns = (
            ids,
            [n.tenant for n in news],
            [n.queue for n in news],
            [n.type for n in news],
            [n.priority for n in news],
            [n.max_attempts for n in news],
            [orjson.dumps(n.payload).decode() for n in news],
            [n.idempotency_key for n in news],
            [n.correlation_id for n in news],
            [n.tokens for n in news],
            [n.budget for n in news],
            [n.delay_ms for n in news],
            [orjson.dumps(n.backoff).decode() for n in news],
        )
        if conn is None:
            async with self.connection() as raw:
                return await self.create_many(news, now=now, ids=ids, conn=raw)
        # A bound on the wait: a connection broken without a word (a dropped NAT entry) would
        # otherwise hold every submission of the process until TCP gives up.
        inserted = {r[0] for r in await conn.fetch(_INSERT_MANY, *columns, at, timeout=WRITE_TIMEOUT)}
        keys = [
            (n.tenant, n.idempotency_key)
            for n, i in zip(news, ids, strict=True)
            if i not in inserted and n.idempotency_key is not None
        ]
        firsts: dict[tuple[str, str], Any] = {}
        if keys:
            found = await conn.fetch(
                _BY_KEYS, [k[0] for k in keys], [k[1] for k in keys], timeout=WRITE_TIMEOUT
            )
            firsts = {(r["tenant"], r["idempotency_key"]): r for r in found}
        out: list[tuple[StoredJob, bool]] = []
        for n, job_id in zip(news, ids, strict=True):
            if job_id in inserted:
                out.append((new_stored(job_id, n, at), True))
            else:
                first = firsts.get((n.tenant, n.idempotency_key or ""))
                assert first is not None, "the conflicting row was committed before ON CONFLICT answered"
                out.append((stored_from_record(first), False))
        return out

    async def get(
        self, job_id: uuid.UUID, *, tenant: str | None = None, attempts: bool = False
    ) -> StoredJob | None:
        """A job by id (None if absent, or another tenant's when ``tenant`` is given)."""
        async with self.db.sessions() as session:
            both = (await session.execute(_joined().where(JobRow.id == job_id))).one_or_none()
            if both is None or (tenant is not None and both[0].tenant != tenant):
                return None
            found: tuple[Attempt, ...] = ()
            if attempts:
                rows = await session.scalars(
                    select(AttemptRow).where(AttemptRow.job_id == job_id).order_by(AttemptRow.token)
                )
                found = tuple(
                    Attempt(a.token, a.attempt, a.worker, a.started_at, a.finished_at, a.outcome, a.error)
                    for a in rows
                )
            return StoredJob.of(both[0], both[1], found)

    async def list_jobs(
        self,
        tenant: str,
        *,
        status: str | None = None,
        type: str | None = None,
        queue: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """A tenant's jobs, newest first, filtered; ``cursor`` continues a previous page."""
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidJobError(f"limit must be from 1 to {MAX_PAGE}, got {limit}")
        if any("\x00" in f for f in (status, type, queue) if f is not None):
            return Page([], None)  # no job has one (PostgreSQL cannot keep NUL, nor compare it)
        # By status, the state's index gives the order (its copies of the tenant and the time);
        # otherwise the job's (all of a tenant's, or by type).
        by_tenant, by_queue, by_created, by_id = (
            (JobStateRow.tenant, JobStateRow.queue, JobStateRow.created_at, JobStateRow.id)
            if status is not None
            else (JobRow.tenant, JobRow.queue, JobRow.created_at, JobRow.id)
        )
        query = _joined().where(by_tenant == tenant)
        if status is not None:
            query = query.where(JobStateRow.status == status)
        if type is not None:
            query = query.where(JobRow.type == type)
        if queue is not None:
            query = query.where(by_queue == queue)
        if cursor is not None:
            at, last = _decode_cursor(cursor)
            query = query.where(tuple_(by_created, by_id) < tuple_(at, last))
        query = query.order_by(by_created.desc(), by_id.desc()).limit(limit + 1)
        async with self.db.sessions() as session:
            rows = list(await session.execute(query))
        jobs = [StoredJob.of(r[0], r[1]) for r in rows[:limit]]
        return Page(jobs, _encode_cursor(jobs[-1]) if len(rows) > limit else None)

    async def latency_percentiles(
        self, tenant: str, *, last: int = 1000
    ) -> dict[str, dict[str, float | None]]:
        """p50/p95/p99 (ms) of queue wait (created to first start), processing (first start to
        completion) and end to end, over the tenant's ``last`` newest completed jobs."""
        query = text(
            """
            WITH recent AS (
                SELECT created_at, processed_at, completed_at FROM job_states
                WHERE tenant = :tenant AND status = 'COMPLETED' AND processed_at IS NOT NULL
                ORDER BY created_at DESC LIMIT :last
            )
            SELECT
                percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP
                    (ORDER BY extract(epoch FROM processed_at - created_at) * 1000),
                percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP
                    (ORDER BY extract(epoch FROM completed_at - processed_at) * 1000),
                percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP
                    (ORDER BY extract(epoch FROM completed_at - created_at) * 1000),
                count(*)
            FROM recent
            """
        )
        async with self.db.sessions() as session:
            row = (await session.execute(query, {"tenant": tenant, "last": last})).one()
        out: dict[str, dict[str, float | None]] = {}
        for name, values in zip(("queue_wait", "processing", "end_to_end"), row[:3], strict=True):
            ps = list(values) if values is not None else [None, None, None]
            out[name] = {
                label: round(float(v), 3) if v is not None else None
                for label, v in zip(("p50", "p95", "p99"), ps, strict=True)
            }
        out["sample"] = {"jobs": float(row[3])}
        return out

    async def counts(self, tenant: str | None = None) -> dict[str, int]:
        """Jobs per status (of one tenant, or of all)."""
        query = select(JobStateRow.status, func.count()).group_by(JobStateRow.status)
        if tenant is not None:
            query = query.where(JobStateRow.tenant == tenant)
        async with self.db.sessions() as session:
            rows = (await session.execute(query)).all()
        return {status: int(n) for status, n in rows}

    async def unfinished(
        self,
        queue: str,
        *,
        older_than: datetime,
        after: tuple[datetime, uuid.UUID] | None,
        limit: int,
        unseen_only: bool = False,
    ) -> list[JobRef]:
        """Jobs the store thinks are not finished, not updated since ``older_than``, oldest first
        (the reconciler's page; ``after`` continues it). ``unseen_only``: only those no event
        has named yet. Their ids only: the reconciler reads a whole job (its
        payload decoded) only when it must enqueue it again."""
        query = select(JobStateRow.id, JobStateRow.updated_at).where(
            JobStateRow.queue == queue,
            JobStateRow.status.in_(("QUEUED", "PROCESSING", "FAILED", "PARKED")),
            JobStateRow.updated_at < older_than,
        )
        if unseen_only:
            query = query.where(JobStateRow.ev_ms == 0)
        if after is not None:
            query = query.where(
                or_(
                    JobStateRow.updated_at > after[0],
                    and_(JobStateRow.updated_at == after[0], JobStateRow.id > after[1]),
                )
            )
        query = query.order_by(JobStateRow.updated_at, JobStateRow.id).limit(limit)
        async with self.db.sessions() as session:
            return [JobRef(r.id, r.updated_at) for r in await session.execute(query)]

    async def legacy_engine_ids(self, job_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, str]:
        """The engine ids of those jobs that an earlier version enqueued under a number of its
        own (migration 0009 kept them); every other job's engine id is its id. Free once the
        table is empty: nothing adds to it, so that is remembered."""
        if self._legacy_empty or not job_ids:
            return {}
        async with self.db.sessions() as session:
            rows = await session.execute(
                select(LegacyIdRow.job_id, LegacyIdRow.engine_id).where(LegacyIdRow.job_id.in_(job_ids))
            )
            found = {r.job_id: str(r.engine_id) for r in rows}
            if not found:
                self._legacy_empty = not await session.scalar(select(LegacyIdRow.job_id).limit(1))
        return found

    async def forget_legacy_ids(self, job_ids: Sequence[uuid.UUID]) -> None:
        """Those jobs are in the engine under their own ids now (enqueued again, or finished)."""
        if not job_ids or self._legacy_empty:
            return
        async with self.db.sessions() as session, session.begin():
            await session.execute(delete(LegacyIdRow).where(LegacyIdRow.job_id.in_(job_ids)))

    async def engine_id(self, job_id: uuid.UUID) -> str:
        """The id the engine knows a stored job by: its own, or one an earlier version gave it."""
        return (await self.legacy_engine_ids([job_id])).get(job_id, str(job_id))


def _joined() -> Select[JobRow, JobStateRow]:
    """A job's two rows: as submitted, and where it stands."""
    return select(JobRow, JobStateRow).join(JobStateRow, JobStateRow.id == JobRow.id)
