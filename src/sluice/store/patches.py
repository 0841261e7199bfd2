"""A job's patch: what a batch of the events stream does to the job's rows, and its write.

The sink (``store/sink.py``) reads a batch of events and folds each job's
into one :class:`Patch` (:func:`fold`): the last event's stream id and
status, the fields the events set, the attempts they began and ended.
:func:`write` applies a batch's patches in one transaction of three array
statements (``UPDATE ... FROM unnest``), whatever the batch's size; a row
takes only events newer than the last one applied to it, so writing a batch
twice is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from sluice.store.database import Database

#: The status each event leaves a job in (events not here leave it as it is).
STATUS_AFTER = {
    "added": "QUEUED",
    "active": "PROCESSING",
    "completed": "COMPLETED",
    "retrying": "FAILED",
    "dead": "DEAD_LETTER",
    "cancelled": "CANCELLED",
    "rejected": "REJECTED",
    "exhausted": "EXHAUSTED",
    "parked": "PARKED",
    "throttled": "QUEUED",
    "released": "QUEUED",
    "stalled": "QUEUED",
    "redriven": "QUEUED",
}
#: How an attempt ended, by the event that ended it.
ATTEMPT_OUTCOME = {
    "completed": "completed",
    "failed": "failed",
    "throttled": "throttled",
    "released": "released",
    "stalled": "lease lost",
    "cancelled": "cancelled",
}

#: An event's name, the status it leaves a job in and how it ends an attempt (None: neither).
Kind = tuple[str, str | None, str | None]
#: The events that change a row, by their name in the stream (``added`` does not: see the
#: sink's ``_prepare``).
APPLIED: dict[bytes, Kind] = {
    n.encode(): (n, STATUS_AFTER.get(n), ATTEMPT_OUTCOME.get(n))
    for n in (*STATUS_AFTER, *ATTEMPT_OUTCOME, "failed")
    if n != "added"
}


@dataclass(slots=True)
class Patch:
    """What one batch does to one job: the last event's id and status, and the fields it set."""

    #: the store id, as text (asyncpg parses it in C); sorted as text, it sorts as the UUIDs do
    job: str
    #: the id the engine knows the job by: the same, but for a job an earlier version enqueued
    engine: str
    ev: tuple[int, int] = (0, 0)
    status: str | None = None
    attempts: int | None = None
    result: Any = None
    has_result: bool = False
    error: str | None = None
    #: times as the events' stream ids have them (ms): PostgreSQL makes them timestamps, at a
    #: fraction of what a ``datetime`` per event cost here
    processed_at: int | None = None
    completed_at: int | None = None
    reset_attempts: bool = False
    token: int | None = None  # the lease token of the attempt running, once an 'active' was seen
    #: (token, attempt, worker, at) of each attempt begun, and (token, outcome, error, at) of
    #: each ended: tuples, not a dict per event (the collector untracks them, and they cost less)
    starts: list[tuple[int, int, str | None, int]] = field(default_factory=list)
    ends: list[tuple[int | None, str, str | None, int]] = field(default_factory=list)


def fold(p: Patch, sid: bytes, kind: Kind, fields: dict[bytes, bytes]) -> None:
    """One event into the job's patch (events come in stream order)."""
    name, status, outcome = kind
    text_ms, _, text_seq = sid.partition(b"-")
    at = int(text_ms)
    ev = (at, int(text_seq or 0))
    p.ev = max(p.ev, ev)
    if status is not None:
        p.status = status
    get = fields.get
    if name == "active":
        attempt = int(get(b"attempt", b"0") or 0)
        token = int(get(b"token", b"0") or 0)
        p.attempts, p.token = attempt, token
        p.processed_at = p.processed_at or at
        worker = get(b"worker")
        p.starts.append((token, attempt, worker.decode() if worker else None, at))
    elif name == "completed":
        p.completed_at = at
        if b"result" in fields:
            p.result, p.has_result = orjson.loads(fields[b"result"]), True
    elif name in ("failed", "dead"):
        p.error = get(b"error", b"").decode(errors="replace")
    elif name in ("rejected", "exhausted"):
        p.error = get(b"reason", b"").decode(errors="replace")
    elif name == "redriven":
        p.attempts, p.reset_attempts = 0, True
    if outcome is not None:
        p.ends.append((p.token, outcome, p.error if name == "failed" else None, at))


def by_job(p: Patch) -> str:
    return p.job


async def write(db: Database, patches: list[Patch]) -> None:
    """One transaction, three statements whatever the batch's size: every column as an
    array (``unnest``), through asyncpg itself. Row by row (executemany) costs PostgreSQL
    a statement per job, more CPU than a fast drain has to spend."""
    now = datetime.now(UTC)
    rows = (
        [p.job for p in patches],
        [p.status for p in patches],
        [p.attempts for p in patches],
        [p.reset_attempts for p in patches],
        [orjson.dumps(p.result).decode() if p.has_result else None for p in patches],
        [p.error for p in patches],
        [p.processed_at for p in patches],
        [p.completed_at for p in patches],
        [p.ev[0] for p in patches],
        [p.ev[1] for p in patches],
        now,
    )
    async with db.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        async with raw.transaction():
            # Each row by its primary key, and by nothing else (a job id names one job in
            # one queue). Left to itself, PostgreSQL joins a batch's thousands of ids by
            # hashing the whole table (a sequential scan per batch, many times the index's
            # cost), a cost that grows with the table; and a condition on the queue, whose
            # rows its statistics had not seen yet, once made it read every row of the queue
            # per id instead.
            # The same for the attempts: never a scan of the table for a batch of keys.
            await raw.execute(
                "SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off; "
                "SET LOCAL enable_seqscan = off"
            )
            # Attempts only of the jobs the store holds: a job added to the queue without
            # the API has none. A row the batch did not move (it had newer events: a dead
            # sink's batch applied late) is looked up, which a drain never needs.
            held = {r[0] for r in await raw.fetch(_UPDATE, *rows)}
            stale = [p.job for p in patches if p.job not in held]
            if stale:
                held.update(r[0] for r in await raw.fetch(_HELD, stale))
            starts, ends = _attempts([p for p in patches if p.job in held])
            # Ends of attempts begun in earlier batches first: one that names no token
            # ends the job's latest attempt, which must not yet be one this batch begins.
            for chunk in _without_repeats(ends):
                job, token, outcome, error, at = (list(column) for column in zip(*chunk, strict=True))
                await raw.execute(_END, job, token, outcome, error, at)
            if starts:
                job, *columns = (list(column) for column in zip(*starts, strict=True))
                await raw.execute(_START, job, *columns)


