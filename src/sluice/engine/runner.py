"""The worker's event loop machinery: one pump, and three helpers around it.

The pump is the only coroutine that talks to the dispatch script. Each call
hands over every outcome finished since the last call and asks for as many
new jobs as there are free slots, so under load one round trip serves a whole
batch of jobs, and when idle an outcome is sent the moment it exists.

Helpers:
* the waker blocks on the queue's wake marker (BZPOPMIN) while the pump is
  idle (the pump itself keeps a timer for the next delayed job it knows of);
* the renewer extends the leases of running jobs every third of a lease, and
  stops handlers whose lease was lost or whose cancellation was requested;
* the reaper returns jobs whose lease expired (their worker died) to waiting.

Beside them a small task flushes the latency bins of finished attempts about
once a second (engine/sketch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import random
import secrets
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import MovedError, NoScriptError, RedisError

from sluice.engine import tracehooks
from sluice.engine.backoff import Backoff
from sluice.engine.clock import now_ms, script_now
from sluice.engine.codec import decode, encode
from sluice.engine.connection import MAX_BLOCK, REROUTE_ERRORS, blocking_client, server_for
from sluice.engine.context import JobContext, set_current_job
from sluice.engine.eviction import warn_if_evicting
from sluice.engine.job import valid_trace_context
from sluice.engine.lag import REPORT_TTL_MS, SOON_INTERVAL_S, LagMeter
from sluice.engine.protocol import LEASED_FIELDS, StepReply
from sluice.engine.provider_view import ProviderView
from sluice.engine.sketch import FLUSH_INTERVAL, LatencyRecorder
from sluice.engine.transport import describe, server_url
from sluice.engine.watchdog import SyncDispatch, Watchdog
from sluice.errors import (
    AttemptTimeout,
    CorruptJobError,
    PayloadNotSerializable,
    PermanentError,
    RedisCommandError,
    RedisUnavailable,
    SluiceError,
    Throttled,
)
from sluice.probes import probe

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.connection import AbstractConnection
    from redis.commands.core import AsyncScript

    from sluice.engine.protocol import Outcome
    from sluice.engine.queue import Queue
    from sluice.engine.worker import Handler, Worker

log = logging.getLogger("sluice.worker")

try:  # hiredis comes with redis[hiredis]; pack_command is in hiredis >= 2.1
    import hiredis

    _PACK: Callable[[tuple[Any, ...]], bytes] | None = hiredis.pack_command
except (ImportError, AttributeError):  # pragma: no cover - redis-py packs instead
    _PACK = None

MAX_ERROR_BYTES = 8192
#: Expired leases returned per reap call (each call is one script: bounded work).
REAP_BATCH = 200
#: Finished jobs forgotten per trim call (retention.py), for the same reason.
TRIM_BATCH = 100
#: Outcomes handed in per dispatch call, for the same reason.
STEP_OUTCOMES = 16


class _Running:
    """One job this process is running (and, for the watchdog, a watchdog.Attempt)."""

    __slots__ = (
        "backoff",
        "ctx",
        "label",
        "started",
        "stop_reason",
        "sync",
        "task",
        "timed_out_at",
        "timeout",
        "token",
    )

    def __init__(
        self, ctx: JobContext, token: bytes, timeout: float | None, backoff: bytes, sync: bool
    ) -> None:
        self.ctx = ctx
        self.token = token
        self.timeout = timeout
        self.backoff = backoff
        #: a def handler, run in a thread
        self.sync = sync
        self.task: asyncio.Task[None] | None = None
        #: why the runner cancelled the task: lease_lost, cancel, release, timeout
        self.stop_reason: str | None = None
        #: time.monotonic() at start, and when its timeout fired (then the outcome is a timeout)
        self.started = 0.0
        self.timed_out_at: float | None = None
        #: the job type as metrics name it (set at start: 'unregistered' without a handler)
        self.label = ctx.name


class _Call:
    """One dispatch call: kept until Redis answers it, and sent again as it was."""

    __slots__ = ("id", "outcomes", "tries", "want")

    def __init__(self, call_id: str, outcomes: list[Outcome], want: int) -> None:
        self.id = call_id
        self.outcomes = outcomes
        self.want = want
        self.tries = 0


class _Wire:
    """A connection of the pump's own, for the dispatch script and nothing else.

    The pump sends one call at a time, so it needs no pool: talking to a
    redis-py Connection directly skips the pool's lock and condition, the
    client's retry wrapper and its event hooks, and the command is packed by
    hiredis in C (redis-py's asyncio packer spends about 1 µs per argument,
    and a call carries 6 per finished job). With short jobs that was a third
    of the worker's CPU per job (benchmarks/README.md). The connection (TCP,
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


