"""Job records in the store: create (once per idempotency key), read, list.

The API writes a job here first, then enqueues it: a job the API answered 201
for is in PostgreSQL whatever happens to the process or to Redis next (the
reconciler enqueues what was not). Concurrent submissions of one idempotency
key race on a unique index, not on a read: ``INSERT ... ON CONFLICT DO
NOTHING`` lets exactly one win, and the others read the winner's row.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import and_, func, or_, select, text, tuple_
from sqlalchemy.dialects.postgresql import insert

from sluice.errors import InvalidJobError
from sluice.store.schema import AttemptRow, JobRow

if TYPE_CHECKING:
    from sluice.store.database import Database

#: The statuses the API shows, in lifecycle order.
STATUSES = (
    "QUEUED",
    "PARKED",
    "PROCESSING",
    "FAILED",
    "COMPLETED",
    "DEAD_LETTER",
    "CANCELLED",
    "REJECTED",
    "EXHAUSTED",
)
#: Statuses after which a job never changes again.
FINAL = frozenset({"COMPLETED", "DEAD_LETTER", "CANCELLED", "REJECTED", "EXHAUSTED"})
#: Most jobs one list call returns.
MAX_PAGE = 500
#: The integers the engine's JSON (orjson) carries: int64 and uint64.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _as_sent(value: Any) -> Any:
    """A JSON value read back from jsonb, with its big numbers as they were sent.

    jsonb keeps a number's value, not its spelling: ``4.5e23`` comes back as
    ``450000000000000000000000``, an integer no 64-bit type holds, which the
    engine cannot encode (the job would be stored and never enqueued). The API
    takes no integer that large, so such a number was a float, and is one again.
    Unchanged values are returned as they are (no copy).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value if _INT_MIN <= value <= _INT_MAX else float(value)
    if isinstance(value, dict):
        items = {k: _as_sent(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, list):
        elements = [_as_sent(v) for v in value]
        return value if all(a is b for a, b in zip(elements, value, strict=True)) else elements
    return value


@dataclass(frozen=True, slots=True)
class NewJob:
    """What the API accepted, before it is stored."""

    tenant: str
    queue: str
    type: str
    payload: Any
    priority: int
    max_attempts: int
    backoff: list[Any]
    delay_ms: int = 0
    idempotency_key: str | None = None
    correlation_id: str | None = None
    tokens: int = 0
    budget: str | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    token: int
    attempt: int
    worker: str | None
    started_at: datetime
    finished_at: datetime | None
    outcome: str | None
    error: str | None


@dataclass(frozen=True, slots=True)
class StoredJob:
    """A job as the store holds it."""

    id: uuid.UUID
    tenant: str
    queue: str
    engine_id: int | None
    type: str
    status: str
    priority: int
    attempts: int
    max_attempts: int
    payload: Any
    result: Any
    error: str | None
    idempotency_key: str | None
    correlation_id: str | None
    tokens: int
    budget: str | None
    spent: int
    delay_ms: int
    backoff: list[Any]
    created_at: datetime
    updated_at: datetime
    processed_at: datetime | None
    completed_at: datetime | None
    attempt_list: tuple[Attempt, ...] = field(default=())

    @classmethod
    def of(cls, row: JobRow, attempts: tuple[Attempt, ...] = ()) -> StoredJob:
        return cls(
            id=row.id,
            tenant=row.tenant,
            queue=row.queue,
            engine_id=row.engine_id,
            type=row.type,
            status=row.status,
            priority=row.priority,
            attempts=row.attempts,
            max_attempts=row.max_attempts,
            payload=_as_sent(row.payload),
            result=_as_sent(row.result),
            error=row.error,
            idempotency_key=row.idempotency_key,
            correlation_id=row.correlation_id,
            tokens=row.tokens,
            budget=row.budget,
            spent=row.spent,
            delay_ms=row.delay_ms,
            backoff=row.backoff,
            created_at=row.created_at,
            updated_at=row.updated_at,
            processed_at=row.processed_at,
            completed_at=row.completed_at,
            attempt_list=attempts,
        )


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

    async def create(self, new: NewJob, *, now: datetime | None = None) -> tuple[StoredJob, bool]:
        """Store a new job as QUEUED; returns it and True, or, if its idempotency key was used
        by this tenant before, the first job and False (concurrent callers included)."""
        at = now or datetime.now(UTC)
        values = {
            "id": uuid.uuid4(),
            "tenant": new.tenant,
            "queue": new.queue,
            "type": new.type,
            "status": "QUEUED",
            "priority": new.priority,
            "attempts": 0,
            "max_attempts": new.max_attempts,
            "payload": new.payload,
            "idempotency_key": new.idempotency_key,
            "correlation_id": new.correlation_id,
            "tokens": new.tokens,
            "budget": new.budget,
            "delay_ms": new.delay_ms,
            "backoff": new.backoff,
            "created_at": at,
            "updated_at": at,
        }
        stmt = insert(JobRow).values(**values)
        if new.idempotency_key is not None:
            stmt = stmt.on_conflict_do_nothing(index_elements=["tenant", "idempotency_key"])
        async with self.db.sessions() as session, session.begin():
            row = (await session.execute(stmt.returning(JobRow))).scalar_one_or_none()
            if row is not None:
                return StoredJob.of(row), True
            first = await session.scalar(
                select(JobRow).where(
                    JobRow.tenant == new.tenant, JobRow.idempotency_key == new.idempotency_key
                )
            )
        assert first is not None, "the conflicting row was committed before ON CONFLICT answered"
        return StoredJob.of(first), False

    async def get(
        self, job_id: uuid.UUID, *, tenant: str | None = None, attempts: bool = False
    ) -> StoredJob | None:
        """A job by id (None if absent, or another tenant's when ``tenant`` is given)."""
        async with self.db.sessions() as session:
            row = await session.get(JobRow, job_id)
            if row is None or (tenant is not None and row.tenant != tenant):
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
            return StoredJob.of(row, found)

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
        query = select(JobRow).where(JobRow.tenant == tenant)
        if status is not None:
            query = query.where(JobRow.status == status)
        if type is not None:
            query = query.where(JobRow.type == type)
        if queue is not None:
            query = query.where(JobRow.queue == queue)
        if cursor is not None:
            at, last = _decode_cursor(cursor)
            query = query.where(tuple_(JobRow.created_at, JobRow.id) < tuple_(at, last))
        query = query.order_by(JobRow.created_at.desc(), JobRow.id.desc()).limit(limit + 1)
        async with self.db.sessions() as session:
            rows = list(await session.scalars(query))
        jobs = [StoredJob.of(r) for r in rows[:limit]]
        return Page(jobs, _encode_cursor(jobs[-1]) if len(rows) > limit else None)

    async def latency_percentiles(
        self, tenant: str, *, last: int = 1000
    ) -> dict[str, dict[str, float | None]]:
        """p50/p95/p99 (ms) of queue wait (created to first start), processing (first start to
        completion) and end to end, over the tenant's ``last`` newest completed jobs."""
        query = text(
            """
            WITH recent AS (
                SELECT created_at, processed_at, completed_at FROM jobs
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
        query = select(JobRow.status, func.count()).group_by(JobRow.status)
        if tenant is not None:
            query = query.where(JobRow.tenant == tenant)
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
    ) -> list[StoredJob]:
        """Jobs the store thinks are not finished, not updated since ``older_than``, oldest first
        (the reconciler's page; ``after`` continues it). ``unseen_only``: only those no event
        has named yet (no engine id)."""
        query = select(JobRow).where(
            JobRow.queue == queue,
            JobRow.status.in_(("QUEUED", "PROCESSING", "FAILED", "PARKED")),
            JobRow.updated_at < older_than,
        )
        if unseen_only:
            query = query.where(JobRow.engine_id.is_(None))
        if after is not None:
            query = query.where(
                or_(
                    JobRow.updated_at > after[0],
                    and_(JobRow.updated_at == after[0], JobRow.id > after[1]),
                )
            )
        query = query.order_by(JobRow.updated_at, JobRow.id).limit(limit)
        async with self.db.sessions() as session:
            return [StoredJob.of(r) for r in await session.scalars(query)]
