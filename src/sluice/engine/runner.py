"""One run of a worker: the pump, the attempts and the upkeep loops, put together.

* attempts.py runs each leased job's handler (outcomes.py says what its ending means);
* pump.py is the only coroutine that talks to the dispatch script: outcomes in,
  jobs out; its waker listens for new work while it is idle;
* upkeep.py renews leases, reaps expired ones, flushes latency and reports lag.

The runner is given a frozen :class:`~sluice.engine.runconfig.RunConfig`, the
handler registry and the hooks, not the Worker: what it runs with is fixed
at start. It starts the parts, stops them in order, and owns the shutdown
grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.engine.attempts import Attempts
from sluice.engine.connection import blocking_client
from sluice.engine.eviction import warn_if_evicting
from sluice.engine.lag import LagMeter
from sluice.engine.provider_view import ProviderView
from sluice.engine.pump import Pump
from sluice.engine.sketch import LatencyRecorder
from sluice.engine.transport import describe, server_url
from sluice.engine.upkeep import Upkeep
from sluice.engine.watchdog import SyncDispatch, Watchdog

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.handlers import Handlers
    from sluice.engine.hooks import Hook
    from sluice.engine.queue import Queue
    from sluice.engine.runconfig import RunConfig

log = logging.getLogger("sluice.worker")


class Runner:
    def __init__(
        self, config: RunConfig, queue: Queue, handlers: Handlers, hooks: Sequence[Hook] = ()
    ) -> None:
        self.config = config
        self.queue = queue
        self.wid = config.worker_id
        self.names = handlers.names
        #: dispatch-to-send delays of this worker's calls, reported for the pacer's headroom
        self.lag = LagMeter()
        #: what providers' answers said of their limits, for the queue's gates
        self.provider_view = ProviderView()
        #: latency bins of finished attempts, flushed about once a second (engine/sketch.py)
        self.latency = LatencyRecorder(queue.core)
        self.attempts = Attempts(
            config,
            handlers,
            queue=queue.name,
            prefix=queue.prefix,
            lag=self.lag,
            provider_view=self.provider_view,
            hooks=hooks,
        )
        self.pump = Pump(
            queue, self.attempts, worker_id=self.wid, lease_ms=config.lease_ms, latency=self.latency
        )
        self.upkeep = Upkeep(
            queue,
            config,
            self.attempts,
            names=self.names,
            unsent=self.pump.unsent,
            wake=self.pump.wake,
            latency=self.latency,
            lag=self.lag,
            provider_view=self.provider_view,
        )
        self._grace_timer: asyncio.TimerHandle | None = None
        self._watchdog: Watchdog | None = None
        if config.hard_grace is not None or config.loop_block_warning is not None:
            self._watchdog = Watchdog(
                worker_id=self.wid,
                hard_grace=config.hard_grace,
                loop_block_warning=config.loop_block_warning,
                dispatch=SyncDispatch(queue, lease_ms=config.lease_ms, worker_id=self.wid),
                unsent=self.pump.unsent,
                stop_taking_jobs=self.attempts.stop_taking_jobs,
            )
            self.attempts.watchdog = self._watchdog

    @property
    def stopping(self) -> bool:
        return self.attempts.stopping

    def request_stop(self, *, immediately: bool = False) -> None:
        loop = asyncio.get_running_loop()
        attempts = self.attempts
        grace = self.config.shutdown_grace
        if not attempts.stopping:
            attempts.stopping = True
            log.info(
                "worker stopping: %d running job(s) get %gs to finish (worker %s)",
                len(attempts.running),
                grace,
                self.wid,
                extra={"worker_id": self.wid, "in_flight": len(attempts.running), "grace_s": grace},
            )
            self._grace_timer = loop.call_later(grace, attempts.release_all)
            self.pump.give_up_at = loop.time() + grace
        if immediately:
            attempts.release_all()
            self.pump.give_up_at = loop.time()
        attempts.kick.set()

    async def run(self) -> None:
        await warn_if_evicting(self.queue.redis)
        blocking = blocking_client(self.queue.redis, self.queue.keys.wake)
        upkeep = self.upkeep
        helpers = [
            asyncio.create_task(self.pump.wake_loop(blocking), name="sluice-waker"),
            asyncio.create_task(upkeep.renew_loop(), name="sluice-renewer"),
            asyncio.create_task(upkeep.reap_loop(), name="sluice-reaper"),
            asyncio.create_task(upkeep.latency_loop(), name="sluice-latency"),
            asyncio.create_task(upkeep.lag_loop(), name="sluice-lag"),
        ]
        log.info(
            "worker %s serving queue %s at %s (%d at once; handlers: %s)",
            self.wid,
            self.queue.name,
            server_url(self.queue.redis),
            self.config.concurrency,
            ", ".join(sorted(self.names)),
            extra={
                "worker_id": self.wid,
                "queue": self.queue.name,
                "concurrency": self.config.concurrency,
                "handlers": sorted(self.names),
            },
        )
        if self._watchdog is not None:
            self._watchdog.start()
        try:
            await self.pump.run()
        finally:
            # First: the pump ends once no handler runs (unless run() itself was cancelled),
            # and a watchdog must not outlive its loop.
            if self._watchdog is not None:
                self._watchdog.stop()
            self.attempts.close()
            if self._grace_timer is not None:
                self._grace_timer.cancel()
            await self._close(helpers, blocking)

    async def _close(self, helpers: list[asyncio.Task[None]], blocking: Redis) -> None:
        # redis-py can swallow a cancellation that lands mid-read, so the
        # helpers also watch a flag, and the blocking socket is closed under
        # the waker.
        self.pump.closing = self.upkeep.closing = True
        self.pump.idle.set()
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
        await self.pump.wire.close()
        # The bins of the last second: a graceful stop loses no sample.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await self.latency.flush()
        with contextlib.suppress(Exception):
            await self.upkeep.heartbeat(leaving=True)
        with contextlib.suppress(Exception):
            await self.upkeep.report_lag(None)
        log.info("worker %s stopped", self.wid, extra={"worker_id": self.wid})
