"""The transition sink: what the engine did, carried into the store, in order.

Every transition a script makes writes an event to the queue's stream in the
same script (``lua/includes/emit.lua``), so the stream holds every step of
every job, atomically with the step. The sink reads it through a consumer
group (``sluice-store``): an entry is acknowledged only after the batch it
was in is committed to PostgreSQL, so a sink that crashes leaves its entries
pending, and the next one (or another API process, after ``CLAIM_IDLE_MS``)
applies them again. Applying is idempotent: a job row remembers the stream
id of the last event applied to it and takes only newer ones, and attempts
are keyed by their lease token.

Events name jobs by the engine's id. The API enqueues each job under the
engine idempotency key ``job:<uuid>``, which the engine keeps in the job's
record: the sink maps an engine id it has not seen to the store's id from
there (one pipelined read per batch), and writes the engine id on the row.
Jobs added to the queue without the API have no such key and are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import ResponseError
from sqlalchemy import text

if TYPE_CHECKING:
    from sluice.engine.queue import Queue
    from sluice.store.database import Database

log = logging.getLogger("sluice.store.sink")

GROUP = "sluice-store"
#: The engine idempotency key the API enqueues a job under.
ENGINE_KEY_PREFIX = "job:"
#: Pending entries of a consumer idle this long are taken over (its process died).
CLAIM_IDLE_MS = 30_000
#: Engine id -> store id, remembered for this many jobs.
_MAP_SIZE = 200_000

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


def engine_key(job_id: uuid.UUID) -> str:
    return f"{ENGINE_KEY_PREFIX}{job_id}"


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    s = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Patch:
    """What one batch does to one job: the last event's id and status, and the fields it set."""

    job: uuid.UUID
    engine_id: int
    ev: tuple[int, int] = (0, 0)
    status: str | None = None
    attempts: int | None = None
    result: Any = None
    has_result: bool = False
    error: str | None = None
    processed_at: datetime | None = None
    completed_at: datetime | None = None
    reset_attempts: bool = False
    token: int | None = None  # the lease token of the attempt running, once an 'active' was seen
    starts: list[dict[str, Any]] = field(default_factory=list)
    ends: list[dict[str, Any]] = field(default_factory=list)


