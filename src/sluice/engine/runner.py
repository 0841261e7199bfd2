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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import NoScriptError, RedisError

from sluice.engine.backoff import Backoff
from sluice.engine.clock import now_ms
from sluice.engine.codec import decode, encode
from sluice.engine.connection import MAX_BLOCK, blocking_client
from sluice.engine.context import JobContext
from sluice.engine.protocol import LEASED_FIELDS, StepReply
from sluice.engine.transport import describe, server_url
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


class _Running:
    """One job this process is running."""

    __slots__ = ("ctx", "stop_reason", "task", "token")

    def __init__(self, ctx: JobContext, token: bytes) -> None:
        self.ctx = ctx
        self.token = token
        self.task: asyncio.Task[None] | None = None
        #: why the runner cancelled the task: lease_lost, cancel, release
        self.stop_reason: str | None = None


class _Wire:
    """A connection of the pump's own, for the dispatch script and nothing else.

    The pump sends one call at a time, so it needs no pool: talking to a
    redis-py Connection directly skips the pool's lock and condition, the
    client's retry wrapper and its event hooks, and the command is packed by
    hiredis in C (redis-py's asyncio packer spends about 1 µs per argument,
    and a call carries 6 per finished job). With short jobs that was a third
    of the worker's CPU per job (benchmarks/README.md). The connection (TCP,
    unix or TLS, with auth and db) is built from the client's own pool
    settings and reconnects on the next call after any error; the pump then
    retries with its outcomes kept.
    """

    def __init__(self, redis: Redis, script: AsyncScript) -> None:
        pool = redis.connection_pool
        self._conn: AbstractConnection = pool.connection_class(**pool.connection_kwargs)
        self._script = script

    async def _send(self, *args: Any) -> None:
        packed = _PACK(args) if _PACK is not None else self._conn.pack_command(*args)
        await self._conn.send_packed_command(packed)

    async def call(self, keys: list[str], args: list[Any]) -> Any:
        conn = self._conn
        try:
            try:
                await self._send("EVALSHA", self._script.sha, len(keys), *keys, *args)
                return await conn.read_response()
            except NoScriptError:  # Redis restarted or its scripts were flushed
                await self._send("SCRIPT", "LOAD", self._script.script)
                await conn.read_response()
                await self._send("EVALSHA", self._script.sha, len(keys), *keys, *args)
                return await conn.read_response()
        except BaseException:
            # A reply may be half read (or not read): the next call must not see it.
            await conn.disconnect()
            raise

    async def close(self) -> None:
        await self._conn.disconnect()


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
        task = job.task
        if task is None or task.done():
            return
        task.cancel()
        asyncio.get_running_loop().call_later(0.1, self._stop_handler, job, reason)

    async def run(self) -> None:
        blocking = blocking_client(self.queue.redis)
        helpers = [
            asyncio.create_task(self._wake_loop(blocking), name="sluice-waker"),
            asyncio.create_task(self._renew_loop(), name="sluice-renewer"),
            asyncio.create_task(self._reap_loop(), name="sluice-reaper"),
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
        try:
            await self._pump()
        finally:
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
            with contextlib.suppress(Exception):
                await self.queue.redis.hdel(self.keys.workers, self.wid)
            log.info("worker %s stopped", self.wid, extra={"worker_id": self.wid})

    # ---- the pump ----------------------------------------------------------------------
    async def _pump(self) -> None:
        failures = 0
        while True:
            self.kick.clear()
            free = 0 if self.stopping else self.concurrency - len(self.running)
            if self.done or (free > 0 and self.more):
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
                    await asyncio.wait_for(self.kick.wait(), max(due_in, 0.0))
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
        ids = [outcome[0] for outcome in self.done]
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
        delay = min(5.0, 0.05 * 2 ** min(failures, 7)) * (0.5 + random.random() / 2)
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
                await asyncio.wait_for(wake.wait(), delay)

    async def _step(self, free: int) -> None:
        batch = self.done
        self.done = []
        if free > 0:
            # This step consumes "more". The waker may set it again while the
            # call is in flight (a job added after the script ran); that signal
            # must survive, or the worker sleeps on a marker already popped.
            self.more = False
        try:
            keys, args = self.queue.protocol.step_command(
                now=now_ms(), want=free, lease_ms=self.lease_ms, worker_id=self.wid, outcomes=batch
            )
            reply = StepReply.parse(await self._wire.call(keys, args))
        except BaseException:
            self.done[:0] = batch  # keep the outcomes; they are sent again
            if free > 0:
                self.more = True
            raise
        for outcome, code in zip(batch, reply.codes, strict=True):
            if code <= 0:
                log.warning(
                    "outcome refused for job %s: its lease was lost (the job was reaped and "
                    "may run again) (worker %s)",
                    outcome[0],
                    self.wid,
                    extra={"worker_id": self.wid, "job_id": outcome[0], "code": code},
                )
        self.next_due = reply.next_due
        jobs = reply.jobs
        if free > 0 and len(jobs) // LEASED_FIELDS >= free:
            self.more = True  # a full batch: there may be more waiting
        for i in range(0, len(jobs), LEASED_FIELDS):
            self._start(jobs[i : i + LEASED_FIELDS])

    def _start(self, f: list[Any]) -> None:
        job_id = f[0].decode()
        try:
            name = f[2].decode()
            timeout_ms = int(f[6])
            ctx = JobContext(
                self.queue.name, job_id, name, f[3], int(f[4]), int(f[5]), int(f[8]), self.wid, f[1]
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
            return
        job = _Running(ctx, f[1])
        self.running[job_id] = job
        timeout = timeout_ms / 1000 if timeout_ms > 0 else self.worker.timeout
        job.task = asyncio.create_task(self._execute(job, self.worker.get_handler(name), timeout, f[7]))

    async def _execute(
        self, job: _Running, handler: Handler | None, timeout: float | None, backoff: bytes
    ) -> None:
        ctx = job.ctx
        outcome: tuple[bytes, bytes, int] | None
        try:
            outcome = await self._attempt(ctx, handler, timeout, backoff)
        except asyncio.CancelledError:
            # Only the runner cancels handlers, and it says why first.
            reason = job.stop_reason or "release"
            outcome = None if reason == "lease_lost" else _STOPPED[reason]
        finally:
            if self.running.get(ctx.id) is job:
                del self.running[ctx.id]
            self.kick.set()
        if outcome is not None:
            self.done.append((ctx.id, job.token, *outcome, ctx.usage))

    async def _attempt(  # noqa: PLR0911 - one return per outcome kind
        self, ctx: JobContext, handler: Handler | None, timeout: float | None, backoff: bytes
    ) -> tuple[bytes, bytes, int]:
        """Run one attempt; returns (kind, value, retry_at) for the dispatch script."""
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
            if timeout is None:
                result = await handler(ctx)
            else:
                try:
                    async with asyncio.timeout(timeout) as cm:
                        result = await handler(ctx)
                except TimeoutError:
                    if not cm.expired():
                        raise
                    raise AttemptTimeout(timeout) from None
            return b"c", encode(result, "result"), 0
        except (PermanentError, PayloadNotSerializable) as exc:
            return self._dead(ctx, _describe(exc))
        except Throttled as exc:
            log.info(
                "worker %s: job %s was throttled by its provider; the queue pauses for %gs "
                "and the job waits again",
                self.wid,
                ctx.id,
                exc.retry_after,
                extra={"worker_id": self.wid, "job_id": ctx.id, "retry_after_s": exc.retry_after},
            )
            return b"t", b"%d" % round(exc.retry_after * 1000), 0
        except Exception as exc:  # noqa: BLE001 - any handler error is the job's failure
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
            return b"f", _describe(exc), now_ms() + int(delay * 1000)

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
    async def _wake_loop(self, blocking: Any) -> None:
        failures = 0
        while not self._closing:
            await self.idle.wait()
            try:
                await blocking.bzpopmin(self.keys.wake, timeout=MAX_BLOCK)
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
        redis = self.queue.redis
        heartbeat = orjson.dumps({"names": sorted(self.worker.names), "concurrency": self.concurrency})
        failures = 0
        while not self._closing:
            # The first heartbeat goes out at start, so a worker is visible at once.
            try:
                await redis.hset(self.keys.workers, self.wid, heartbeat[:-1] + b',"seen_ms":%d}' % now_ms())
                await self._renew()
                failures = 0
            except _TRANSIENT as exc:
                _reraise_if_cancelled()
                failures += 1
                await self._backoff("lease renewal", exc, failures)
            await asyncio.sleep(interval)

    async def _renew(self) -> None:
        # A handler told to stop keeps its lease until it has ended (a slow wind-down
        # must not turn a release into a stall); only a lost lease is let go.
        jobs = [j for j in self.running.values() if j.stop_reason != "lease_lost"]
        codes = await self.queue.protocol.extend(
            now=now_ms(), lease_ms=self.lease_ms, leases=[(j.ctx.id, j.token) for j in jobs]
        )
        for job, code in zip(jobs, codes, strict=True):
            if code == 1 or job.task is None or job.stop_reason in ("lease_lost", "cancel"):
                continue
            reason = "cancel" if code == 2 else "lease_lost"
            log.warning(
                "worker %s: stopping the handler of job %s (%s)",
                self.wid,
                job.ctx.id,
                "its cancellation was requested" if reason == "cancel" else "its lease was lost",
                extra={"worker_id": self.wid, "job_id": job.ctx.id, "reason": reason},
            )
            self._stop_handler(job, reason)

    async def _reap_loop(self) -> None:
        interval = self.worker.reap_interval
        failures = 0
        while not self._closing:
            await asyncio.sleep(interval * (0.75 + random.random() / 2))
            try:
                back, dead = await self.queue.protocol.reap(now=now_ms())
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


#: Errors a helper rides out with a backoff: Redis unreachable, slow, restarting or
#: refusing commands (out of memory); the marked queue calls raise them mapped.
_TRANSIENT = (RedisError, OSError, RedisUnavailable, RedisCommandError)

#: What a handler stopped by the runner reports: a cancel, or a release to waiting.
_STOPPED = {"cancel": (b"x", b"cancelled by request", 0), "release": (b"r", b"", 0)}


def _reraise_if_cancelled() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _describe(exc: BaseException) -> bytes:
    text = "".join(traceback.format_exception(exc, limit=20))
    head = f"{type(exc).__name__}: {exc}\n"
    data = (head + text).encode(errors="replace")
    return data[:MAX_ERROR_BYTES]
