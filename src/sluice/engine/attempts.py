"""The attempts a worker runs: each leased job's handler on a task (or a thread) of its own.

:class:`Attempts` holds the jobs running now and the outcomes finished and
not yet handed in; the pump (pump.py) starts jobs here and takes outcomes
from :attr:`Attempts.done`, woken by :attr:`Attempts.kick`. What an outcome
is comes from outcomes.py; this module runs the handler, its timeout and
its stop (a cancel request, a lost lease, a shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sluice.engine import outcomes
from sluice.engine.codec import decode
from sluice.engine.context import JobContext, set_current_job
from sluice.engine.hooks import AttemptEnd, after_attempt, around_attempts, before_attempt
from sluice.engine.job import valid_trace_context
from sluice.engine.outcomes import PERMANENT, RELEASED, returned
from sluice.engine.transport import describe
from sluice.engine.wireformat import (
    ATTEMPT,
    BACKOFF,
    BUDGET,
    CORRELATION_ID,
    CREATED,
    ID,
    MAX_ATTEMPTS,
    NAME,
    PAYLOAD,
    TIMEOUT_MS,
    TOKEN,
    TOKENS,
    TRACE_CONTEXT,
)
from sluice.errors import CorruptJobError, Throttled

if TYPE_CHECKING:
    from sluice.engine.handlers import Handler, Handlers
    from sluice.engine.hooks import Hook
    from sluice.engine.lag import LagMeter
    from sluice.engine.protocol import Outcome
    from sluice.engine.provider_view import ProviderView
    from sluice.engine.runconfig import RunConfig
    from sluice.engine.watchdog import Watchdog

log = logging.getLogger("sluice.worker")


class Running:
    """One job this process is running (and, for the watchdog, a watchdog.Attempt)."""

    __slots__ = (
        "backoff",
        "ctx",
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


class Attempts:
    """The running attempts of one worker, and the outcomes they left."""

    def __init__(
        self,
        config: RunConfig,
        handlers: Handlers,
        *,
        queue: str,
        prefix: str,
        lag: LagMeter,
        provider_view: ProviderView,
        hooks: Sequence[Hook] = (),
    ) -> None:
        self.wid = config.worker_id
        self.concurrency = config.concurrency
        self.default_timeout = config.timeout
        self.handlers = handlers
        self.queue = queue
        self.prefix = prefix
        self.lag = lag
        self.provider_view = provider_view
        #: only those that act around an attempt (see hooks.around_attempts)
        self.hooks = around_attempts(hooks)
        self.running: dict[str, Running] = {}
        #: outcomes not yet handed to the pump
        self.done: list[Outcome] = []
        #: set whenever the pump has something to do (an outcome, a freed slot, a stop)
        self.kick = asyncio.Event()
        #: no more jobs are taken (the worker is stopping)
        self.stopping = False
        #: the queue's epoch, as the last dispatch reply said (see JobContext.idempotency_key)
        self.epoch = ""
        self.watchdog: Watchdog | None = None
        #: threads of the sync handlers, one per slot (made on first use)
        self._pool: ThreadPoolExecutor | None = None

    def stop_taking_jobs(self) -> None:
        """Called by the watchdog's thread before a hard stop: the pump leases no more."""
        self.stopping = True

    def release_all(self) -> None:
        for job in list(self.running.values()):
            self.stop_handler(job, "release")

    def release(self, job_id: str, token: bytes) -> None:
        """Hand a job leased while stopping straight back to waiting."""
        self.done.append((job_id, token, RELEASED, b"", 0, 0))
        self.kick.set()

    def stop_handler(self, job: Running, reason: str) -> None:
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
        asyncio.get_running_loop().call_later(0.1, self.stop_handler, job, reason)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def start(self, f: Sequence[Any], dispatched_ms: int = 0) -> bool:
        """Start a leased job's handler (``f``: its values, by the offsets of wireformat.py);
        False if its record was unreadable (dead-lettered). ``dispatched_ms``: the leasing
        call's now (Redis's clock)."""
        job_id = f[ID].decode()
        try:
            name = f[NAME].decode()
            timeout_ms = int(f[TIMEOUT_MS])
            ctx = JobContext(
                self.queue,
                job_id,
                name,
                f[PAYLOAD],
                int(f[ATTEMPT]),
                int(f[MAX_ATTEMPTS]),
                int(f[CREATED]),
                self.wid,
                f[TOKEN],
                prefix=self.prefix,
                epoch=self.epoch,
                tokens=int(f[TOKENS]),
                budget=f[BUDGET].decode() or None,
                correlation_id=f[CORRELATION_ID].decode() or None,
                trace_context=(
                    valid_trace_context(f[TRACE_CONTEXT].decode(errors="replace"))
                    if f[TRACE_CONTEXT]
                    else None
                ),
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
            self.done.append((job_id, f[TOKEN], PERMANENT, str(error).encode(), 0, 0))
            self.kick.set()
            return False
        timeout = timeout_ms / 1000 if timeout_ms > 0 else self.default_timeout
        entry = self.handlers.entry(name)
        job = Running(ctx, f[TOKEN], timeout, f[BACKOFF], entry is not None and entry[1])
        job.started = time.monotonic()
        self.running[job_id] = job
        if self.watchdog is not None:
            # Watched from now: if another job blocks the loop before this one's task
            # first runs, a hard stop still releases it.
            self.watchdog.watch(job)
        job.task = asyncio.create_task(self._execute(job, None if entry is None else entry[0]))
        job.task.add_done_callback(functools.partial(self._ended, job))
        return True

    async def _execute(self, job: Running, handler: Handler | None) -> None:
        ctx = job.ctx
        set_current_job(ctx)  # this task's own context: the job's log lines carry it
        timer = None
        if job.timeout is not None:
            timer = asyncio.get_running_loop().call_later(job.timeout, self._time_out, job)
        # On this task, just before the handler: a span a hook opens is the handler's parent.
        hooks = self.hooks
        got = before_attempt(hooks, ctx) if hooks else None
        outcome: outcomes.Result | None = None
        try:
            outcome = await self._attempt(job, handler)
        except asyncio.CancelledError:
            outcome = outcomes.stopped(job.stop_reason)
        finally:
            if timer is not None:
                timer.cancel()
            if self.running.get(ctx.id) is job:
                del self.running[ctx.id]
            self.kick.set()
            if got is not None:
                after_attempt(hooks, ctx, self._end(job, handler is not None, outcome), got)
        if outcome is not None:
            self.done.append((ctx.id, job.token, *outcome, ctx.usage))
        if self.watchdog is not None:
            # After the outcome is queued: the watchdog always finds it in one place or the other.
            self.watchdog.unwatch(job)

    @staticmethod
    def _end(job: Running, registered: bool, outcome: outcomes.Result | None) -> AttemptEnd:
        name, error = outcomes.trace_name(job.ctx, outcome)
        seconds = time.monotonic() - job.started
        return AttemptEnd(name, error, seconds, timed_out=job.timed_out_at is not None, registered=registered)

    def _ended(self, job: Running, _task: asyncio.Task[None]) -> None:
        """The job's task is done. Normally _execute has reported it; a task cancelled before
        it first ran never entered _execute, and is reported here as stopped (no hook saw it
        begin, so none is told it ended)."""
        if self.running.get(job.ctx.id) is job:
            del self.running[job.ctx.id]
            outcome = outcomes.stopped(job.stop_reason)
            if outcome is not None:
                self.done.append((job.ctx.id, job.token, *outcome, job.ctx.usage))
            self.kick.set()
        if self.watchdog is not None:
            self.watchdog.unwatch(job)

    def _time_out(self, job: Running) -> None:
        """The attempt's timeout: cancel the handler (again until it ends). Whatever it does
        after, the attempt is a timeout, and the watchdog stops it past the hard grace."""
        job.timed_out_at = time.monotonic()
        self.stop_handler(job, "timeout")

    async def _attempt(  # noqa: PLR0911 - one return per way an attempt ends
        self, job: Running, handler: Handler | None
    ) -> outcomes.Result:
        """Run one attempt; returns (kind, value, retry in ms) for the dispatch script.

        Once its timeout has fired the attempt is a timeout, whatever the handler
        does after: ends cancelled, raises, or swallows the cancellation and
        returns a value (which is discarded, not reported as a success).
        """
        ctx = job.ctx
        if handler is None:
            ctx.usage = 0  # no handler ran: nothing reached the provider
            return outcomes.no_handler(ctx, self.handlers.names, self.wid)
        try:
            ctx.payload = decode(ctx.payload)
        except ValueError as exc:
            ctx.usage = 0
            error = str(CorruptJobError(ctx.id, f"payload is not JSON ({exc})")).encode()
            return outcomes.dead(ctx, error, self.wid)
        try:
            result = await (self._in_thread(job, handler) if job.sync else handler(ctx))
        except asyncio.CancelledError:
            if job.timed_out_at is None:
                raise
            return self._timed_out(job, None)
        except Exception as exc:  # noqa: BLE001 - any handler error is the job's failure
            if job.timed_out_at is not None:
                return self._timed_out(job, f"raised {describe(exc)}")
            if isinstance(exc, Throttled):
                # It came early by about the wait it was asked: the measured headroom takes that in.
                self.lag.throttled(exc.asked * 1000)
            return outcomes.failed(ctx, exc, job.backoff, self.wid)
        if job.timed_out_at is not None:
            return self._timed_out(job, "returned a value, which was discarded")
        return returned(ctx, result, job.sync, self.wid)

    def _timed_out(self, job: Running, after: str | None) -> outcomes.Result:
        assert job.timeout is not None and job.timed_out_at is not None
        late = time.monotonic() - job.timed_out_at if after is not None else 0.0
        return outcomes.timed_out(
            job.ctx, job.timeout, job.backoff, self.wid, after=after, late=late, sync=job.sync
        )

    async def _in_thread(self, job: Running, handler: Handler) -> Any:
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