class TransitionSink:
    """Applies a queue's events to the store. ``run()`` until stopped; ``step()`` once (tests)."""

    def __init__(
        self, queue: Queue, db: Database, *, consumer: str, batch: int = 1000, block_ms: int = 1000
    ) -> None:
        self.queue = queue
        self.db = db
        self.consumer = consumer
        self.batch = batch
        self.block_ms = block_ms
        self._ids: OrderedDict[int, uuid.UUID | None] = OrderedDict()
        self._group_ready = False
        self._pending_done = False
        #: events applied since start (for tests and metrics)
        self.applied = 0

    async def ensure_group(self) -> None:
        """The consumer group, from the stream's start (jobs may have been added before)."""
        try:
            await self.queue.redis.xgroup_create(self.queue.keys.events, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def run(self, stop: asyncio.Event) -> None:
        """Apply batches until ``stop`` is set; a failing batch is retried (its entries stay pending)."""
        failures = 0
        while not stop.is_set():
            try:
                await self.step()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:  # a database or Redis outage: keep trying, say so
                failures += 1
                self._pending_done = False  # what was read is pending: read it again first
                log.exception("store sink: a batch failed (try %d); its events stay pending", failures)
                await asyncio.sleep(min(0.1 * 2**failures, 5.0))

    async def step(self) -> int:
        """Read one batch (this consumer's pending entries first, then stale ones of dead
        consumers, then new ones), apply it, acknowledge it. Returns the events read."""
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
            self._group_ready = self._pending_done = False
            self._ids.clear()
            return 0

    async def _step(self) -> int:
        redis, key = self.queue.redis, self.queue.keys.events
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        if not self._pending_done:
            entries = await self._read("0")
            if not entries:
                self._pending_done = True
        if not entries:
            claimed: Any = await redis.xautoclaim(
                key, GROUP, self.consumer, min_idle_time=CLAIM_IDLE_MS, start_id="0-0", count=self.batch
            )
            entries = [e for e in claimed[1] if e[1]]
        if not entries:
            entries = await self._read(">", block=True)
        if not entries:
            return 0
        await self._apply(entries)
        await redis.xack(key, GROUP, *[e[0] for e in entries])
        self.applied += len(entries)
        return len(entries)

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
        events = []
        for sid, fields in entries:
            name = fields.get(b"ev", b"").decode()
            raw_id = fields.get(b"id", b"").decode()
            known = name in STATUS_AFTER or name in ATTEMPT_OUTCOME or name == "failed"
            if known and raw_id.isdigit():
                events.append((_stream_id(sid), name, int(raw_id), fields))
        if not events:
            return
        ids = await self._resolve({e[2] for e in events})
        patches: dict[int, _Patch] = {}
        for ev, name, engine_id, fields in events:
            job = ids.get(engine_id)
            if job is None:
                continue
            patch = patches.get(engine_id)
            if patch is None:
                patch = patches[engine_id] = _Patch(job, engine_id)
            _fold(patch, ev, name, fields)
        missing = [p for p in patches.values() if p.status == "COMPLETED" and not p.has_result]
        if missing:
            await self._results(missing)
        if patches:
            await self._write(list(patches.values()))

    async def _resolve(self, engine_ids: set[int]) -> dict[int, uuid.UUID]:
        """Store ids of engine ids: from memory, else from the engine's record of the job."""
        out: dict[int, uuid.UUID] = {}
        unknown = []
        for engine_id in engine_ids:
            if engine_id in self._ids:
                job = self._ids[engine_id]
                self._ids.move_to_end(engine_id)
                if job is not None:
                    out[engine_id] = job
            else:
                unknown.append(engine_id)
        if unknown:
            keys = self.queue.keys
            async with self.queue.redis.pipeline(transaction=False) as pipe:
                for engine_id in unknown:
                    pipe.hget(keys.job(str(engine_id)), "idem")
                idems = await pipe.execute()
            prefix = keys.idem_prefix + ENGINE_KEY_PREFIX
            for engine_id, idem in zip(unknown, idems, strict=True):
                job = None
                text_idem = idem.decode() if idem else ""
                if text_idem.startswith(prefix):
                    try:
                        job = uuid.UUID(text_idem[len(prefix) :])
                    except ValueError:
                        job = None
                self._ids[engine_id] = job
                if job is not None:
                    out[engine_id] = job
            while len(self._ids) > _MAP_SIZE:
                self._ids.popitem(last=False)
        return out

    async def _results(self, patches: list[_Patch]) -> None:
        """Results too large for the event, read from the job's record."""
        keys = self.queue.keys
        async with self.queue.redis.pipeline(transaction=False) as pipe:
            for p in patches:
                pipe.hget(keys.job(str(p.engine_id)), "result")
            values = await pipe.execute()
        for p, value in zip(patches, values, strict=True):
            if value is not None:
                p.result, p.has_result = orjson.loads(value), True

    async def _write(self, patches: list[_Patch]) -> None:
        now = datetime.now(UTC)
        rows = [
            {
                "id": p.job,
                "engine_id": p.engine_id,
                "queue": self.queue.name,
                "status": p.status,
                "attempts": p.attempts,
                "reset": p.reset_attempts,
                "result": orjson.dumps(p.result).decode() if p.has_result else None,
                "error": p.error,
                "processed_at": p.processed_at,
                "completed_at": p.completed_at,
                "ev_ms": p.ev[0],
                "ev_seq": p.ev[1],
                "now": now,
            }
            for p in patches
        ]
        starts = [s | {"job": p.job} for p in patches for s in p.starts]
        ends = [e | {"job": p.job} for p in patches for e in p.ends]
        async with self.db.sessions() as session, session.begin():
            await session.execute(_UPDATE, rows)
            if starts:
                await session.execute(_START, starts)
            if ends:
                await session.execute(_END, ends)


def _at(ev: tuple[int, int]) -> datetime:
    return datetime.fromtimestamp(ev[0] / 1000, UTC)


def _fold(p: _Patch, ev: tuple[int, int], name: str, fields: dict[bytes, bytes]) -> None:
    """One event into the job's patch (events come in stream order)."""
    at = _at(ev)
    p.ev = max(p.ev, ev)
    status = STATUS_AFTER.get(name)
    if status is not None:
        p.status = status
    get = fields.get
    if name == "active":
        attempt = int(get(b"attempt", b"0") or 0)
        token = int(get(b"token", b"0") or 0)
        p.attempts, p.token = attempt, token
        p.processed_at = p.processed_at or at
        worker = get(b"worker")
        p.starts.append(
            {"token": token, "attempt": attempt, "worker": worker.decode() if worker else None, "at": at}
        )
    elif name == "completed":
        p.completed_at = at
        if b"result" in fields:
            p.result, p.has_result = orjson.loads(fields[b"result"]), True
    elif name in ("failed", "dead"):
        p.error = fields.get(b"error", b"").decode(errors="replace")
    elif name in ("rejected", "exhausted"):
        p.error = fields.get(b"reason", b"").decode(errors="replace")
    elif name == "redriven":
        p.attempts, p.reset_attempts = 0, True
    outcome = ATTEMPT_OUTCOME.get(name)
    if outcome is not None:
        error = p.error if name == "failed" else None
        p.ends.append({"outcome": outcome, "error": error, "at": at, "token": p.token})


# Only a newer event moves a job: (ev_ms, ev_seq) is the last applied stream id.
_UPDATE = text(
    """
    UPDATE jobs SET
        engine_id = :engine_id,
        status = COALESCE(:status, status),
        attempts = CASE WHEN :reset THEN 0 ELSE COALESCE(:attempts, attempts) END,
        result = COALESCE(CAST(:result AS jsonb), result),
        error = COALESCE(:error, error),
        processed_at = COALESCE(processed_at, :processed_at),
        completed_at = COALESCE(:completed_at, completed_at),
        ev_ms = :ev_ms, ev_seq = :ev_seq,
        updated_at = :now
    WHERE id = :id AND queue = :queue AND (ev_ms, ev_seq) < (:ev_ms, :ev_seq)
    """
)
_START = text(
    """
    INSERT INTO job_attempts (job_id, token, attempt, worker, started_at)
    VALUES (:job, :token, :attempt, :worker, :at)
    ON CONFLICT (job_id, token) DO NOTHING
    """
)
# An attempt ends once: the latest one of the job that has not ended yet.
_END = text(
    """
    UPDATE job_attempts SET finished_at = :at, outcome = :outcome, error = :error
    WHERE job_id = :job AND finished_at IS NULL
      AND token = COALESCE(:token, (SELECT max(token) FROM job_attempts WHERE job_id = :job))
    """
)
