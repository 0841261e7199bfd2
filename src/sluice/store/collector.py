"""The pattern collector: the jobs that ended badly, counted into their failure patterns.

:class:`PatternCollector` counts them: a periodic, bounded pass like the
reconciler's, in the process whose sink leads. It pages through the jobs
that ended badly by ``(updated_at, id)`` (the partial index
``ix_job_states_failed``), 500 a page, one transaction per page, and only through
jobs updated more than ``settle`` seconds ago, so that a sink batch that
committed late (its ``updated_at`` is taken before it connects, so it may
commit seconds after that time) is not passed by. A batch that commits later
still lands behind the pass's cursor: each pass therefore first looks back
``overlap`` seconds behind it, for the jobs there that are not counted yet
(only those: a job already counted at its lease is left out by the query). What
was counted is remembered per job in ``failure_pattern_jobs``, with the lease
(highest attempt token) it was counted at:

* a job is counted once, however often it is paged through (passes,
  restarts, two collectors at once: the membership row is written first,
  ``ON CONFLICT ... WHERE`` the token is higher, and only the rows it wrote
  are counted);
* a job that was redriven and died again counts again (a new death after a
  new lease), and moves to its new pattern; the old pattern keeps its count,
  which counts deaths, not distinct jobs. A death the store learnt of from
  the reconciler (the engine's record, when its events were lost) carries
  no new attempt, so such a second death is not counted.

Which jobs count: DEAD_LETTER, and REJECTED and EXHAUSTED too: a budget or
an admission limit that refuses jobs is a failure an operator needs to see
as much as a crashing handler. A REJECTED job whose reason names a budget or
a limit, and every EXHAUSTED one, is in the budget category; another
rejection (a stored job the engine cannot take) is classified by the rules.
CANCELLED jobs do not count: someone asked for it.

Where a restarted collector goes on is derived, not stored: the latest
``dead_at`` of the membership table, less a margin (clocks of the API
processes that led before may differ); paging again over jobs already
counted costs a read and counts nothing.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from sluice.store.categories import classify
from sluice.store.fingerprints import Fingerprint, fingerprint
from sluice.store.patterns import PAGE, PatternStore

if TYPE_CHECKING:
    from sluice.store.database import Database

# The logger's name is the one it had when the collector was part of store/patterns.py.
log = logging.getLogger("sluice.store.patterns")

#: The statuses a collector counts.
COUNTED = ("DEAD_LETTER", "REJECTED", "EXHAUSTED")
#: Longest raw error kept as a pattern's sample.
MAX_SAMPLE = 4000


@dataclass
class CollectPass:
    """What one pass did."""

    #: jobs read
    looked: int = 0
    #: deaths counted (jobs read less those counted before at the same lease)
    counted: int = 0
    #: patterns made or updated
    patterns: int = 0
    #: analyses settled
    settled: int = 0
    #: of ``counted``: deaths found behind the cursor (a batch that committed late)
    late: int = 0


_PAGE = """
SELECT s.id, j.tenant, j.queue, j.type, s.status, s.error, s.updated_at,
       COALESCE((SELECT max(a.token) FROM job_attempts a WHERE a.job_id = s.id), 0) AS token
FROM job_states s JOIN jobs j ON j.id = s.id
WHERE s.status IN ('DEAD_LETTER', 'REJECTED', 'EXHAUSTED')
  AND (s.updated_at, s.id) > ($1, $2) AND s.updated_at < $3
ORDER BY s.updated_at, s.id
LIMIT $4
"""
# Behind the cursor: the jobs that ended badly in the overlap window and are not counted at their
# lease yet (a membership at that token or higher is a death counted). Counted rows are read by
# the index and left out, so a window of thousands of deaths costs a scan and returns the few.
_LOOK_BACK = """
SELECT s.id, j.tenant, j.queue, j.type, s.status, s.error, s.updated_at, t.token
FROM job_states s JOIN jobs j ON j.id = s.id
CROSS JOIN LATERAL (
    SELECT COALESCE(max(a.token), 0) AS token FROM job_attempts a WHERE a.job_id = s.id
) t
WHERE s.status IN ('DEAD_LETTER', 'REJECTED', 'EXHAUSTED')
  AND (s.updated_at, s.id) > ($1, $2) AND (s.updated_at, s.id) <= ($3, $4)
  AND NOT EXISTS (SELECT 1 FROM failure_pattern_jobs m WHERE m.job_id = s.id AND m.token >= t.token)