class Runner:
    def __init__(self, worker: Worker, queue: Queue) -> None:
        self.worker = worker
        self.queue = queue
        self.keys = queue.keys
        self.wid = worker.worker_id
        self.concurrency = worker.concurrency
        self.lease_ms = int(worker.lease * 1000)
        self.running: dict[str, _Running] = {}
        self.done: list[Outcome] = []
        #: the dispatch call sent and not yet answered (sent again as it was after an error)
        self._pending: _Call | None = None
        self._calls = 0
        #: request ids are unique per process: a restarted worker reuses its worker id
        self._call_prefix = secrets.token_hex(4) + "-"
        #: the queue's epoch, as the last dispatch reply said (see JobContext.idempotency_key)
        self.epoch = ""
        self.kick = asyncio.Event()
        self.idle = asyncio.Event()
        self.more = True
        self.next_due = -1
        self.stopping = False
        self._closing = False
        self._wire = _Wire(queue.redis, queue.scripts.dispatch)
        self._grace_timer: asyncio.TimerHandle | None = None
        #: loop time after which, once no handler runs, outcomes Redis would not take are dropped
        self._give_up_at: float | None = None
        #: threads of the sync handlers, one per slot (made on first use)
        self._pool: ThreadPoolExecutor | None = None
        #: latency bins of finished attempts, flushed about once a second (engine/sketch.py)
        self.latency = LatencyRecorder(queue.keys, queue.scripts)
        #: dispatch-to-send delays of this worker's calls, reported for the pacer's headroom
        self.lag = LagMeter()
        #: what providers' answers said of their limits, for the queue's gates
        self.provider_view = ProviderView()
        #: (job id, token) of each running attempt -> [dispatch, created, runnable since] (ms,
        #: Redis's clock; runnable since: the job's due time, else its creation)
        self._timing: dict[tuple[str, Any], list[int]] = {}
        self._watchdog: Watchdog | None = None
        if worker.hard_grace is not None or worker.loop_block_warning is not None:
            self._watchdog = Watchdog(
                worker_id=self.wid,
                hard_grace=worker.hard_grace,
                loop_block_warning=worker.loop_block_warning,
                dispatch=SyncDispatch(queue, lease_ms=self.lease_ms, worker_id=self.wid),
                unsent=self._unsent,
                stop_taking_jobs=self._stop_taking_jobs,
            )

    def _stop_taking_jobs(self) -> None:
        """Called by the watchdog's thread before a hard stop: the pump leases no more."""
        self.stopping = True

    # ---- control ---------------------------------------------------------------------
    def request_stop(self, *, immediately: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if not self.stopping:
            self.stopping = True
            log.info(
                "worker stopping: %d running job(s) get %gs to finish (worker %s)",
                len(self.running),
                self.worker.shutdown_grace,
                self.wid,
                extra={
                    "worker_id": self.wid,
                    "in_flight": len(self.running),
                    "grace_s": self.worker.shutdown_grace,
                },
            )
            self._grace_timer = loop.call_later(self.worker.shutdown_grace, self._release_all)
            self._give_up_at = loop.time() + self.worker.shutdown_grace
        if immediately:
            self._release_all()
            self._give_up_at = loop.time()
        self.kick.set()

    def _release_all(self) -> None:
        for job in list(self.running.values()):
            self._stop_handler(job, "release")

    def _stop_handler(self, job: _Running, reason: str) -> None:
        """Cancel a handler, and again every 0.1 s until it has ended.

        On Python 3.11 a cancellation that lands while the handler is inside
        asyncio.wait_for (redis-py sends every command through it) can be lost;
        cancelling once would leave the handler running and the worker waiting.
        """
        if job.stop_reason is None:
            job.stop_reason = reason
        job.ctx.stop_requested = True  # what a sync handler, which cannot be cancelled, can see
        task = job.task
        if task is None or task.done():
            return
        task.cancel()
        asyncio.get_running_loop().call_later(0.1, self._stop_handler, job, reason)

    async def run(self) -> None:
        await warn_if_evicting(self.queue.redis)
        blocking = blocking_client(self.queue.redis, self.keys.wake)
        helpers = [
            asyncio.create_task(self._wake_loop(blocking), name="sluice-waker"),
            asyncio.create_task(self._renew_loop(), name="sluice-renewer"),
            asyncio.create_task(self._reap_loop(), name="sluice-reaper"),
            asyncio.create_task(self._latency_loop(), name="sluice-latency"),
            asyncio.create_task(self._lag_loop(), name="sluice-lag"),
        ]
        log.info(
            "worker %s serving queue %s at %s (%d at once; handlers: %s)",
            self.wid,
            self.queue.name,
            server_url(self.queue.redis),
            self.concurrency,
            ", ".join(sorted(self.worker.names)),
            extra={
                "worker_id": self.wid,
                "queue": self.queue.name,
                "concurrency": self.concurrency,
                "handlers": sorted(self.worker.names),
            },
        )
        if self._watchdog is not None:
            self._watchdog.start()
        try:
            await self._pump()
        finally:
            # First: the pump ends once no handler runs (unless run() itself was cancelled),
            # and a watchdog must not outlive its loop.
            if self._watchdog is not None:
                self._watchdog.stop()
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            if self._grace_timer is not None:
                self._grace_timer.cancel()
            # redis-py can swallow a cancellation that lands mid-read, so the
            # helpers also watch a flag, and the blocking socket is closed under
            # the waker.
            self._closing = True
            self.idle.set()
            for task in helpers:
                task.cancel()
            await blocking.connection_pool.disconnect(inuse_connections=True)
            done, stuck = await asyncio.wait(helpers, timeout=5)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    error = describe(task.exception())  # type: ignore[arg-type]
                    log.warning(
                        "worker %s: %s failed: %s",
                        self.wid,
                        task.get_name(),
                        error,
                        extra={"worker_id": self.wid, "helper": task.get_name(), "error": error},
                    )
            if stuck:
                names = [t.get_name() for t in stuck]
                log.warning(
                    "worker %s: %s did not stop in time",
                    self.wid,
                    ", ".join(names),
                    extra={"worker_id": self.wid, "helpers": names},
                )
            await blocking.aclose()
            await self._wire.close()
            # The bins of the last second: a graceful stop loses no sample.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self.latency.flush()
            with contextlib.suppress(Exception):
                await self._heartbeat(leaving=True)
            with contextlib.suppress(Exception):
                await self._report_lag(None)
            log.info("worker %s stopped", self.wid, extra={"worker_id": self.wid})

    # ---- the pump ----------------------------------------------------------------------
    async def _pump(self) -> None:
        failures = 0
        while True:
            self.kick.clear()
            free = self._free_slots()
            if self.done or self._pending is not None or (free > 0 and self.more):
                try:
                    await self._step(free)
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - keep serving; outcomes are kept
                    failures += 1
                    if self._must_give_up():
                        self._abandon(exc)
                        return
                    await self._backoff("dispatch", exc, failures, wake=self.kick)
                continue
            if self.stopping and not self.running:
                return
            if free <= 0:
                await self.kick.wait()
                continue
            # Idle with free slots: the waker listens for new work on Redis, and
            # a local timer covers the next delayed job this worker knows of.
            self.idle.set()
            due_in = (self.next_due - now_ms()) / 1000 if self.next_due >= 0 else None
            if due_in is None:
                await self.kick.wait()
            else:
                try:
                    async with asyncio.timeout(max(due_in, 0.0)):  # not wait_for: see cancel_safe.py
                        await self.kick.wait()
                except TimeoutError:
                    self.more = True
            self.idle.clear()

    def _must_give_up(self) -> bool:
        """Stopping, no handler left, and past the grace (or told twice): Redis will not take
        the outcomes in time, and waiting for it would keep the process alive for ever."""
        loop = asyncio.get_running_loop()
        return (
            self.stopping
            and not self.running
            and self._give_up_at is not None
            and loop.time() >= self._give_up_at
        )

    def _abandon(self, exc: BaseException) -> None:
        ids = [outcome[0] for outcome in self._unsent()]
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

    async def _backoff(
        self, what: str, exc: BaseException, failures: int, wake: asyncio.Event | None = None
    ) -> None:
        """Log the failure and wait before the next try (``wake`` cuts the wait short)."""
        # At most a quarter of a lease: once Redis is back, leases are renewed and
        # outcomes handed in before they expire.
        ceiling = min(5.0, self.lease_ms / 4000)
        delay = min(ceiling, 0.05 * 2 ** min(failures, 7)) * (0.5 + random.random() / 2)
        # A mapped error names the server itself; a raw one gets the URL added.
        error = (
            str(exc)
            if isinstance(exc, SluiceError)
            else f"Redis at {server_url(self.queue.redis)}: {describe(exc)}"
        )
        log.warning(
            "worker %s: %s failed (%s); retrying in %.2fs",
            self.wid,
            what,
            error,
            delay,
            extra={"worker_id": self.wid, "error": error, "retry_in_s": round(delay, 2)},
        )
        if wake is None:
            await asyncio.sleep(delay)
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await wake.wait()

    def _unsent(self) -> list[Outcome]:
        """Outcomes Redis has not confirmed: the call in flight's, then those waiting."""
        pending = self._pending.outcomes if self._pending is not None else []
        return [*pending, *self.done]

    async def _step(self, free: int) -> None:
        if self._pending is None:
            # A bounded batch per call (each outcome is script work); the rest go next call.
            batch = self.done[:STEP_OUTCOMES]
            self.done = self.done[STEP_OUTCOMES:]
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
            keys, args = self.queue.protocol.step_command(
                want=call.want,
                lease_ms=self.lease_ms,
                worker_id=self.wid,
                outcomes=call.outcomes,
                request_id=call.id,
            )
            reply = StepReply.parse(await self._wire.call(keys, args))
        except BaseException:
            if not self._wire.sent:
                # Never reached Redis, so it did nothing: its outcomes wait with the
                # others, and the next call is a new one (a stopping worker with
                # nothing to report can then stop at once).
                self.done[:0] = call.outcomes
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
        self.epoch = reply.epoch
        self._record_latency(call.outcomes, reply.codes, reply.now)
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
        self.next_due = now_ms() + reply.next_due - reply.now if reply.next_due >= 0 else -1
        jobs = reply.jobs
        if jobs:
            self.lag.reply(reply.now)
        if call.want > 0 and len(jobs) // LEASED_FIELDS >= call.want:
            self.more = True  # a full batch: there may be more waiting
        if call.tries or late:
            # Leased long ago (a lost reply, or this process was paused): some leases may
            # have expired and their jobs run elsewhere; only those still ours start.
            jobs = await self._still_leased(jobs)
        for i in range(0, len(jobs), LEASED_FIELDS):
            f = jobs[i : i + LEASED_FIELDS]
            if self.stopping:  # leased while stopping (a call sent again): back to waiting
                self.done.append((f[0].decode(), f[1], b"r", b"", 0, 0))
                self.kick.set()
            elif self._start(f, reply.now):
                self._timing[(f[0].decode(), f[1])] = [reply.now, *_runnable_since(f), _priority(f)]

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

    async def _latency_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(FLUSH_INTERVAL)
            try:
                await self.latency.flush()
            except _TRANSIENT as exc:
                _reraise_if_cancelled()
                # Dropped, not sent again: the call may have been applied (at most ~1 s lost).
                log.info(
                    "worker %s: latency samples of the last second dropped: %s",
                    self.wid,
                    describe(exc),
                    extra={"worker_id": self.wid, "error": describe(exc)},
                )

    async def _lag_loop(self) -> None:
        """Report the dispatch-to-send delays (engine/lag.py) and what providers said of their
        limits (engine/provider_view.py), each when there is something to say."""
        while not self._closing:
            await asyncio.sleep(SOON_INTERVAL_S)
            try:
                report = self.lag.report_due()
                seen = self.provider_view.take()
                if report is not None:
                    await self._report_lag(report)
                if seen:
                    await self.queue.scripts.observe(
                        keys=self.keys.flow, args=[script_now(None), *(a for r in seen for a in r.args())]
                    )
            except _TRANSIENT as exc:
                _reraise_if_cancelled()
                # The next report says it again; until then the last one holds.
                log.debug("worker %s: lag or limits report not sent: %s", self.wid, describe(exc))
            except Exception:
                log.exception("worker %s: the lag or limits report failed", self.wid)

    async def _report_lag(self, report: tuple[float, float] | None) -> None:
        """Report (lowest, highest) dispatch-to-send delay (ms), or withdraw with None."""
        k = self.keys
        lo, hi = report if report is not None else (0.0, 0.0)
        await self.queue.scripts.lag(
            keys=[k.control, k.lags, k.budget_prefix, k.budget_log_prefix],
            args=[script_now(None), self.wid, f"{lo:.3f}", f"{hi:.3f}", REPORT_TTL_MS, int(report is None)],
        )

    async def _still_leased(self, jobs: list[Any]) -> list[Any]:
        """The leased jobs whose leases are still this worker's, each renewed."""
        groups = [jobs[i : i + LEASED_FIELDS] for i in range(0, len(jobs), LEASED_FIELDS)]
        if not groups:
            return jobs
        try:
            codes = await self.queue.protocol.extend(
                lease_ms=self.lease_ms, leases=[(f[0].decode(), f[1]) for f in groups]
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
                    f[0].decode(),
                    extra={"worker_id": self.wid, "job_id": f[0].decode()},
                )
        return kept

    def _start(self, f: list[Any], dispatched_ms: int = 0) -> bool:
        """Start a leased job's handler; False if its record was unreadable (dead-lettered).
        ``dispatched_ms``: the leasing call's now (Redis's clock)."""
        job_id = f[0].decode()
        try:
            name = f[2].decode()
            timeout_ms = int(f[6])
            ctx = JobContext(
                self.queue.name,
                job_id,
                name,
                f[3],
                int(f[4]),
                int(f[5]),
                int(f[8]),
                self.wid,
                f[1],
                prefix=self.queue.prefix,
                epoch=self.epoch,
                tokens=int(f[9]),
                budget=f[10].decode() or None,
                correlation_id=f[11].decode() or None,
                trace_context=valid_trace_context(f[13].decode(errors="replace")) if f[13] else None,
                dispatched_ms=dispatched_ms,
                lag=self.lag,
                provider_view=self.provider_view,
            )
        except (ValueError, TypeError, AttributeError) as exc:
            # A record this version cannot read: dead-letter it with the reason
            # rather than let it stall and come back forever.
            error = CorruptJobError(job_id, f"unreadable fields at dispatch: {exc}")
            log.error(
                "worker %s: job %s dead-lettered: its record is unreadable (%s)",
                self.wid,
                job_id,
                exc,
                extra={"worker_id": self.wid, "job_id": job_id, "error": str(exc)},
            )
            # usage 0: no handler ran, so nothing can have reached the provider
            self.done.append((job_id, f[1], b"p", str(error).encode(), 0, 0))
            self.kick.set()
            return False
        timeout = timeout_ms / 1000 if timeout_ms > 0 else self.worker.timeout
        job = _Running(ctx, f[1], timeout, f[7], self.worker.is_sync(name))
        if self.worker.get_handler(name) is None:  # any string a producer sent: not a metric label
            job.label = "unregistered"
        job.started = time.monotonic()
        self.running[job_id] = job
        try:
            probe().attempt_started(job.label)
        except Exception:  # a metrics hook's own failure: the job runs all the same
            log.exception("worker: the metrics probe failed on job %s's start", job_id)
        if self._watchdog is not None:
            # Watched from now: if another job blocks the loop before this one's task
            # first runs, a hard stop still releases it.
            self._watchdog.watch(job)
        job.task = asyncio.create_task(self._execute(job, self.worker.get_handler(name)))
        job.task.add_done_callback(functools.partial(self._ended, job))
        return True

    async def _execute(self, job: _Running, handler: Handler | None) -> None:
        ctx = job.ctx
        set_current_job(ctx)  # this task's own context: the job's log lines carry it
        timer = None
        if job.timeout is not None:
            timer = asyncio.get_running_loop().call_later(job.timeout, self._time_out, job)
        # Opened on this task, so that the handler's own spans are children of the attempt's.
        traced = tracehooks.attempt_scope(ctx)
        outcome: tuple[bytes, bytes, int] | None = None
        try:
            outcome = await self._attempt(job, handler)
        except asyncio.CancelledError:
            outcome = self._stopped(job)
        finally:
            if timer is not None:
                timer.cancel()
            if self.running.get(ctx.id) is job:
                del self.running[ctx.id]
            self.kick.set()
            if traced is not None:
                tracehooks.close_attempt(traced, *_outcome_name(ctx, outcome))
        if outcome is not None:
            self.done.append((ctx.id, job.token, *outcome, ctx.usage))
        _ended_probe(job, outcome)
        if self._watchdog is not None:
            # After the outcome is queued: the watchdog always finds it in one place or the other.
            self._watchdog.unwatch(job)

    def _ended(self, job: _Running, _task: asyncio.Task[None]) -> None:
        """The job's task is done. Normally _execute has reported it; a task cancelled before
        it first ran never entered _execute, and is reported here as stopped."""
        if self.running.get(job.ctx.id) is job:
            del self.running[job.ctx.id]
            outcome = self._stopped(job)
            if outcome is not None:
                self.done.append((job.ctx.id, job.token, *outcome, job.ctx.usage))
            _ended_probe(job, outcome)
            self.kick.set()
        if self._watchdog is not None:
            self._watchdog.unwatch(job)

    @staticmethod
    def _stopped(job: _Running) -> tuple[bytes, bytes, int] | None:
        """The outcome of a handler the runner cancelled (it says why first); None: not reported."""
        reason = job.stop_reason or "release"
        return None if reason == "lease_lost" else _STOPPED.get(reason, _STOPPED["release"])

    def _time_out(self, job: _Running) -> None:
        """The attempt's timeout: cancel the handler (again until it ends). Whatever it does
        after, the attempt is a timeout, and the watchdog stops it past the hard grace."""
        job.timed_out_at = time.monotonic()
        self._stop_handler(job, "timeout")

    async def _attempt(  # noqa: PLR0911 - one return per outcome kind
        self, job: _Running, handler: Handler | None
    ) -> tuple[bytes, bytes, int]:
        """Run one attempt; returns (kind, value, retry in ms) for the dispatch script.

        Once its timeout has fired the attempt is a timeout, whatever the handler
        does after: ends cancelled, raises, or swallows the cancellation and
        returns a value (which is discarded, not reported as a success).
        """
        ctx = job.ctx
        if handler is None:
            error = (
                f"no handler named {ctx.name!r} on worker {self.wid} (it serves: "
                f"{', '.join(sorted(self.worker.names))})"
            )
            ctx.usage = 0  # no handler ran: nothing reached the provider
            return self._dead(ctx, error.encode())
        try:
            ctx.payload = decode(ctx.payload)
        except ValueError as exc:
            ctx.usage = 0
            return self._dead(ctx, str(CorruptJobError(ctx.id, f"payload is not JSON ({exc})")).encode())
        try:
            result = await (self._in_thread(job, handler) if job.sync else handler(ctx))
        except asyncio.CancelledError:
            if job.timed_out_at is None:
                raise
            return self._timed_out(job, None)
        except Exception as exc:  # noqa: BLE001 - any handler error is the job's failure
            if job.timed_out_at is not None:
                return self._timed_out(job, f"raised {describe(exc)}")
            return self._failed(ctx, exc, job.backoff)
        if job.timed_out_at is not None:
            return self._timed_out(job, "returned a value, which was discarded")
        if job.sync and inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()  # never awaited, on purpose: no warning for it
            error = (
                f"handler {ctx.name!r} is a plain function but returned an awaitable; declare it "
                "`async def` for the worker to await it"
            )
            return self._dead(ctx, error.encode())
        try:
            return b"c", encode(result, "result"), 0
        except PayloadNotSerializable as exc:
            return self._dead(ctx, _describe(exc))

    async def _in_thread(self, job: _Running, handler: Handler) -> Any:
        """Run a sync handler in a thread; the attempt lasts until the thread returns.

        A thread cannot be interrupted: stopped (timeout, cancel request, lost
        lease, shutdown), the handler sees ``job.stop_requested``, and the
        attempt keeps its slot and lease until it has returned, so at most
        ``concurrency`` handlers run and the pool (one thread per slot) never
        makes one wait. Its return (or error) is its outcome, unless its
        timeout fired; past the hard grace the watchdog ends the process.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"sluice-{self.wid}")
        call = contextvars.copy_context().run
        future = asyncio.get_running_loop().run_in_executor(self._pool, call, handler, job.ctx)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({future})
            return future.result()

    def _timed_out(self, job: _Running, after: str | None) -> tuple[bytes, bytes, int]:
        """The outcome of an attempt whose timeout fired; ``after``: what the handler did then."""
        ctx = job.ctx
        assert job.timeout is not None and job.timed_out_at is not None
        error = AttemptTimeout(job.timeout)
        if after is not None:
            late = time.monotonic() - job.timed_out_at
            # A thread cannot be cancelled: it only sees job.stop_requested.
            went_on = "'s thread went on past" if job.sync else " went on after it was cancelled at"
            note = f"the handler{went_on} its timeout, and {late:.2f}s later {after}"
            error.add_note(note)
            log.warning(
                "worker %s: job %s (%s) went on past its timeout of %gs: %s; the attempt counts as timed out",
                self.wid,
                ctx.id,
                ctx.name,
                job.timeout,
                note,
                extra={
                    "worker_id": self.wid,
                    "job_id": ctx.id,
                    "job_name": ctx.name,
                    "late_s": round(late, 3),
                },
            )
        return self._failed(ctx, error, job.backoff)

    def _failed(self, ctx: JobContext, exc: Exception, backoff: bytes) -> tuple[bytes, bytes, int]:
        """The outcome of an attempt whose handler raised ``exc``."""
        if isinstance(exc, PermanentError | PayloadNotSerializable):
            return self._dead(ctx, _describe(exc))
        if isinstance(exc, Throttled):
            log.info(
                "worker %s: job %s was throttled by its provider; the queue pauses for %gs "
                "and the job waits again",
                self.wid,
                ctx.id,
                exc.retry_after,
                extra={"worker_id": self.wid, "job_id": ctx.id, "retry_after_s": exc.retry_after},
            )
            # It came early by about the wait it was asked: the measured headroom takes that in.
            self.lag.throttled(exc.asked * 1000)
            return b"t", b"%d" % round(exc.retry_after * 1000), 0
        if ctx.attempt >= ctx.max_attempts:
            return self._dead(ctx, _describe(exc), kind=b"f")
        try:
            delay = Backoff.from_json(backoff).seconds(ctx.attempt)
        except (ValueError, TypeError):
            delay = 1.0
        error = describe(exc)
        log.warning(
            "worker %s: job %s (%s) attempt %d of %d failed, retrying in %.3fs: %s",
            self.wid,
            ctx.id,
            ctx.name,
            ctx.attempt,
            ctx.max_attempts,
            delay,
            error,
            extra={
                "worker_id": self.wid,
                "job_id": ctx.id,
                "job_name": ctx.name,
                "attempt": ctx.attempt,
                "retry_in_s": round(delay, 3),
                "error": error,
            },
        )
        return b"f", _describe(exc), int(delay * 1000)

    def _dead(self, ctx: JobContext, error: bytes, kind: bytes = b"p") -> tuple[bytes, bytes, int]:
        text = error[:300].decode(errors="replace").splitlines()[0] if error else ""
        log.error(
            "worker %s: job %s (%s) dead-lettered after attempt %d: %s",
            self.wid,
            ctx.id,
            ctx.name,
            ctx.attempt,
            text,
            extra={
                "worker_id": self.wid,
                "job_id": ctx.id,
                "job_name": ctx.name,
                "attempt": ctx.attempt,
                "error": text,
            },
        )
        return kind, error, 0

    # ---- helpers -----------------------------------------------------------------------
    def _free_slots(self) -> int:
        """Jobs this worker would take now: none while stopping, and a finished job holds its
        slot until its outcome is handed in (with at most STEP_OUTCOMES outcomes per call,
        taking a new job per finished one would let outcomes, and the leases renewed for
        them, pile up without bound under short jobs)."""
        if self.stopping:
            return 0
        waiting_outcomes = len(self.done) + (len(self._pending.outcomes) if self._pending else 0)
        return max(self.concurrency - len(self.running) - waiting_outcomes, 0)

    async def _wake_loop(self, blocking: Any) -> None:
        failures = 0
        while not self._closing:
            await self.idle.wait()
            try:
                marker = await blocking.bzpopmin(self.keys.wake, timeout=MAX_BLOCK)
                if marker is not None and self._free_slots() == 0:
                    # Taken while this worker filled up or began to stop (the read was
                    # sent while it was idle): it is another worker's call, put it back.
                    await self.queue.redis.zadd(self.keys.wake, {"w": 0})
                failures = 0
            except _TRANSIENT as exc:
                failures += 1
                if not self._closing:
                    await self._backoff("waiting for work", exc, failures)
            self.idle.clear()
            self.more = True
            self.kick.set()

    async def _renew_loop(self) -> None:
        interval = self.worker.lease / 3
        failures = 0
        while not self._closing:
            # The first heartbeat goes out at start, so a worker is visible at once.
            try:
                await self._heartbeat()
                await self._renew()
                failures = 0
            except _TRANSIENT as exc:
                _reraise_if_cancelled()
                failures += 1
                await self._backoff("lease renewal", exc, failures)
            await asyncio.sleep(interval)

    async def _heartbeat(self, *, leaving: bool = False) -> None:
        """Say this worker is alive (or leaving); it counts as gone after two silent leases."""
        description = orjson.dumps({"names": sorted(self.worker.names), "concurrency": self.concurrency})
        k = self.keys
        await self.queue.scripts.heartbeat(
            keys=[k.workers, k.alive, k.calls],
            args=[script_now(None), self.wid, description[:-1], 2 * self.lease_ms, 1 if leaving else 0],
        )

    async def _renew(self) -> None:
        # A handler told to stop keeps its lease until it has ended (a slow wind-down
        # must not turn a release into a stall); only a lost lease is let go.
        jobs = [j for j in self.running.values() if j.stop_reason != "lease_lost"]
        # Finished jobs whose outcomes Redis has not taken yet (it was away) keep their
        # leases too, or a short outage would turn every such job into a stall.
        unsent = [(o[0], o[1]) for o in self._unsent()]
        codes = await self.queue.protocol.extend(
            lease_ms=self.lease_ms, leases=[*((j.ctx.id, j.token) for j in jobs), *unsent]
        )
        for job, code in zip(jobs, codes, strict=False):
            if code == 1 or job.task is None or job.stop_reason in ("lease_lost", "cancel"):
                continue
            reason = "cancel" if code == 2 else "lease_lost"
            log.warning(
                "worker %s: stopping the handler of job %s (%s)",
                self.wid,
                job.ctx.id,
                "its cancellation was requested" if reason == "cancel" else "its lease was lost",
                extra={
                    "worker_id": self.wid,
                    "job_id": job.ctx.id,
                    "correlation_id": job.ctx.correlation_id,
                    "reason": reason,
                },
            )
            self._stop_handler(job, reason)

    async def _reap_loop(self) -> None:
        interval = self.worker.reap_interval
        failures = 0
        while not self._closing:
            await asyncio.sleep(interval * (0.75 + random.random() / 2))
            try:
                # Each call reaps a bounded batch; a full one means more may be expired.
                back = dead = 0
                while not self._closing:
                    more_back, more_dead = await self.queue.protocol.reap(limit=REAP_BATCH)
                    back, dead = back + more_back, dead + more_dead
                    if more_back + more_dead < REAP_BATCH:
                        break
                # Finished jobs past the queue's retention, a bounded batch per call too.
                while not self._closing:
                    _, more = await self.queue.protocol.trim(limit=TRIM_BATCH)
                    if not more:
                        break
                # Callers' budget holds whose time ran out (their callers crashed).
                swept = await self.queue.budgets.sweep()
                failures = 0
            except _TRANSIENT as exc:
                _reraise_if_cancelled()
                failures += 1
                await self._backoff("reaping", exc, failures)
                continue
            if back or dead:
                log.warning(
                    "worker %s: reaped expired leases (their workers died): %d back to waiting, "
                    "%d dead-lettered",
                    self.wid,
                    back,
                    dead,
                    extra={"worker_id": self.wid, "returned": back, "dead": dead},
                )
                self.more = True
                self.kick.set()
            if swept:
                log.warning(
                    "worker %s: swept %d budget holds nobody settled in time, as unknown outcomes "
                    "(their tokens stay charged): %s",
                    self.wid,
                    len(swept),
                    ", ".join(s.id for s in swept[:10]) + (" ..." if len(swept) > 10 else ""),
                    extra={"worker_id": self.wid, "swept": len(swept)},
                )


#: Errors a helper rides out with a backoff: Redis unreachable, slow, restarting or
#: refusing commands (out of memory); the marked queue calls raise them mapped.
_TRANSIENT = (RedisError, OSError, RedisUnavailable, RedisCommandError)

#: What a handler stopped by the runner reports: a cancel, or a release to waiting.
_STOPPED = {"cancel": (b"x", b"cancelled by request", 0), "release": (b"r", b"", 0)}
_OUTCOMES = {b"c": "completed", b"p": "dead", b"t": "throttled", b"x": "cancelled", b"r": "released"}


def _outcome_name(ctx: JobContext, outcome: tuple[bytes, bytes, int] | None) -> tuple[str, str | None]:
    """An attempt's outcome as a tracer names it, and the error it reports (if any)."""
    if outcome is None:
        return "lease_lost", None
    kind, value = outcome[0], outcome[1]
    if kind == b"f":
        name = "retry" if ctx.attempt < ctx.max_attempts else "dead"
    else:
        name = _OUTCOMES.get(kind, kind.decode(errors="replace"))
    error = value[:1000].decode(errors="replace") if kind in (b"f", b"p") else None
    return name, error


#: An attempt's outcome as metrics name it, by the dispatch script's kind.
_OUTCOME_LABELS = {
    b"c": "completed",
    b"f": "failed",
    b"p": "dead",
    b"o": "timed_out",
    b"r": "released",
    b"x": "cancelled",
    b"t": "throttled",
}


def _ended_probe(job: _Running, outcome: tuple[bytes, bytes, int] | None) -> None:
    """Tell the metrics how the attempt ended: a timeout as ``timed_out`` (the runner reports
    it as a failure), a failure with no attempt left as ``dead``. A probe that raises is
    logged, never lets the attempt's outcome go unreported."""
    if outcome is None:
        label = "lease_lost"
    elif job.timed_out_at is not None and outcome[0] in (b"f", b"o"):
        label = "timed_out"
    elif outcome[0] == b"f" and job.ctx.is_last_attempt:
        label = "dead"
    else:
        label = _OUTCOME_LABELS.get(outcome[0], "other")
    try:
        probe().attempt_ended(job.label, label, time.monotonic() - job.started)
    except Exception:  # a metrics hook's own failure
        log.exception("worker: the metrics probe failed on job %s's outcome", job.ctx.id)


def _reraise_if_cancelled() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _describe(exc: BaseException) -> bytes:
    text = "".join(traceback.format_exception(exc, limit=20))
    head = f"{type(exc).__name__}: {exc}\n"
    data = (head + text).encode(errors="replace")
    return data[:MAX_ERROR_BYTES]


def _priority(f: list[Any]) -> int:
    """A leased job's priority (0 if its record holds none that reads as an integer)."""
    try:
        return int(f[14]) if f[14] else 0
    except ValueError:
        return 0


def _runnable_since(f: list[Any]) -> tuple[int, int]:
    """(created, runnable since) of a leased job: since its ``due`` (the end of its delay or of
    its retry's backoff) when it has one at or after its creation, else since its creation."""
    created = int(f[8])
    try:
        due = int(float(f[12])) if f[12] else 0
    except ValueError:
        due = 0
    return created, due if due >= created else created
