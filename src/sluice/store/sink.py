"""The transition sink: what the engine did, carried into the store, in order.

Every transition a script makes writes an event to the queue's stream in the
same script (``lua/includes/emit.lua``), so the stream holds every step of
every job, atomically with the step. The sink reads it through a consumer
group (``sluice-store``): an entry is acknowledged only after the batch it
was in is committed to PostgreSQL, so a sink that crashes leaves its entries
pending, and the next one (or another API process, after ``CLAIM_IDLE_MS``)
applies them again. Applying is idempotent: a job's state row remembers the stream
id of the last event applied to it and takes only newer ones, and attempts
are keyed by their lease token.

Events name jobs by their id, which is the store's: the API enqueues each job
under its row's UUID. An event of a job the store does not hold (one added to
the queue without the API) changes no row, and its attempts are not written.
A job an earlier version enqueued has a number for its id; its record names
the engine idempotency key ``job:<uuid>``, through which such an event is
mapped to its row (one pipelined read per batch) until those jobs are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import ResponseError

if TYPE_CHECKING:
    from sluice.engine.queue import Queue
    from sluice.store.database import Database

log = logging.getLogger("sluice.store.sink")

GROUP = "sluice-store"
#: The engine idempotency key the API enqueues a job under.
ENGINE_KEY_PREFIX = "job:"
#: Pending entries of a consumer idle this long are taken over (its process died).
CLAIM_IDLE_MS = 30_000
#: How often the sink looks for such entries (s) when the last look found none.
CLAIM_EVERY_S = 5.0
#: How long the sink's lease lasts unless renewed (ms).
LEASE_MS = 10_000
# KEYS[1] the lease; ARGV[1] this sink; ARGV[2] ms. 1 if this sink holds it now (taken or renewed).
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
#: A store id as events carry it (a UUID's text, as ``str(uuid.UUID)`` writes it).
_STORE_ID = re.compile(rb"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
#: Numbered (earlier version's) ids mapped to store ids, remembered up to this many.
_LEGACY_MAP_SIZE = 100_000

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
_Kind = tuple[str, str | None, str | None]
#: The events that change a row, by their name in the stream (``added`` does not: see _prepare).
_APPLIED: dict[bytes, _Kind] = {
    n.encode(): (n, STATUS_AFTER.get(n), ATTEMPT_OUTCOME.get(n))
    for n in (*STATUS_AFTER, *ATTEMPT_OUTCOME, "failed")
    if n != "added"
}


async def caught_up(queue: Queue) -> bool:
    """Whether the sink has applied every event the queue still holds: its group was handed
    the stream's last entry and holds none unacknowledged (True with no group: no sink runs,
    so none is behind)."""
    redis, events = queue.redis, queue.keys.events
    try:
        groups: list[dict[str, Any]] = await redis.xinfo_groups(events)
        group = next((g for g in groups if _text(g["name"]) == GROUP), None)
        if group is None:
            return True
        last = (await redis.xinfo_stream(events)).get("last-entry")
    except ResponseError:  # no stream: nothing to apply
        return True
    if group["pending"]:
        return False
    # The last entry there is, not the last ever added: entries trimmed unread are lost, not due.
    return last is None or _stream_id(group["last-delivered-id"]) >= _stream_id(last[0])


async def sink_horizon(queue: Queue) -> int | None:
    """A time (ms) before which every event of the queue has been handed to the sink or trimmed
    from the stream unread: a transition older than this will not reach the store through the
    sink unless it already has. None: no sink reads this queue (nothing else will write it)."""
    redis, events = queue.redis, queue.keys.events
    try:
        groups: list[dict[str, Any]] = await redis.xinfo_groups(events)
        group = next((g for g in groups if _text(g["name"]) == GROUP), None)
        if group is None:
            return None
        info = await redis.xinfo_stream(events)
    except ResponseError:  # no stream at all
        return None
    delivered = _stream_id(group["last-delivered-id"])[0]
    first = info.get("first-entry")
    oldest = _stream_id(first[0])[0] if first else _stream_id(info["last-generated-id"])[0] + 1
    return max(delivered, oldest)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def engine_key(job_id: uuid.UUID) -> str:
    return f"{ENGINE_KEY_PREFIX}{job_id}"


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    if isinstance(raw, bytes):
        ms, _, seq = raw.partition(b"-")
        return int(ms), int(seq or 0)
    text_ms, _, text_seq = raw.partition("-")
    return int(text_ms), int(text_seq or 0)


@dataclass(slots=True)
class _Patch:
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


class TransitionSink:
    """Applies a queue's events to the store. ``run()`` until stopped; ``step()`` once (tests)."""

    def __init__(
        self,
        queue: Queue,
        db: Database,
        *,
        consumer: str,
        batch: int = 5000,
        block_ms: int = 1000,
        linger: float = 0.05,
    ) -> None:
        self.queue = queue
        self.db = db
        self.consumer = consumer
        self.batch = batch
        self.block_ms = block_ms
        #: after a batch well short of ``batch``, wait this long (s) for more events: reading
        #: them as they trickle in cost three round trips per event or two (at 1,500
        #: submissions/s, a quarter of an API process), for a store at most this much later
        self.linger = linger
        #: an earlier version's numbered id -> the store id (None: not a job of the API's)
        self._legacy: dict[bytes, str | None] = {}
        self._idem_prefix = queue.keys.idem_prefix + ENGINE_KEY_PREFIX
        self._group_ready = False
        self._pending_done = False
        self._next_claim = 0.0  # time.monotonic() of the next look for a dead consumer's entries
        self._leader_key = queue.keys.base + "sink-leader"
        self._lease = queue.redis.register_script(_LEASE)
        #: events applied since start (for tests and metrics)
        self.applied = 0
        #: the last batch's write to PostgreSQL, running while the next batch is read
        self._writing: asyncio.Task[None] | None = None

    async def ensure_group(self) -> None:
        """The consumer group, from the stream's start (jobs may have been added before)."""
        try:
            await self.queue.redis.xgroup_create(self.queue.keys.events, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def lead(self) -> bool:
        """Take or keep the queue's sink lease: whether this sink is the one that applies.

        One sink applies at a time. Two would share the stream's entries, so the
        events of one job would reach both, and their transactions would wait on
        each other's row locks (and deadlock, in opposite orders): measured, the
        store kept up at a fraction of the rate of one sink. The lease lasts
        ``LEASE_MS`` and is renewed by every step; another API process's sink
        takes over when it lapses, and claims the dead one's pending entries.
        """
        got = await self._lease(keys=[self._leader_key], args=[self.consumer, LEASE_MS])
        return bool(got)

    async def run(self, stop: asyncio.Event) -> None:
        """Apply batches until ``stop`` is set, while this sink holds the lease; a failing batch
        is retried (its entries stay pending). A batch read while the last one is written
        overlaps with it (``_step``); a stop lets that write finish, a cancel stops it."""
        try:
            await self._run(stop)
            with contextlib.suppress(Exception):  # pending if it failed: the next sink applies it
                await self.flush()
        finally:
            await self._drop_writing()

    async def _run(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                if not await self.lead():
                    self._next_claim = 0.0  # the one that held the lease may have died: look first
                    try:
                        async with asyncio.timeout(LEASE_MS / 2000):
                            await stop.wait()
                    except TimeoutError:
                        pass
                    continue
                read = await self.step()
                failures = 0
                if 0 < read < self.batch // 10 and self.linger > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.linger):
                            await stop.wait()
            except asyncio.CancelledError:
                raise
            except Exception:  # a database or Redis outage: keep trying, say so
                failures += 1
                await self._drop_writing()  # its entries stay pending, with those read after it
                self._pending_done = False  # what was read is pending: read it again first
                log.exception("store sink: a batch failed (try %d); its events stay pending", failures)
                await asyncio.sleep(min(0.1 * 2**failures, 5.0))

    async def step(self) -> int:
        """Read one batch (this consumer's pending entries first, then stale ones of dead
        consumers, then new ones) and start writing it, once the last batch's write is done;
        returns the events read. A step that reads nothing waits for the last write: steps
        until one returns 0 leave every event applied and acknowledged.

        The next batch is read and folded while the last one is written, so that
        the sink's Python and PostgreSQL work at once (measured: the drain's store
        rate was their sum's inverse). Writes stay in order, one at a time.
        """
        if not self._group_ready:
            await self.ensure_group()
        try:
            return await self._step()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis lost its data (the stream and the group with it): start again on the new
            # stream; what the old one held is the reconciler's to recover.
            log.warning("store sink: the events stream's consumer group is gone (Redis lost its data?)")
            await self._drop_writing()
            self._group_ready = self._pending_done = False
            self._legacy.clear()
            return 0

    async def _step(self) -> int:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        if not self._pending_done:
            await self.flush()  # what is being written is pending too: read it once, written
            entries = await self._read("0")
            if not entries:
                self._pending_done = True
        if not entries and time.monotonic() >= self._next_claim:
            entries = await self._claim()
            # Nothing of a dead consumer's: look again in a while, not at every step.
            self._next_claim = 0.0 if entries else time.monotonic() + CLAIM_EVERY_S
        if not entries:
            entries = await self._read(">", block=self._writing is None)
        if not entries:
            await self.flush()
            return 0
        patches = await self._prepare(entries)
        await self.flush()
        self._writing = asyncio.create_task(self._commit(entries, patches), name="sluice-sink-write")
        return len(entries)

    async def _claim(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Up to a batch of another consumer's entries, idle for ``CLAIM_IDLE_MS``, now this one's.

        The group's summary names the consumers that hold pending entries (a
        read of one counter per consumer); only another's are looked into, in
        its own list, by idle time. ``XAUTOCLAIM`` scanned the whole group's
        list instead, this sink's batch in flight included, while Redis served
        nobody: 21 ms a look during a drain.
        """
        redis, key = self.queue.redis, self.queue.keys.events
        summary: Any = await redis.xpending(key, GROUP)
        for consumer in summary.get("consumers") or ():
            name = _text(consumer["name"])
            if name == self.consumer or not int(consumer["pending"]):
                continue
            idle: Any = await redis.xpending_range(
                key, GROUP, "-", "+", self.batch, consumername=name, idle=CLAIM_IDLE_MS
            )
            if not idle:
                continue
            claimed: Any = await redis.xclaim(
                key, GROUP, self.consumer, CLAIM_IDLE_MS, [row["message_id"] for row in idle]
            )
            entries = [e for e in claimed if e and e[1]]
            if entries:
                return entries
        return []

    async def _drop_writing(self) -> None:
        """Stop the write in flight, if any: its entries stay pending, for the next read."""
        writing, self._writing = self._writing, None
        if writing is not None and not writing.done():
            writing.cancel()
        if writing is not None:
            with contextlib.suppress(BaseException):
                await writing

    async def flush(self) -> None:
        """Wait for the batch being written (raises what its write raised)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            await writing

    async def _commit(self, entries: list[tuple[bytes, dict[bytes, bytes]]], patches: list[_Patch]) -> None:
        if patches:
            await self._write(patches)
        await self.queue.redis.xack(self.queue.keys.events, GROUP, *[e[0] for e in entries])
        self.applied += len(entries)

    async def _read(self, start: str, *, block: bool = False) -> list[tuple[bytes, dict[bytes, bytes]]]:
        reply: Any = await self.queue.redis.xreadgroup(
            GROUP,
            self.consumer,
            {self.queue.keys.events: start},
            count=self.batch,
            block=self.block_ms if block else None,
        )
        if not reply:
            return []
        _, entries = reply[0]
        return [e for e in entries if e[1]]  # (an entry trimmed while pending reads as empty)

    # ---- applying ------------------------------------------------------------------------------------
    async def _apply(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """A batch applied at once (no overlap, no acknowledgement)."""
        patches = await self._prepare(entries)
        if patches:
            await self._write(patches)

    async def _prepare(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[_Patch]:
        """What a batch does to each job it names, in job id order (two writers, as when a
        lease just changed hands, then lock rows alike). ``added`` writes nothing: the API
        stored the row as QUEUED before it enqueued (this halves the store's writes while jobs
        pour in)."""
        events = []
        numbered = set()
        applied, match = _APPLIED, _STORE_ID.match
        for sid, fields in entries:
            kind = applied.get(fields.get(b"ev", b""))
            if kind is None:
                continue
            raw_id = fields.get(b"id")
            if raw_id is None:
                continue
            if match(raw_id) is None:
                if not raw_id.isdigit():
                    continue  # a caller's own id: not a job of the API's
                numbered.add(raw_id)
            events.append((sid, kind, raw_id, fields))
        if not events:
            return []
        legacy = await self._legacy_ids(numbered) if numbered else {}
        patches: dict[bytes, _Patch] = {}
        for sid, kind, raw_id, fields in events:
            patch = patches.get(raw_id)
            if patch is None:
                engine = raw_id.decode()
                if raw_id in numbered:
                    job = legacy.get(raw_id)
                    if job is None:
                        continue
                else:
                    job = engine
                patch = patches[raw_id] = _Patch(job, engine)
            _fold(patch, sid, kind, fields)
        missing = [p for p in patches.values() if p.status == "COMPLETED" and not p.has_result]
        if missing:
            await self._results(missing)
        return sorted(patches.values(), key=_by_job)

    async def _legacy_ids(self, numbered: set[bytes]) -> dict[bytes, str]:
        """Store ids of jobs an earlier version enqueued under numbers, from their records'
        engine idempotency keys (``job:<uuid>``); remembered, as such jobs drain away."""
        out: dict[bytes, str] = {}
        unknown = []
        for engine_id in numbered:
            if engine_id in self._legacy:
                known = self._legacy[engine_id]
                if known is not None:
                    out[engine_id] = known
            else:
                unknown.append(engine_id)
        if unknown:
            keys = self.queue.keys
            async with self.queue.redis.pipeline(transaction=False) as pipe:
                for engine_id in unknown:
                    pipe.hget(keys.job(engine_id.decode()), "idem")
                idems = await pipe.execute()
            if len(self._legacy) > _LEGACY_MAP_SIZE:
                self._legacy.clear()
            for engine_id, idem in zip(unknown, idems, strict=True):
                job = self._store_id(idem)
                self._legacy[engine_id] = job
                if job is not None:
                    out[engine_id] = job
        return out

    def _store_id(self, idem: bytes | None) -> str | None:
        """The store id in an engine idempotency key (None: not a key the API made)."""
        text_idem = idem.decode() if idem else ""
        if not text_idem.startswith(self._idem_prefix):
            return None
        try:
            return str(uuid.UUID(text_idem[len(self._idem_prefix) :]))
        except ValueError:
            return None

    async def _results(self, patches: list[_Patch]) -> None:
        """Results too large for the event, read from the job's record."""
        keys = self.queue.keys
        async with self.queue.redis.pipeline(transaction=False) as pipe:
            for p in patches:
                pipe.hget(keys.job(p.engine), "result")
            values = await pipe.execute()
        for p, value in zip(patches, values, strict=True):
            if value is not None:
                p.result, p.has_result = orjson.loads(value), True

    async def _write(self, patches: list[_Patch]) -> None:
        """One transaction, three statements whatever the batch's size: every column as an
        array (``unnest``), through asyncpg itself. Row by row (executemany) cost PostgreSQL
        about a millisecond of CPU per job, the whole budget of a fast drain."""
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
        async with self.db.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            async with raw.transaction():
                # Each row by its primary key, and by nothing else (a job id names one job in
                # one queue). Left to itself, PostgreSQL joins a batch's thousands of ids by
                # hashing the whole table (a sequential scan per batch: 124 ms of a
                # 2,500-job batch at 100,000 rows, 15 ms by the index), a cost that grows with
                # the table; and a condition on the queue, whose rows its statistics had not
                # seen yet, once made it read every row of the queue per id instead.
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


def _by_job(p: _Patch) -> str:
    return p.job


#: An attempt begun: (job, token, attempt, worker, started, finished, outcome, error).
_Start = list[Any]
#: An attempt's end: (job, token, outcome, error, at).
_End = tuple[str, int | None, str, str | None, int]


def _attempts(patches: list[_Patch]) -> tuple[list[_Start], list[_End]]:
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


def _fold(p: _Patch, sid: bytes, kind: _Kind, fields: dict[bytes, bytes]) -> None:
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