ORDER BY s.updated_at, s.id
LIMIT $5
"""
# Written first: only the rows it writes are counted, so a job read twice (passes, restarts,
# two collectors at once) counts once, and again only after a new lease (redriven, died again).
_MEMBERS = """
INSERT INTO failure_pattern_jobs AS m (job_id, tenant, queue, pattern, status, token, deaths, dead_at)
SELECT d.job_id, d.tenant, d.queue, d.pattern, d.status, d.token, 1, d.dead_at
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::timestamptz[])
     AS d(job_id, tenant, queue, pattern, status, token, dead_at)
ON CONFLICT (job_id) DO UPDATE
    SET pattern = EXCLUDED.pattern, status = EXCLUDED.status, token = EXCLUDED.token,
        deaths = m.deaths + 1, dead_at = EXCLUDED.dead_at
    WHERE m.token < EXCLUDED.token
RETURNING m.job_id
"""
_PATTERNS = """
INSERT INTO failure_patterns AS p (tenant, queue, id, job_type, error_type, message, category, count,
                                   first_seen, last_seen, sample_job, sample_error)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                     $8::bigint[], $9::timestamptz[], $10::timestamptz[], $11::uuid[], $12::text[])
ON CONFLICT (tenant, queue, id) DO UPDATE SET
    count = p.count + EXCLUDED.count,
    first_seen = LEAST(p.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(p.last_seen, EXCLUDED.last_seen),
    category = EXCLUDED.category,
    sample_job = CASE WHEN EXCLUDED.last_seen >= p.last_seen THEN EXCLUDED.sample_job ELSE p.sample_job END,
    sample_error = CASE WHEN EXCLUDED.last_seen >= p.last_seen THEN EXCLUDED.sample_error
                        ELSE p.sample_error END
"""
_RESUME = "SELECT dead_at FROM failure_pattern_jobs ORDER BY dead_at DESC LIMIT 1"


@dataclass
class _Group:
    fp: Fingerprint
    tenant: str
    queue: str
    category: str
    count: int
    first: datetime
    last: datetime
    sample_job: uuid.UUID
    sample_error: str


class PatternCollector:
    """``run()`` every ``interval`` seconds until stopped; ``collect()`` once (tests, the CLI).

    A pass first looks ``overlap`` seconds behind its cursor for deaths not counted yet (a sink
    batch commits after the ``updated_at`` it stamps: one that took longer than ``settle``
    lands behind a cursor that has moved on), then reads at most ``pages`` pages of ``page``
    jobs (one transaction each) and settles the analyses that finished; a backlog (the first
    pass over an old dead-letter queue) is worked off over several passes.
    """

    def __init__(
        self,
        db: Database,
        *,
        interval: float = 30.0,
        settle: float = 10.0,
        pages: int = 4,
        page: int = PAGE,
        margin: float = 300.0,
        overlap: float = 300.0,
        lead: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.db = db
        self.interval = interval
        #: seconds a job's update must be old before it is read (a batch committed late)
        self.settle = settle
        self.pages = pages
        self.page = page
        #: how far before the last counted death a collector that starts or takes the lead goes
        #: back (another process's clock wrote those times)
        self.margin = margin
        #: how far behind its cursor each pass looks for deaths not counted yet (a sink batch
        #: that committed this much after the time it stamped is still counted)
        self.overlap = overlap
        #: passes run only while this returns True (the process whose sink leads); None: always
        self.lead = lead
        self.patterns = PatternStore(db)
        self._cursor: tuple[datetime, uuid.UUID] | None = None
        self._resumed = False

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if self.lead is None or await self.lead():
                    done = await self.collect()
                    if done.counted:
                        log.info(
                            "failure patterns: %d deaths counted into %d patterns (%d committed late)",
                            done.counted,
                            done.patterns,
                            done.late,
                            extra={"counted": done.counted, "patterns": done.patterns, "late": done.late},
                        )
                else:
                    self._resumed = False  # another process leads: start again from the table
            except asyncio.CancelledError:
                raise
            except Exception:  # an outage of PostgreSQL: the next pass tries again
                log.exception("failure patterns: a pass failed; the next one tries again")
            try:
                async with asyncio.timeout(self.interval):
                    await stop.wait()
            except TimeoutError:
                pass

    async def collect(self, *, now: datetime | None = None) -> CollectPass:
        """One pass: up to ``pages`` pages of jobs that ended badly, then the finished analyses."""
        done = CollectPass()
        if not self._resumed:
            self._cursor = await self._resume_point()
            self._resumed = True
        before = (now or datetime.now(UTC)) - timedelta(seconds=self.settle)
        if self._cursor is not None and self.overlap > 0:
            await self._look_back(done, self._cursor)
        for _ in range(self.pages):
            read = await self._page(done, before)
            if read < self.page:
                break
        done.settled = await self.patterns.settle()
        return done

    async def _resume_point(self) -> tuple[datetime, uuid.UUID] | None:
        async with self.db.engine.connect() as conn:
            last = (await conn.execute(text(_RESUME))).scalar()
        if last is None:
            return None
        return (last - timedelta(seconds=self.margin), uuid.UUID(int=0))

    async def _look_back(self, done: CollectPass, cursor: tuple[datetime, uuid.UUID]) -> None:
        """The deaths of the ``overlap`` seconds up to ``cursor`` that are not counted yet, up
        to ``pages`` pages of them (the cursor stays where it is)."""
        after = (cursor[0] - timedelta(seconds=self.overlap), uuid.UUID(int=0))
        for _ in range(self.pages):
            counted = done.counted
            rows = await self._count(done, _LOOK_BACK, after[0], after[1], cursor[0], cursor[1], self.page)
            done.late += done.counted - counted
            if len(rows) < self.page:
                return
            after = (rows[-1]["updated_at"], rows[-1]["id"])

    async def _page(self, done: CollectPass, before: datetime) -> int:
        """One page in one transaction; returns how many jobs it read."""
        after = self._cursor or (datetime(1970, 1, 1, tzinfo=UTC), uuid.UUID(int=0))
        rows = await self._count(done, _PAGE, after[0], after[1], before, self.page)
        if rows:
            self._cursor = (rows[-1]["updated_at"], rows[-1]["id"])
        return len(rows)

    async def _count(self, done: CollectPass, query: str, *args: Any) -> list[Any]:
        """The jobs ``query`` reads, counted into their patterns, in one transaction; returns them."""
        async with self.db.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            async with raw.transaction():
                rows: list[Any] = await raw.fetch(query, *args)
                if not rows:
                    return rows
                done.looked += len(rows)
                prints = {
                    r["id"]: fingerprint(r["error"] or "", r["type"], queue=r["queue"], status=r["status"])
                    for r in rows
                }
                counted = {
                    r["job_id"]
                    for r in await raw.fetch(
                        _MEMBERS,
                        [r["id"] for r in rows],
                        [r["tenant"] for r in rows],
                        [r["queue"] for r in rows],
                        [prints[r["id"]].id for r in rows],
                        [r["status"] for r in rows],
                        [r["token"] for r in rows],
                        [r["updated_at"] for r in rows],
                    )
                }
                groups = self._groups([r for r in rows if r["id"] in counted], prints)
                if groups:
                    await raw.execute(_PATTERNS, *_columns(groups))
                done.counted += len(counted)
                done.patterns += len(groups)
        return rows

    @staticmethod
    def _groups(rows: list[Any], prints: dict[uuid.UUID, Fingerprint]) -> list[_Group]:
        """The page's counted jobs, one group per pattern; in key order, so that two
        collectors at once lock pattern rows in the same order."""
        groups: dict[tuple[str, str, str], _Group] = {}
        for r in rows:  # oldest first: the last one seen is the sample
            fp = prints[r["id"]]
            key = (r["tenant"], r["queue"], fp.id)
            at: datetime = r["updated_at"]
            sample = (r["error"] or "")[:MAX_SAMPLE]
            g = groups.get(key)
            if g is None:
                category = classify(fp.error_type, fp.head, status=r["status"]).value
                groups[key] = _Group(fp, r["tenant"], r["queue"], category, 1, at, at, r["id"], sample)
            else:
                g.count += 1
                g.first, g.last = min(g.first, at), max(g.last, at)
                g.sample_job, g.sample_error = r["id"], sample
        return [groups[k] for k in sorted(groups)]


def _columns(groups: list[_Group]) -> tuple[list[Any], ...]:
    return (
        [g.tenant for g in groups],
        [g.queue for g in groups],
        [g.fp.id for g in groups],
        [g.fp.job_type for g in groups],
        [g.fp.error_type for g in groups],
        [g.fp.message for g in groups],
        [g.category for g in groups],
        [g.count for g in groups],
        [g.first for g in groups],
        [g.last for g in groups],
        [g.sample_job for g in groups],
        [g.sample_error for g in groups],
    )
