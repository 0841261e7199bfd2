"""The worker's watchdog: a thread that sees what the event loop cannot.

Three kinds of handler cannot be stopped from the event loop: an ``async
def`` that blocks the loop (``time.sleep``, a synchronous SDK call), which
stops the loop itself and with it every other job of the process; one that
swallows its cancellation and goes on; and a plain ``def`` handler, whose
thread cannot be interrupted. The watchdog is a daemon thread of the
worker's own, beside the loop rather than on it, with two duties:

* **blocked loop**: the loop stamps a heartbeat every 0.1 s; a heartbeat
  later than ``loop_block_warning`` is one stall, logged once, when it ends
  (or when the process is stopped during it), with its length, the job whose
  task held the loop and the line it was at (sampled while it was stuck);
* **hard stop**: an attempt that runs ``hard_grace`` seconds past its
  timeout without ending is stopped by ending the process, since nothing
  short of that stops a thread or a loop that does not run. First the
  watchdog reports, on a synchronous connection of its own, through the same
  dispatch script the pump uses (fenced by each attempt's token, so a stale
  report is refused), the outcomes the pump had not sent yet, the overrun
  attempt as failed (retried per its backoff while attempts remain, else
  dead-lettered; its error says by how much it overran) and every other
  running job as released (back to waiting, its attempt not counted); then it
  exits with :data:`EXIT_HARD_STOPPED`. ``sluice worker --processes N``
  starts a new process in its place, as Celery's prefork pool does after a
  hard time limit.

Which attempt overran: while the loop runs, one the runner cancelled at its
timeout ``hard_grace`` seconds ago that has not ended; while the loop is
blocked, the job whose task holds it, once its start is ``timeout +
hard_grace`` ago (no other job can be judged: none can even be cancelled
before the loop runs again). When the task that holds the loop is not a job's
own (a task a handler started), every attempt past ``timeout + hard_grace``
since its start is charged. An attempt without a timeout is never stopped.

Limits: a C extension that blocks while holding the GIL stops this thread
too, and only a watchdog in another process could end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import redis.connection
from redis.backoff import NoBackoff
from redis.exceptions import AskError, MovedError, NoScriptError, RedisError
from redis.retry import Retry

from sluice.engine.backoff import Backoff
from sluice.engine.protocol import StepReply
from sluice.engine.transport import describe, server_url
from sluice.engine.wireformat import Kind

if TYPE_CHECKING:
    from sluice.engine.context import JobContext
    from sluice.engine.protocol import Outcome
    from sluice.engine.queue import Queue

log = logging.getLogger("sluice.worker")

#: Seconds an attempt may go on past its timeout before its process is ended.
DEFAULT_HARD_GRACE = 5.0
#: Seconds the event loop may be blocked before the worker logs it.
DEFAULT_LOOP_BLOCK_WARNING = 1.0
#: Exit code of a worker process ended by its watchdog (EX_TEMPFAIL: start it again).
EXIT_HARD_STOPPED = 75

#: Seconds between two heartbeats of the loop, and between two looks of the watchdog.
BEAT = 0.1
#: A loop whose heartbeat is this late is taken to be blocked by the task it is running.
BLOCKED_AFTER = 0.5
#: A look of the watchdog this much later than due means the whole process was paused
#: (SIGSTOP, a suspended VM): the loop gets time to run again before it is judged.
PAUSED_AFTER = 1.0
#: Socket timeouts of the report at a hard stop: the process is ending, it must not hang.
REPORT_TIMEOUT = 5.0

#: Async-only keyword arguments of a redis.asyncio connection, left out of the synchronous one.
_ASYNC_ONLY = frozenset(
    {"retry", "parser_class", "redis_connect_func", "event_dispatcher", "himport_registry"}
)


class Attempt(Protocol):
    """What the watchdog reads of one running attempt (attempts.Running).

    Every field is written on the event loop and read here; each is a plain
    attribute, so a read sees either the old or the new value.
    """

    ctx: JobContext
    token: bytes
    task: asyncio.Task[None] | None
    #: runs in a thread (a ``def`` handler)
    sync: bool
    timeout: float | None
    backoff: bytes
    #: time.monotonic() when the attempt started
    started: float
    #: time.monotonic() when the runner cancelled it at its timeout, or None
    timed_out_at: float | None


class SyncDispatch:
    """The dispatch script, called from the watchdog's thread on a connection of its own.

    The event loop may be the thing that is stuck, so its clients cannot be
    used; this is a plain redis-py connection built from the same settings
    (TCP, unix or TLS, with auth and db), opened only when a hard stop needs
    it, with short timeouts and no retries: the process ends right after,
    whether the report went through or not. On a Redis Cluster it follows a
    MOVED or ASK reply to the master of the queue's slot.
    """

    def __init__(self, queue: Queue, *, lease_ms: int, worker_id: str) -> None:
        self._commands = queue.core.commands
        self._script = queue.scripts.dispatch
        self._lease_ms = lease_ms
        self._worker_id = worker_id
        self.url = server_url(queue.redis)
        pool = queue.redis.connection_pool
        self._class = _sync_class(pool.connection_class)
        self._kwargs = {k: v for k, v in pool.connection_kwargs.items() if k not in _ASYNC_ONLY}
        for key in ("socket_timeout", "socket_connect_timeout"):
            self._kwargs[key] = min(self._kwargs.get(key) or REPORT_TIMEOUT, REPORT_TIMEOUT)
        self._kwargs["retry"] = Retry(NoBackoff(), 0)
        self._class(**self._kwargs)  # no I/O: settings it does not take fail now, not at a hard stop

    def finish(self, outcomes: Sequence[Outcome]) -> list[int]:
        """Record ``outcomes`` and take no job; returns the script's code per outcome."""
        _, keys, args = self._commands.dispatch(
            want=0, lease_ms=self._lease_ms, worker_id=self._worker_id, outcomes=outcomes
        )
        command = (len(keys), *keys, *args)
        # Any: redis-py's synchronous connection methods are not annotated.
        conn: Any = self._class(**self._kwargs)
        asking = False
        try:
            for _ in range(3):
                try:
                    if asking:
                        conn.send_command("ASKING")
                        conn.read_response()
                    try:
                        conn.send_command("EVALSHA", self._script.sha, *command)
                        reply = conn.read_response()
                    except NoScriptError:  # Redis restarted or its scripts were flushed
                        conn.send_command("EVAL", self._script.script, *command)
                        reply = conn.read_response()
                    return [int(code) for code in StepReply.parse(reply).codes]
                except AskError as exc:  # a cluster: the queue's slot is served by another master
                    conn.disconnect()
                    conn = self._class(**{**self._kwargs, "host": exc.host, "port": exc.port})
                    asking = not isinstance(exc, MovedError)
            raise RedisError("the Redis Cluster kept redirecting the report")
        finally:
            conn.disconnect()


