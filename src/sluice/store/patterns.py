"""Failure patterns: jobs that ended badly, grouped by what went wrong, classified by rules.

A dead-letter queue of ten thousand jobs is usually a handful of problems.
Each such job is fingerprinted (``store/fingerprints.py``); jobs with the
same fingerprint in one tenant's queue are one pattern, with a count and
first/last seen, which the collector (``store/collector.py``) counts. Each
pattern is classified by rules into a category that says what to do about it
(``store/categories.py``), so the analysis is useful without any LLM; the
optional LLM explanation (``llm/analysis.py``) is cached on the pattern's row.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

import orjson
from sqlalchemy import Select, select, text, tuple_, update

from sluice.errors import InvalidJobError
from sluice.store.categories import advice
from sluice.store.job import StoredJob
from sluice.store.schema import FailurePatternJobRow, FailurePatternRow, JobRow, JobStateRow

if TYPE_CHECKING:
    from sluice.store.database import Database

#: The job type of the LLM explanation (``llm/analysis.py`` runs it; its result is copied here).
ANALYSIS_JOB_TYPE = "failure-analysis"
#: Jobs per page of a collector pass (one transaction each), and analyses settled per call.
PAGE = 500

#: Where a pattern's LLM analysis stands.
AnalysisState = Literal["none", "pending", "done", "failed"]


@dataclass(frozen=True, slots=True)
class Pattern:
    """A pattern's row."""

    tenant: str
    queue: str
    id: str
    job_type: str
    error_type: str
    message: str
    category: str
    count: int
    first_seen: datetime
    last_seen: datetime
    sample_job: uuid.UUID | None
    sample_error: str | None
    analysis: dict[str, Any] | None
    analysis_at: datetime | None
    analysis_job: uuid.UUID | None
    analysis_error: str | None
    analysis_tries: int

    @property
    def advice(self) -> str:
        return advice(self.category)

    @property
    def analysis_state(self) -> AnalysisState:
        """none, pending (a job is on it), done (cached) or failed (the last job failed)."""
        if self.analysis_job is not None:
            return "pending"
        if self.analysis is not None:
            return "done"
        return "failed" if self.analysis_error is not None else "none"

    @classmethod
    def of(cls, row: FailurePatternRow) -> Pattern:
        return cls(
            tenant=row.tenant,
            queue=row.queue,
            id=row.id,
            job_type=row.job_type,
            error_type=row.error_type,
            message=row.message,
            category=row.category,
            count=row.count,
            first_seen=row.first_seen,
            last_seen=row.last_seen,
            sample_job=row.sample_job,
            sample_error=row.sample_error,
            analysis=row.analysis if isinstance(row.analysis, dict) else None,
            analysis_at=row.analysis_at,
            analysis_job=row.analysis_job,
            analysis_error=row.analysis_error,
            analysis_tries=row.analysis_tries,
        )


#: The orders a list can take.
SORTS = ("count", "last_seen")


@dataclass(frozen=True, slots=True)
class PatternJobsPage:
    """A pattern's jobs, latest death first, each with when it was counted."""

    jobs: list[tuple[StoredJob, datetime]]
    next_cursor: str | None


def _encode_cursor(at: datetime, job_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([at.isoformat(), str(job_id)])).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        at, job_id = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return datetime.fromisoformat(at), uuid.UUID(job_id)
    except (ValueError, TypeError) as exc:
        raise InvalidJobError(f"cursor {cursor!r} is not one this API gave out ({exc})") from None


def _no_nul(*values: str | None) -> bool:
    """PostgreSQL cannot keep NUL, nor compare it: a filter holding one matches nothing."""
    return not any(v is not None and "\x00" in v for v in values)


def pattern_jobs_query(
    tenant: str, queue: str, pattern_id: str, *, limit: int, after: tuple[datetime, uuid.UUID] | None = None
) -> Select[JobRow, JobStateRow, datetime]:
    """A page of a pattern's jobs, latest death first, after ``after`` (a ``(dead_at,
    job_id)``). Every column of the pattern's key is a condition, so that
    ``ix_failure_pattern_jobs_pattern`` (tenant, queue, pattern, dead_at DESC, job_id DESC)
    gives the rows in order and the page stops after ``limit`` of them: no sort of all the
    tenant's memberships per page, however many there are."""
    m = FailurePatternJobRow
    query = (
        select(JobRow, JobStateRow, m.dead_at)
        .join(JobStateRow, JobStateRow.id == JobRow.id)
        .join(m, m.job_id == JobRow.id)
        .where(m.tenant == tenant, m.queue == queue, m.pattern == pattern_id)
    )
    if after is not None:
        query = query.where(tuple_(m.dead_at, m.job_id) < tuple_(after[0], after[1]))
    return query.order_by(m.dead_at.desc(), m.job_id.desc()).limit(limit)


