"""The pump: the one coroutine that talks to the dispatch script, over a wire of its own.

Each call hands over every outcome finished since the last call and asks for
as many new jobs as there are free slots, so under load one round trip
serves a whole batch of jobs, and when idle an outcome is sent the moment it
exists. While idle, the waker blocks on the queue's wake marker (BZPOPMIN),
and the pump keeps a timer for the next delayed job it knows of.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import MovedError, NoScriptError

from sluice.engine.clock import now_ms
from sluice.engine.connection import MAX_BLOCK, REROUTE_ERRORS, server_for
from sluice.engine.protocol import StepReply
from sluice.engine.retrying import TRANSIENT, pause_after
from sluice.engine.transport import describe, server_url
from sluice.engine.wireformat import CREATED, DUE, ID, LEASED_FIELDS, PRIORITY, TOKEN

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.connection import AbstractConnection
    from redis.commands.core import AsyncScript

    from sluice.engine.attempts import Attempts
    from sluice.engine.protocol import Outcome
    from sluice.engine.queue import Queue
    from sluice.engine.sketch import LatencyRecorder

log = logging.getLogger("sluice.worker")

try:  # hiredis comes with redis[hiredis]; pack_command is in hiredis >= 2.1
    import hiredis

    _PACK: Callable[[tuple[Any, ...]], bytes] | None = hiredis.pack_command
except (ImportError, AttributeError):  # pragma: no cover - redis-py packs instead
    _PACK = None

#: Outcomes handed in per dispatch call (each is script work: bounded per call).
STEP_OUTCOMES = 16


class _Call:
    """One dispatch call: kept until Redis answers it, and sent again as it was."""

    __slots__ = ("id", "outcomes", "tries", "want")

    def __init__(self, call_id: str, outcomes: list[Outcome], want: int) -> None:
        self.id = call_id
        self.outcomes = outcomes
        self.want = want
        self.tries = 0


class Wire:
    """A connection of the pump's own, for the dispatch script and nothing else.

    The pump sends one call at a time, so it needs no pool: talking to a
    redis-py Connection directly skips the pool's lock and condition, the
    client's retry wrapper and its event hooks, and the command is packed by
    hiredis in C (redis-py's asyncio packer costs about a microsecond per
    argument, and a call carries 6 per finished job). The connection (TCP,
    unix or TLS, with auth and db) is built from the client's own pool
    settings, or on a Redis Cluster from those of the master that owns the
    queue's slot, found at the first call (connection.server_for). It
    reconnects on the next call after any error, and after one that may mean
    the slot moved (MOVED, ASK, a broken connection) it looks for the master
    again; the pump then retries with its outcomes kept (a MOVED call was not
    applied; any other is fenced by its lease tokens).
    """

    def __init__(self, redis: Redis, script: AsyncScript) -> None:
        self._redis = redis
        self._conn: AbstractConnection | None = None
        self._stale = False
        self._script = script
        self.sent = False

    async def _connection(self, key: str) -> AbstractConnection:
        if self._conn is None:
            connection_class, kwargs = await server_for(self._redis, key, refresh=self._stale)
            self._conn = connection_class(**kwargs)
            self._stale = False
        return self._conn

    async def call(self, keys: list[str], args: list[Any]) -> Any:
        #: whether the script call reached the socket (if not, it cannot have run)
        self.sent = False
        for attempt in (1, 2):
            conn = await self._connection(keys[0])  # every key of a queue is in one slot
            try:
                return await self._call(conn, keys, args)
            except BaseException as exc:
                # A reply may be half read (or not read): the next call must not see it.
                await conn.disconnect()
                if not isinstance(exc, REROUTE_ERRORS):
                    raise
                self._conn = None
                self._stale = True
                # A MOVED call was not run: send it again at once, to the slot's new master.
                if attempt == 2 or not isinstance(exc, MovedError):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call(self, conn: AbstractConnection, keys: list[str], args: list[Any]) -> Any:
        try:
            await _send(conn, "EVALSHA", self._script.sha, len(keys), *keys, *args)
            self.sent = True
            return await conn.read_response()
        except NoScriptError:  # Redis restarted or its scripts were flushed
            await _send(conn, "SCRIPT", "LOAD", self._script.script)
            await conn.read_response()
            await _send(conn, "EVALSHA", self._script.sha, len(keys), *keys, *args)
            self.sent = True
            return await conn.read_response()

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.disconnect()


async def _send(conn: AbstractConnection, *args: Any) -> None:
    await conn.send_packed_command(_PACK(args) if _PACK is not None else conn.pack_command(*args))


class Pump:
    """Hands outcomes in and takes jobs out, one dispatch call at a time."""

    def __init__(
        self, queue: Queue, attempts: Attempts, *, worker_id: str, lease_ms: int, latency: LatencyRecorder
    ) -> None:
        self.queue = queue
        self.keys = queue.keys
        self.attempts = attempts
        self.wid = worker_id
        self.concurrency = attempts.concurrency
        self.lease_ms = lease_ms
        self.latency = latency
        self.lag = attempts.lag
        #: the dispatch call sent and not yet answered (sent again as it was after an error)
        self._pending: _Call | None = None
        self._calls = 0
        #: request ids are unique per process: a restarted worker reuses its worker id
        self._call_prefix = secrets.token_hex(4) + "-"
        self.idle = asyncio.Event()
        #: there may be jobs to take (a marker was popped, a batch came back full)
        self.more = True
        self.next_due = -1
        self.closing = False
        self.wire = Wire(queue.redis, queue.scripts.dispatch)
        #: loop time after which, once no handler runs, outcomes Redis would not take are dropped
        self.give_up_at: float | None = None
        #: (job id, token) of each running attempt -> [dispatch, created, runnable since,
        #: priority] (ms, Redis's clock; runnable since: the job's due time, else its creation)
        self._timing: dict[tuple[str, Any], list[int]] = {}

    def wake(self) -> None:
        """Look for jobs now (some came back to waiting)."""
        self.more = True
        self.attempts.kick.set()

    def unsent(self) -> list[Outcome]:
        """Outcomes Redis has not confirmed: the call in flight's, then those waiting."""
        pending = self._pending.outcomes if self._pending is not None else []
        return [*pending, *self.attempts.done]

    def free_slots(self) -> int:
        """Jobs this worker would take now: none while stopping, and a finished job holds its
        slot until its outcome is handed in (with at most STEP_OUTCOMES outcomes per call,
        taking a new job per finished one would let outcomes, and the leases renewed for
        them, pile up without bound under short jobs)."""
        attempts = self.attempts
        if attempts.stopping:
            return 0
        waiting_outcomes = len(attempts.done) + (len(self._pending.outcomes) if self._pending else 0)
        return max(self.concurrency - len(attempts.running) - waiting_outcomes, 0)

    async def run(self) -> None:
        """Serve until stopping with no handler left (or past the grace, Redis away)."""
        attempts = self.attempts
        kick = attempts.kick
        failures = 0
        while True:
            kick.clear()
            free = self.free_slots()
            if attempts.done or self._pending is not None or (free > 0 and self.more):
                try:
                    await self._step(free)
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - keep serving; outcomes are kept
                    failures += 1
                    if self._must_give_up():
                        self._abandon(exc)
                        return
                    await pause_after(
                        "dispatch",
                        exc,
                        failures,
                        worker_id=self.wid,
                        lease_ms=self.lease_ms,
                        redis=self.queue.redis,
                        wake=kick,
                    )
                continue
            if attempts.stopping and not attempts.running:
                return
            if free <= 0:
                await kick.wait()
                continue
            # Idle with free slots: the waker listens for new work on Redis, and
            # a local timer covers the next delayed job this worker knows of.
            self.idle.set()
            due_in = (self.next_due - now_ms()) / 1000 if self.next_due >= 0 else None
            if due_in is None:
                await kick.wait()
            else:
                try:
                    async with asyncio.timeout(max(due_in, 0.0)):  # not wait_for: see cancel_safe.py
                        await kick.wait()
                except TimeoutError:
                    self.more = True
            self.idle.clear()

    def _must_give_up(self) -> bool:
        """Stopping, no handler left, and past the grace (or told twice): Redis will not take
        the outcomes in time, and waiting for it would keep the process alive for ever."""
        loop = asyncio.get_running_loop()
        return (
            self.attempts.stopping
            and not self.attempts.running
            and self.give_up_at is not None
            and loop.time() >= self.give_up_at
        )

    def _abandon(self, exc: BaseException) -> None:
        ids = [outcome[0] for outcome in self.unsent()]
        error = describe(exc)
        log.error(
            "worker %s stopped without reporting %d outcome(s), as Redis at %s did not take them "
            "(%s); jobs %s run again once their leases expire",
            self.wid,
            len(ids),
            server_url(self.queue.redis),
            error,
            ", ".join(ids),
            extra={"worker_id": self.wid, "job_ids": ids, "error": error},
        )

    async def _step(self, free: int) -> None:
        attempts = self.attempts
        if self._pending is None:
            # A bounded batch per call (each outcome is script work); the rest go next call.
            batch = attempts.done[:STEP_OUTCOMES]
            attempts.done = attempts.done[STEP_OUTCOMES:]
            self._calls += 1
            self._pending = _Call(f"{self._call_prefix}{self._calls}", batch, free)
        # A call whose reply was lost is sent again as it was, same request id: the
        # script then answers what it did the first time (the leases it made, the
        # codes of the outcomes it took) rather than doing it twice.
        call = self._pending
        if call.want > 0:
            # This step consumes "more". The waker may set it again while the
            # call is in flight (a job added after the script ran); that signal
            # must survive, or the worker sleeps on a marker already popped.
            self.more = False
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            _, keys, args = self.queue.core.commands.dispatch(
                want=call.want,
                lease_ms=self.lease_ms,
                worker_id=self.wid,
                outcomes=call.outcomes,
                request_id=call.id,
            )
            reply = StepReply.parse(await self.wire.call(keys, args))
        except BaseException:
            if not self.wire.sent:
                # Never reached Redis, so it did nothing: its outcomes wait with the
                # others, and the next call is a new one (a stopping worker with
                # nothing to report can then stop at once).
                attempts.done[:0] = call.outcomes
                self._pending = None
            else:
                call.tries += 1
            if call.want > 0:
                self.more = True
            raise
        self._pending = None
        await self._answered(call, reply, late=loop.time() - sent > self.lease_ms / 3000)

    async def _answered(self, call: _Call, reply: StepReply, *, late: bool) -> None:
        """Act on a dispatch reply: log refused outcomes, keep the timer, start the jobs."""
        attempts = self.attempts
        attempts.epoch = reply.epoch
        now = reply.now
        self._record_latency(call.outcomes, reply.codes, now)
        for outcome, code in zip(call.outcomes, reply.codes, strict=True):
            if code <= 0:
                log.warning(
                    "outcome refused for job %s: its lease was lost (the job was reaped and "
                    "may run again) (worker %s)",
                    outcome[0],
                    self.wid,
                    extra={"worker_id": self.wid, "job_id": outcome[0], "code": code},
                )
        # next_due is on Redis's clock: kept as this host's time, through the reply's now.
        self.next_due = now_ms() + reply.next_due - now if reply.next_due >= 0 else -1
        jobs = reply.jobs
        if jobs:
            self.lag.reply(now)
        if call.want > 0 and len(jobs) // LEASED_FIELDS >= call.want:
            self.more = True  # a full batch: there may be more waiting
        if call.tries or late:
            # Leased long ago (a lost reply, or this process was paused): some leases may
            # have expired and their jobs run elsewhere; only those still ours start.
            jobs = await self._still_leased(jobs)
        start, timing = attempts.start, self._timing
        for i in range(0, len(jobs), LEASED_FIELDS):
            f = jobs[i : i + LEASED_FIELDS]
            if attempts.stopping:  # leased while stopping (a call sent again): back to waiting
                attempts.release(f[ID].decode(), f[TOKEN])
            elif start(f, now):
                timing[(f[ID].decode(), f[TOKEN])] = [now, *_runnable_since(f), _priority(f)]

    def _record_latency(self, outcomes: list[Outcome], codes: list[int], now: int) -> None:
        """Bin the durations of the attempts Redis has just taken the outcomes of.

        Only attempts that count (completed 1, retry scheduled 2, dead-lettered 3; not a
        release, a throttle, a cancel or a refused outcome) give a queue wait and a
        processing time; end to end is given once per job, by the attempt that ended it.
        Times are Redis's: dispatch is the leasing call's now, finish this call's now.
        """
        for outcome, code in zip(outcomes, codes, strict=True):
            timing = self._timing.pop((outcome[0], outcome[1]), None)
            if timing is None or code not in (1, 2, 3):
                continue
            dispatch, created, runnable, priority = timing
            self.latency.add("queue_wait", max(dispatch - runnable, 0), now, priority)
            self.latency.add("processing", max(now - dispatch, 0), now, priority)
            if code != 2:
                self.latency.add("end_to_end", max(now - created, 0), now, priority)

    async def _still_leased(self, jobs: list[Any]) -> list[Any]:
        """The leased jobs whose leases are still this worker's, each renewed."""
        groups = [jobs[i : i + LEASED_FIELDS] for i in range(0, len(jobs), LEASED_FIELDS)]
        if not groups:
            return jobs
        try:
            codes = await self.queue.protocol.extend(
                lease_ms=self.lease_ms, leases=[(f[ID].decode(), f[TOKEN]) for f in groups]
            )
        except Exception:  # noqa: BLE001 - the fence refuses a stale outcome anyway
            return jobs
        kept: list[Any] = []
        for f, code in zip(groups, codes, strict=True):
            if code in (1, 2):
                kept += f
            else:
                log.warning(
                    "worker %s: job %s is not started: its lease expired before the worker "
                    "could start it (the process was paused, or the reply came late)",
                    self.wid,
                    f[ID].decode(),
                    extra={"worker_id": self.wid, "job_id": f[ID].decode()},
                )
        return kept

    async def wake_loop(self, blocking: Any) -> None:
        """The waker: while the pump is idle, block on the queue's wake marker."""
        failures = 0
        while not self.closing:
            await self.idle.wait()
            try:
                marker = await blocking.bzpopmin(self.keys.wake, timeout=MAX_BLOCK)
                if marker is not None and self.free_slots() == 0:
                    # Taken while this worker filled up or began to stop (the read was
                    # sent while it was idle): it is another worker's call, put it back.
                    await self.queue.redis.zadd(self.keys.wake, {"w": 0})
                failures = 0
            except TRANSIENT as exc:
                failures += 1
                if not self.closing:
                    await pause_after(
                        "waiting for work",
                        exc,
                        failures,
                        worker_id=self.wid,
                        lease_ms=self.lease_ms,
                        redis=self.queue.redis,
                    )
            self.idle.clear()
            self.wake()


def _priority(f: list[Any]) -> int:
    """A leased job's priority (0 if its record holds none that reads as an integer)."""
    try:
        return int(f[PRIORITY]) if f[PRIORITY] else 0
    except ValueError:
        return 0


def _runnable_since(f: list[Any]) -> tuple[int, int]:
    """(created, runnable since) of a leased job: since its ``due`` (the end of its delay or of
    its retry's backoff) when it has one at or after its creation, else since its creation."""
    created = int(f[CREATED])
    try:
        due = int(float(f[DUE])) if f[DUE] else 0
    except ValueError:
        due = 0
    return created, due if due >= created else created