def _sync_class(async_class: type) -> type[redis.connection.AbstractConnection]:
    """redis-py's synchronous twin of an asyncio connection class (TCP, unix socket or TLS)."""
    for cls in async_class.__mro__:
        twin = getattr(redis.connection, cls.__name__, None)
        if isinstance(twin, type) and issubclass(twin, redis.connection.AbstractConnection):
            return twin
    return redis.connection.Connection


class _Stall:
    """One blocked stretch of the event loop, from the last heartbeat before it."""

    __slots__ = ("job", "since", "where")

    def __init__(self, since: float, job: JobContext | None, where: str) -> None:
        self.since = since
        self.job = job
        self.where = where


class Watchdog:
    """Watches one runner's event loop and the deadlines of its attempts, from a thread.

    The runner calls :meth:`watch` when an attempt starts and :meth:`unwatch`
    once its outcome is queued for the pump (in that order, so an outcome is
    always in one of the two places the watchdog looks). ``unsent`` returns
    the outcomes the pump has not sent yet; ``stop_taking_jobs`` tells the
    pump to lease no more (called from this thread just before a hard stop:
    it must only set a flag). ``exit`` ends the process (``os._exit``; never
    ``sys.exit``, which would wait for the stuck code).
    """

    def __init__(
        self,
        *,
        worker_id: str,
        hard_grace: float | None,
        loop_block_warning: float | None,
        dispatch: SyncDispatch,
        unsent: Callable[[], list[Outcome]],
        stop_taking_jobs: Callable[[], None],
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.worker_id = worker_id
        self.hard_grace = hard_grace
        self.loop_block_warning = loop_block_warning
        self._dispatch = dispatch
        self._unsent = unsent
        self._stop_taking_jobs = stop_taking_jobs
        self._exit = exit
        self._attempts: dict[int, Attempt] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._beat_handle: asyncio.TimerHandle | None = None
        #: time.monotonic() of the loop's last heartbeat
        self._last_beat = 0.0
        #: time.monotonic() of this thread's last look, and of the end of the last pause
        self._last_look = 0.0
        self._resumed = 0.0
        self._stall: _Stall | None = None
        self._thread: threading.Thread | None = None

    # ---- on the event loop -----------------------------------------------------------
    def start(self) -> None:
        """Start the heartbeat on the running loop, and the watching thread."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._beat()
        self._last_look = self._last_beat
        self._thread = threading.Thread(target=self._watch_loop, name="sluice-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._beat_handle is not None:
            self._beat_handle.cancel()
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def watch(self, attempt: Attempt) -> None:
        with self._lock:
            self._attempts[id(attempt)] = attempt

    def unwatch(self, attempt: Attempt) -> None:
        with self._lock:
            self._attempts.pop(id(attempt), None)

    def _beat(self) -> None:
        self._last_beat = time.monotonic()
        assert self._loop is not None
        self._beat_handle = self._loop.call_later(BEAT, self._beat)

    # ---- in the watchdog's thread ----------------------------------------------------
    def _watch_loop(self) -> None:
        failures = 0
        while not self._closed.wait(BEAT):
            try:
                self._look(time.monotonic())
                failures = 0
            except Exception as exc:  # a watchdog that dies silently watches nothing
                failures += 1
                if failures == 1:
                    log.exception(
                        "worker %s: the watchdog failed (%s); it keeps watching",
                        self.worker_id,
                        describe(exc),
                        extra={"worker_id": self.worker_id, "error": describe(exc)},
                    )

    def _look(self, now: float) -> None:
        if self._loop is not None and self._loop.is_closed():
            self._closed.set()  # its runner was abandoned without stop(): nothing left to watch
            return
        if now - self._last_look > BEAT + PAUSED_AFTER:
            # This thread did not run either: the process was paused, not its loop blocked.
            # The end of the pause counts as a heartbeat, so that nothing is judged on it.
            self._resumed = now
        self._last_look = now
        beat = max(self._last_beat, self._resumed)
        blocked = now - beat > BLOCKED_AFTER
        stall = self._stall
        if stall is not None and beat != stall.since:
            self._stall = None
            self._log_stall(stall, beat - stall.since, ended=True)
        elif stall is None and self.loop_block_warning is not None and now - beat > self.loop_block_warning:
            current = self._current()
            self._stall = _Stall(beat, current.ctx if current else None, self._where())
        if self.hard_grace is None:
            return
        with self._lock:
            attempts = list(self._attempts.values())
        culprits = self._overrunning(attempts, now, blocked)
        if culprits:
            self._hard_stop(attempts, culprits, now, blocked)

    def _overrunning(self, attempts: list[Attempt], now: float, blocked: bool) -> list[tuple[Attempt, str]]:
        """The attempts to charge with an overrun now, each with what it did."""
        grace = self.hard_grace
        assert grace is not None
        if not blocked:
            return [
                (a, "its thread did not return" if a.sync else "it went on after it was cancelled")
                for a in attempts
                if a.timed_out_at is not None and now >= a.timed_out_at + grace
            ]
        current = self._current(attempts)
        if current is not None:
            late = current.timeout is not None and now >= current.started + current.timeout + grace
            return [(current, "it blocked the event loop")] if late else []
        return [
            (a, "the event loop was blocked while it ran")
            for a in attempts
            if a.timeout is not None and now >= a.started + a.timeout + grace
        ]

    def _current(self, attempts: list[Attempt] | None = None) -> Attempt | None:
        """The attempt whose task the loop is running now (the one holding a blocked loop)."""
        if self._loop is None:
            return None
        task = asyncio.current_task(self._loop)
        if task is None:
            return None
        if attempts is None:
            with self._lock:
                attempts = list(self._attempts.values())
        return next((a for a in attempts if a.task is task), None)

    def _where(self) -> str:
        """The innermost line the loop's thread is at (where a blocked loop is stuck)."""
        frame = sys._current_frames().get(self._loop_thread)  # the only way to see it
        if frame is None:
            return "unknown"
        summary = traceback.extract_stack(frame, limit=1)[-1]
        return f"{summary.filename}:{summary.lineno} in {summary.name}"

    def _log_stall(self, stall: _Stall, seconds: float, *, ended: bool) -> None:
        job = stall.job
        running = f"job {job.id} ({job.name}) held it, at {stall.where}" if job else f"at {stall.where}"
        log.warning(
            "worker %s: the event loop %s blocked for %.1fs (%s); no other job of this process "
            "could run meanwhile: run blocking code in a sync handler (def) or asyncio.to_thread",
            self.worker_id,
            "was" if ended else "has been",
            seconds,
            running,
            extra={
                "worker_id": self.worker_id,
                "blocked_s": round(seconds, 2),
                "job_id": job.id if job else None,
                "job_name": job.name if job else None,
                "where": stall.where,
            },
        )

    def _hard_stop(
        self, attempts: list[Attempt], culprits: list[tuple[Attempt, str]], now: float, blocked: bool
    ) -> None:
        self._stop_taking_jobs()
        if self._stall is not None:
            self._log_stall(self._stall, now - self._stall.since, ended=False)
        where = f" (at {self._where()})" if blocked else ""
        # The pump's unsent outcomes first: a job that finished is reported as finished,
        # and the same job is not reported twice (a second report would be refused as stale).
        outcomes = self._unsent()
        reported = {outcome[0] for outcome in outcomes}
        charged = {id(a) for a, _ in culprits}
        for attempt, how in culprits:
            if attempt.ctx.id not in reported:
                outcomes.append(self._overrun(attempt, how + where, now))
        released = [a for a in attempts if id(a) not in charged and a.ctx.id not in reported]
        outcomes += [(a.ctx.id, a.token, Kind.RELEASED, b"", 0, a.ctx.usage) for a in released]
        try:
            codes = self._dispatch.finish(outcomes)
        except Exception as exc:  # noqa: BLE001 - the process ends either way
            after = "their jobs run again once their leases expire"
            log.error(
                "worker %s: could not report %d outcome(s) before stopping hard (Redis at %s: %s); %s",
                self.worker_id,
                len(outcomes),
                self._dispatch.url,
                describe(exc),
                after,
                extra={"worker_id": self.worker_id, "error": describe(exc)},
            )
        else:
            after = f"{len(released)} other job(s) went back to waiting"
            refused = [o[0] for o, code in zip(outcomes, codes, strict=True) if code <= 0]
            if refused:
                log.warning(
                    "worker %s: outcomes of jobs %s were refused at the hard stop (already "
                    "reported, or their leases were lost)",
                    self.worker_id,
                    ", ".join(refused),
                    extra={"worker_id": self.worker_id, "job_ids": refused},
                )
        log.error(
            "worker %s: ending this process (exit code %d) to stop the overrun; %s, and "
            "`sluice worker --processes` starts a new process in its place",
            self.worker_id,
            EXIT_HARD_STOPPED,
            after,
            extra={
                "worker_id": self.worker_id,
                "exit_code": EXIT_HARD_STOPPED,
                "released": [a.ctx.id for a in released],
            },
        )
        for handler in (*log.handlers, *logging.getLogger().handlers):
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stdout.flush()
        self._exit(EXIT_HARD_STOPPED)

    def _overrun(self, attempt: Attempt, how: str, now: float) -> Outcome:
        """The failed outcome of an attempt stopped hard, logged; its error says by how much."""
        ctx = attempt.ctx
        timeout = attempt.timeout or 0.0
        over = max(now - attempt.started - timeout, 0.0)
        error = (
            f"AttemptTimeout: the attempt ran {over:.1f}s past its timeout of {timeout:g}s and {how}, "
            f"so worker {self.worker_id} stopped it hard by ending its process; let an async handler "
            "be cancelled, and run blocking code in a sync handler (def) or asyncio.to_thread"
        )
        last = ctx.attempt >= ctx.max_attempts
        retry_in = 0.0
        if not last:
            try:
                retry_in = Backoff.from_json(attempt.backoff).seconds(ctx.attempt)
            except (ValueError, TypeError):
                retry_in = 1.0
        log.error(
            "worker %s: job %s (%s) attempt %d of %d ran %.1fs past its timeout of %gs and %s; "
            "it is stopped hard and %s",
            self.worker_id,
            ctx.id,
            ctx.name,
            ctx.attempt,
            ctx.max_attempts,
            over,
            timeout,
            how,
            "dead-lettered" if last else f"retried in {retry_in:.3f}s",
            extra={
                "worker_id": self.worker_id,
                "job_id": ctx.id,
                "job_name": ctx.name,
                "attempt": ctx.attempt,
                "overrun_s": round(over, 2),
                "timeout_s": timeout,
                "error": error,
            },
        )
        return (ctx.id, attempt.token, Kind.OVERRAN, error.encode(), int(retry_in * 1000), ctx.usage)