#: An attempt begun: (job, token, attempt, worker, started, finished, outcome, error).
_Start = list[Any]
#: An attempt's end: (job, token, outcome, error, at).
_End = tuple[str, int | None, str, str | None, int]


def _attempts(patches: list[Patch]) -> tuple[list[_Start], list[_End]]:
    """The attempts a batch starts (those it also ends carry their end: one row written once,
    not an INSERT then an UPDATE), and the ends of attempts started in earlier batches."""
    starts: list[_Start] = []
    ends: list[_End] = []
    seen: set[tuple[str, int]] = set()
    for p in patches:
        job = p.job
        # One row per (job, token) in a statement: ON CONFLICT DO UPDATE refuses to change a
        # row twice (two engine copies of one stored job would each bring their token 1).
        begun: dict[int, _Start] = {}
        for token, attempt, worker, at in p.starts:
            if token in begun or (job, token) not in seen:  # (the last start of a token wins)
                begun[token] = [job, token, attempt, worker, at, None, None, None]
                seen.add((job, token))
        for ended, outcome, error, at in p.ends:
            start = begun.get(ended) if ended is not None else None
            if start is not None and start[5] is None:
                start[5:] = (at, outcome, error)
            else:
                ends.append((job, ended, outcome, error, at))
        starts += begun.values()
    return starts, ends


def _without_repeats(ends: list[_End]) -> list[list[_End]]:
    """The attempt ends in statements where no job appears twice: one UPDATE changes a row at
    most once, and a job whose two attempts ended in one batch must end the first first."""
    chunks: list[list[_End]] = []
    seen: list[set[str]] = []
    for end in ends:
        job = end[0]
        index = 0
        while index < len(chunks) and job in seen[index]:
            index += 1
        if index == len(chunks):
            chunks.append([])
            seen.append(set())
        chunks[index].append(end)
        seen[index].add(job)
    return chunks


# Only a newer event moves a job: (ev_ms, ev_seq) is the last applied stream id.
_UPDATE = """
UPDATE job_states AS j SET
    status = COALESCE(d.status, j.status),
    attempts = CASE WHEN d.reset THEN 0 ELSE COALESCE(d.attempts, j.attempts) END,
    result = COALESCE(d.result::jsonb, j.result),
    error = COALESCE(d.error, j.error),
    processed_at = COALESCE(j.processed_at, to_timestamp(d.processed_at / 1000.0)),
    completed_at = COALESCE(to_timestamp(d.completed_at / 1000.0), j.completed_at),
    ev_ms = d.ev_ms, ev_seq = d.ev_seq,
    updated_at = $11
FROM unnest($1::uuid[], $2::text[], $3::int[], $4::bool[], $5::text[], $6::text[],
            $7::bigint[], $8::bigint[], $9::bigint[], $10::bigint[])
     AS d(id, status, attempts, reset, result, error, processed_at, completed_at, ev_ms, ev_seq)
WHERE j.id = d.id AND (j.ev_ms, j.ev_seq) < (d.ev_ms, d.ev_seq)
RETURNING j.id::text
"""
_HELD = "SELECT id::text FROM job_states WHERE id = ANY($1::uuid[])"
# An attempt written again (a batch applied twice) keeps the end it has; it takes one it lacks.
_START = """
INSERT INTO job_attempts (job_id, token, attempt, worker, started_at, finished_at, outcome, error)
SELECT job_id, token, attempt, worker, to_timestamp(started / 1000.0), to_timestamp(finished / 1000.0),
       outcome, error
FROM unnest($1::uuid[], $2::bigint[], $3::int[], $4::text[], $5::bigint[], $6::bigint[], $7::text[],
            $8::text[]) AS d(job_id, token, attempt, worker, started, finished, outcome, error)
ON CONFLICT (job_id, token) DO UPDATE
    SET finished_at = EXCLUDED.finished_at, outcome = EXCLUDED.outcome, error = EXCLUDED.error
    WHERE job_attempts.finished_at IS NULL AND EXCLUDED.finished_at IS NOT NULL
"""
# An attempt ends once: the latest one of the job that has not ended yet.
_END = """
UPDATE job_attempts AS a SET finished_at = to_timestamp(d.at / 1000.0), outcome = d.outcome, error = d.error
FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[], $5::bigint[])
     AS d(job, token, outcome, error, at)
WHERE a.job_id = d.job AND a.finished_at IS NULL
  AND a.token = COALESCE(d.token, (SELECT max(token) FROM job_attempts WHERE job_id = d.job))
"""