class PatternStore:
    """Patterns as the API and the command line read them (always within one tenant)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def list_patterns(
        self,
        tenant: str,
        *,
        queue: str | None = None,
        category: str | None = None,
        sort: str = "count",
        limit: int = 50,
        offset: int = 0,
    ) -> list[Pattern]:
        """A tenant's patterns, most frequent (or most recent) first."""
        if sort not in SORTS:
            raise InvalidJobError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
        if not _no_nul(tenant, queue, category):
            return []
        await self.settle(tenant=tenant)
        p = FailurePatternRow
        query = select(p).where(p.tenant == tenant)
        if queue is not None:
            query = query.where(p.queue == queue)
        if category is not None:
            query = query.where(p.category == category)
        first = (
            (p.count.desc(), p.last_seen.desc()) if sort == "count" else (p.last_seen.desc(), p.count.desc())
        )
        query = query.order_by(*first, p.queue, p.id).limit(limit).offset(offset)
        async with self.db.sessions() as session:
            return [Pattern.of(r) for r in await session.scalars(query)]

    async def get(self, tenant: str, pattern_id: str) -> Pattern | None:
        """A tenant's pattern by id (None: no such pattern, or another tenant's), its analysis
        settled first if its job has finished."""
        if not _no_nul(tenant, pattern_id):
            return None
        await self.settle(tenant=tenant, pattern=pattern_id)
        async with self.db.sessions() as session:
            row = await session.scalar(
                select(FailurePatternRow).where(
                    FailurePatternRow.tenant == tenant, FailurePatternRow.id == pattern_id
                )
            )
        return Pattern.of(row) if row is not None else None

    async def pattern_of(self, job_id: uuid.UUID) -> str | None:
        """The id of the pattern a job was last counted into (None: not counted yet)."""
        async with self.db.sessions() as session:
            found: str | None = await session.scalar(
                select(FailurePatternJobRow.pattern).where(FailurePatternJobRow.job_id == job_id)
            )
        return found

    async def jobs(
        self, tenant: str, queue: str, pattern_id: str, *, limit: int = 50, cursor: str | None = None
    ) -> PatternJobsPage:
        """The jobs last counted into a pattern (its key: tenant, queue, id), latest death
        first; ``cursor`` goes on."""
        if not _no_nul(tenant, queue, pattern_id):
            return PatternJobsPage([], None)
        query = pattern_jobs_query(
            tenant, queue, pattern_id, limit=limit + 1, after=_decode_cursor(cursor) if cursor else None
        )
        async with self.db.sessions() as session:
            rows = (await session.execute(query)).all()
        found = [(StoredJob.of(row, state), at) for row, state, at in rows[:limit]]
        more = len(rows) > limit and found
        return PatternJobsPage(found, _encode_cursor(found[-1][1], found[-1][0].id) if more else None)

    async def mark_pending(self, tenant: str, queue: str, pattern_id: str, job_id: uuid.UUID) -> bool:
        """The pattern's analysis is this job's to write, unless another is pending already."""
        p = FailurePatternRow
        async with self.db.sessions() as session, session.begin():
            done = await session.execute(
                update(p)
                .where(p.tenant == tenant, p.queue == queue, p.id == pattern_id, p.analysis_job.is_(None))
                .values(analysis_job=job_id)
            )
        return bool(getattr(done, "rowcount", 0))

    async def settle(
        self, *, tenant: str | None = None, pattern: str | None = None, limit: int = PAGE
    ) -> int:
        """Finished analysis jobs written onto their patterns: a completed one's result (which
        must hold a ``root_cause`` string, and the job must be of the analysis type) becomes
        the cached analysis; another end becomes ``analysis_error``. Returns how many settled.

        The worker does not write here: its job's result reaches the store like any other
        (the sink), and is copied from there, so the worker needs no database and a job
        cannot write onto a pattern that did not ask for it.
        """
        where = ["p.analysis_job IS NOT NULL"]
        params: dict[str, Any] = {"limit": limit, "type": ANALYSIS_JOB_TYPE}
        if tenant is not None:
            where.append("p.tenant = :tenant")
            params["tenant"] = tenant
        if pattern is not None:
            where.append("p.id = :pattern")
            params["pattern"] = pattern
        statement = text(_SETTLE.format(where=" AND ".join(where)))
        async with self.db.sessions() as session, session.begin():
            settled = (await session.execute(statement, params)).all()
        return len(settled)


# A completed job of the analysis type whose result has a root_cause string is the analysis;
# any other end of the job is a failure (its error's first line, or its status).
_SETTLE = """
WITH finished AS (
    SELECT p.tenant, p.queue, p.id, j.id AS job, s.updated_at,
           (s.status = 'COMPLETED' AND j.type = :type AND jsonb_typeof(s.result) = 'object'
            AND jsonb_typeof(s.result -> 'root_cause') = 'string') AS ok,
           s.result, left(split_part(COALESCE(NULLIF(s.error, ''), s.status), E'\\n', 1), 500) AS why
    FROM failure_patterns p JOIN job_states s ON s.id = p.analysis_job JOIN jobs j ON j.id = s.id
    WHERE {where}
      AND s.status IN ('COMPLETED', 'DEAD_LETTER', 'REJECTED', 'EXHAUSTED', 'CANCELLED')
    LIMIT :limit
)
UPDATE failure_patterns AS p SET
    analysis = CASE WHEN f.ok THEN f.result || jsonb_build_object('job_id', f.job::text) ELSE p.analysis END,
    analysis_at = CASE WHEN f.ok THEN f.updated_at ELSE p.analysis_at END,
    analysis_error = CASE WHEN f.ok THEN NULL
                          ELSE COALESCE(NULLIF(f.why, ''), 'the analysis job ended without a result') END,
    analysis_tries = CASE WHEN f.ok THEN p.analysis_tries ELSE p.analysis_tries + 1 END,
    analysis_job = NULL
FROM finished f
WHERE p.tenant = f.tenant AND p.queue = f.queue AND p.id = f.id AND p.analysis_job = f.job
RETURNING p.id
"""
