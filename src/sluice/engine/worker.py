"""The consumer side: handlers registered by name, run by :class:`Worker`."""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, overload

from sluice.engine import hooks as _hooks
from sluice.engine.connection import connect
from sluice.engine.handlers import AsyncHandler, Handler, Handlers, SyncHandler
from sluice.engine.hooks import Hook
from sluice.engine.keys import check_name
from sluice.engine.queue import Queue
from sluice.engine.retention import refuse_keep_finished
from sluice.engine.runconfig import RunConfig
from sluice.engine.runner import Runner
from sluice.engine.watchdog import DEFAULT_HARD_GRACE, DEFAULT_LOOP_BLOCK_WARNING
from sluice.errors import ConfigurationError
from sluice.settings import (
    DEFAULT_CONCURRENCY,
    DEFAULT_EVENTS_MAXLEN,
    DEFAULT_LEASE,
    DEFAULT_PREFIX,
    DEFAULT_QUEUE,
    DEFAULT_SHUTDOWN_GRACE,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

__all__ = ["AsyncHandler", "Handler", "SyncHandler", "Worker"]

H = TypeVar("H", bound=Handler)


class Worker:
    """Runs the handlers of one queue, ``concurrency`` jobs at a time per process.

    Define it at module level and run it with ``sluice worker module:worker``,
    or ``await worker.run(url_or_client)`` in your own program::

        worker = Worker("llm", concurrency=20)

        @worker.handler
        async def summarize(job: JobContext) -> dict:
            ...

        @worker.handler
        def resize(job: JobContext) -> str:  # blocking code: runs in a thread
            ...

    ``lease``: seconds a job stays leased without renewal; the worker renews
    every third of it, and a job whose worker died is run again after it
    expires. ``timeout``: default seconds per attempt (jobs may set their own;
    None = no limit). ``shutdown_grace``: seconds in-flight jobs get to finish
    on SIGTERM before they are released back to waiting.

    ``hard_grace``: seconds past its timeout an attempt may go on before the
    worker stops it by ending its process: a handler that blocks the event
    loop, ignores its cancellation, or runs in a thread that does not return
    cannot be stopped any other way. The attempt is recorded as failed (and
    retried as its job allows), the process's other jobs go back to waiting,
    and the process exits with code 75 (``sluice worker --processes N``
    starts a new one). None: never stop hard, only log. ``loop_block_warning``:
    seconds the event loop may be blocked before the worker logs it, with the
    job and the line that blocked it (None: never). Both are watched by a
    thread of the worker's own (engine/watchdog.py), since the event loop may
    be the thing that is stuck.

    ``hooks``: :class:`~sluice.engine.hooks.Hook` instances, called at startup,
    at shutdown and around every attempt (see engine/hooks.py); ``state`` is
    the dict their startup and shutdown get, kept as long as the worker.
    """

    def __init__(
        self,
        queue: str = DEFAULT_QUEUE,
        *,
        handlers: Mapping[str, Handler] | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        prefix: str = DEFAULT_PREFIX,
        lease: float = DEFAULT_LEASE,
        timeout: float | None = None,
        shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
        reap_interval: float | None = None,
        worker_id: str | None = None,
        keep_finished: None = None,
        events_maxlen: int = DEFAULT_EVENTS_MAXLEN,
        hard_grace: float | None = DEFAULT_HARD_GRACE,
        loop_block_warning: float | None = DEFAULT_LOOP_BLOCK_WARNING,
        hooks: Iterable[Hook] = (),
    ) -> None:
        self.hard_grace = _optional_seconds("hard_grace", hard_grace, None)
        self.loop_block_warning = _optional_seconds("loop_block_warning", loop_block_warning, None)
        self.queue_name = queue
        self.prefix = prefix
        self.concurrency = concurrency
        self.lease = lease
        self.timeout = timeout
        self.shutdown_grace = shutdown_grace
        self.reap_interval = 0.0
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"
        refuse_keep_finished(keep_finished)
        self.events_maxlen = events_maxlen
        self.configure(reap_interval=reap_interval)
        self._handlers = Handlers()
        self._hooks: list[Hook] = []
        #: what the hooks keep for the worker's life (their startup and shutdown get it)
        self.state: dict[str, Any] = {}
        self._runner: Runner | None = None
        for hook in hooks:
            self.add_hook(hook)
        for name, fn in (handlers or {}).items():
            self.register(name, fn)

    def configure(
        self,
        *,
        queue: str | None = None,
        prefix: str | None = None,
        concurrency: int | None = None,
        lease: float | None = None,
        timeout: float | None = None,
        shutdown_grace: float | None = None,
        reap_interval: float | None = None,
        worker_id: str | None = None,
        hard_grace: float | None = None,
        loop_block_warning: float | None = None,
    ) -> Worker:
        """Change settings before :meth:`run` (``sluice worker --lease ...`` does);
        every value is checked, and the lease's reap interval follows a new lease.
        None leaves a setting as it is (pass ``hard_grace=None`` to the constructor
        to turn the hard stop off)."""
        queue = self.queue_name if queue is None else queue
        prefix = self.prefix if prefix is None else prefix
        concurrency = self.concurrency if concurrency is None else concurrency
        lease = self.lease if lease is None else lease
        timeout = self.timeout if timeout is None else timeout
        grace = self.shutdown_grace if shutdown_grace is None else shutdown_grace
        check_name("queue name", queue)
        check_name("key prefix", prefix)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigurationError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        for what, value in (("lease", lease), ("shutdown_grace", grace)):
            if not _seconds(value) or value <= 0:
                raise ConfigurationError(f"{what} must be > 0 seconds, got {value!r}")
        if lease < 0.1:
            raise ConfigurationError(f"lease must be at least 0.1 s, got {lease!r}")
        if timeout is not None and (not _seconds(timeout) or timeout <= 0):
            raise ConfigurationError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        if reap_interval is not None and (not _seconds(reap_interval) or reap_interval <= 0):
            raise ConfigurationError(f"reap_interval must be > 0 seconds, got {reap_interval!r}")
        if worker_id is not None and (not isinstance(worker_id, str) or not worker_id):
            raise ConfigurationError(f"worker_id must be a non-empty string, got {worker_id!r}")
        self.hard_grace = _optional_seconds("hard_grace", hard_grace, self.hard_grace)
        self.loop_block_warning = _optional_seconds(
            "loop_block_warning", loop_block_warning, self.loop_block_warning
        )
        self.queue_name, self.prefix, self.concurrency = queue, prefix, concurrency
        if reap_interval is None and (lease != self.lease or not self.reap_interval):
            reap_interval = min(max(lease / 2, 0.05), 5.0)
        self.lease, self.timeout, self.shutdown_grace = lease, timeout, grace
        if reap_interval is not None:
            self.reap_interval = reap_interval
        if worker_id is not None:
            self.worker_id = worker_id
        return self

    # ---- handlers --------------------------------------------------------------
    def register(self, name: str, fn: Handler) -> None:
        """Make ``fn`` the handler of jobs named ``name``.

        ``async def`` handlers run on the worker's event loop: they must not
        block it (a blocked loop stalls every job of the process, and is
        logged). A plain ``def`` runs in a thread of the worker's own, one per
        concurrent job, so it may block (HTTP clients, SDKs, CPU work that
        releases the GIL); it cannot await, it cannot be interrupted (at its
        timeout ``job.stop_requested`` turns true, and past ``hard_grace`` the
        process is ended), and it holds its slot until it returns.
        """
        self._handlers.register(name, fn)

    def add_hook(self, hook: Hook, *, outermost: bool = False) -> None:
        """Add a hook (engine/hooks.py): its startup runs after those added before it, its
        shutdown and after_attempt before theirs. ``outermost``: put it before the others
        instead, so that it encloses them (an attempt's span: what the other hooks do around
        the handler is then inside it)."""
        if not isinstance(hook, Hook):
            raise ConfigurationError(f"a hook must be a sluice.engine.hooks.Hook, got {hook!r}")
        if outermost:
            self._hooks.insert(0, hook)
        else:
            self._hooks.append(hook)

    @property
    def hooks(self) -> tuple[Hook, ...]:
        return tuple(self._hooks)

    @overload
    def handler(self, fn: H, /) -> H: ...
    @overload
    def handler(self, fn: None = None, /, *, name: str) -> Callable[[H], H]: ...

    def handler(self, fn: H | None = None, /, *, name: str | None = None) -> H | Callable[[H], H]:
        """Register a function (``async def`` or ``def``) as the handler of jobs named after it
        (or ``name``); see :meth:`register` for what each kind may do."""

        if isinstance(fn, str):
            raise ConfigurationError(
                f"@worker.handler({fn!r}) names the job type positionally; "
                f"write @worker.handler(name={fn!r}), or @worker.handler to use the function's name"
            )

        def deco(f: H) -> H:
            self.register(name or f.__name__, f)
            return f

        return deco(fn) if fn is not None else deco

    @property
    def names(self) -> frozenset[str]:
        return self._handlers.names

    def get_handler(self, name: str) -> Handler | None:
        return self._handlers.get(name)

    def is_sync(self, name: str) -> bool:
        """Whether the handler of ``name`` is a plain function, run in a thread."""
        return self._handlers.is_sync(name)

    def run_config(self) -> RunConfig:
        """The settings a run starts with, frozen."""
        return RunConfig(
            worker_id=self.worker_id,
            concurrency=self.concurrency,
            lease=self.lease,
            timeout=self.timeout,
            shutdown_grace=self.shutdown_grace,
            reap_interval=self.reap_interval,
            hard_grace=self.hard_grace,
            loop_block_warning=self.loop_block_warning,
        )

    def queue(self, redis: Redis, **options: Any) -> Queue:
        """A Queue for this worker's queue that refuses job names it has no handler for."""
        return Queue(
            self.queue_name,
            redis=redis,
            prefix=self.prefix,
            known_names=self.names,
            events_maxlen=self.events_maxlen,
            **options,
        )

    # ---- running -------------------------------------------------------------------
    async def run(self, redis: Redis | RedisCluster | str, *, handle_signals: bool = True) -> None:
        """Run until :meth:`stop` (or SIGTERM/SIGINT when ``handle_signals``).

        A first signal stops taking jobs and gives in-flight ones
        ``shutdown_grace`` seconds; a second releases them at once. The hooks'
        startup runs before the first job is taken (one that raises ends the
        run, after the shutdown of those that started), their shutdown after
        the last attempt ended.
        """
        if not self._handlers:
            raise ConfigurationError("this worker has no handlers; register some with @worker.handler")
        client = connect(redis) if isinstance(redis, str) else redis
        queue = Queue(
            self.queue_name,
            redis=client,
            prefix=self.prefix,
            events_maxlen=self.events_maxlen,
        )
        hooks = tuple(self._hooks)
        # Made before the hooks start, so that a stop asked meanwhile is not lost.
        runner = self._runner = Runner(self.run_config(), queue, self._handlers, hooks)
        installed = self._install_signals(runner) if handle_signals else []
        try:
            await _hooks.startup(hooks, self.state)
            try:
                await runner.run()
            finally:
                await _hooks.shutdown(hooks, self.state)
        finally:
            loop = asyncio.get_running_loop()
            for sig in installed:
                loop.remove_signal_handler(sig)
            self._runner = None
            await queue.close()
            if isinstance(redis, str):
                await client.aclose()

    def stop(self, *, immediately: bool = False) -> None:
        """Stop taking jobs; finish in-flight ones (or release them now if ``immediately``)."""
        if self._runner is not None:
            self._runner.request_stop(immediately=immediately)

    def _install_signals(self, runner: Runner) -> list[signal.Signals]:
        if threading.current_thread() is not threading.main_thread():
            return []
        loop = asyncio.get_running_loop()
        sigs = [signal.SIGTERM, signal.SIGINT]

        def on_signal() -> None:
            runner.request_stop(immediately=runner.stopping)

        for sig in sigs:
            loop.add_signal_handler(sig, on_signal)
        return sigs


def _seconds(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _optional_seconds(what: str, value: float | None, current: float | None) -> float | None:
    """``value`` checked (> 0 seconds), or ``current`` when it is None."""
    if value is None:
        return current
    if not _seconds(value) or value <= 0:
        raise ConfigurationError(f"{what} must be > 0 seconds or None, got {value!r}")
    return value
