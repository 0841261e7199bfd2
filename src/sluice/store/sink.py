"""The transition sink: what the engine did, carried into the store, in order.

Every transition a script makes writes an event to the queue's stream in the
same script (``lua/includes/emit.lua``), so the stream holds every step of
every job, atomically with the step. The sink reads it through a consumer
group (``sluice-store``): an entry is acknowledged only after the batch it
was in is committed to PostgreSQL, so a sink that crashes leaves its entries
pending, and the next one (or another API process, after ``CLAIM_IDLE_MS``)
applies them again. Applying is idempotent: a job's state row remembers the stream
id of the last event applied to it and takes only newer ones, and attempts
are keyed by their lease token. What a batch does to each job, and the
statements that write it, are ``store/patches.py``'s.

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
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import ResponseError

from sluice.store.patches import APPLIED, Patch, by_job, fold, write

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
        #: them as they trickle in cost three round trips per event or two (a large share of a
        #: busy API process; docs/decisions/0011), for a store at most this much later
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
        each other's row locks (and deadlock, in opposite orders), so the store would
        keep up at a fraction of the rate of one sink. The lease lasts
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
        the sink's Python and PostgreSQL work at once (one after the other, the store's
        rate is bounded by the inverse of their sum). Writes stay in order, one at a time.
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
        nobody, a cost that grows with the group's pending entries.
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

    async def _commit(self, entries: list[tuple[bytes, dict[bytes, bytes]]], patches: list[Patch]) -> None:
        if patches:
            await write(self.db, patches)
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
            await write(self.db, patches)

    async def _prepare(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Patch]:
        """What a batch does to each job it names, in job id order (two writers, as when a
        lease just changed hands, then lock rows alike). ``added`` writes nothing: the API
        stored the row as QUEUED before it enqueued (this halves the store's writes while jobs
        pour in)."""
        events = []
        numbered = set()
        applied, match = APPLIED, _STORE_ID.match
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
        patches: dict[bytes, Patch] = {}
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
                patch = patches[raw_id] = Patch(job, engine)
            fold(patch, sid, kind, fields)
        missing = [p for p in patches.values() if p.status == "COMPLETED" and not p.has_result]
        if missing:
            await self._results(missing)
        return sorted(patches.values(), key=by_job)

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

    async def _results(self, patches: list[Patch]) -> None:
        """Results too large for the event, read from the job's record."""
        keys = self.queue.keys
        async with self.queue.redis.pipeline(transaction=False) as pipe:
            for p in patches:
                pipe.hget(keys.job(p.engine), "result")
            values = await pipe.execute()
        for p, value in zip(patches, values, strict=True):
            if value is not None:
                p.result, p.has_result = orjson.loads(value), True
