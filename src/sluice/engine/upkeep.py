"""The worker's upkeep loops, each on a task of its own beside the pump.

* renew: a heartbeat, and the leases of running jobs extended every third of
  a lease; a handler whose lease was lost or whose cancellation was
  requested is stopped;
* reap: jobs whose lease expired (their worker died) back to waiting, finished
  jobs past retention forgotten (trim), budget holds nobody settled swept;
* latency: the latency bins of finished attempts flushed about once a second
  (engine/sketch.py);
* lag: the dispatch-to-send delays and what providers said of their limits
  reported (engine/lag.py, engine/provider_view.py).

Each call is a bounded batch, and a loop rides out a Redis that is away
(retrying.py) rather than end the worker.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from sluice.engine.lag import REPORT_TTL_MS, SOON_INTERVAL_S
from sluice.engine.retrying import TRANSIENT, pause_after, reraise_if_cancelled
from sluice.engine.sketch import FLUSH_INTERVAL
from sluice.engine.transport import describe

if TYPE_CHECKING:
    from sluice.engine.attempts import Attempts
    from sluice.engine.lag import LagMeter
    from sluice.engine.protocol import Outcome
    from sluice.engine.provider_view import ProviderView
    from sluice.engine.queue import Queue
    from sluice.engine.runconfig import RunConfig
    from sluice.engine.sketch import LatencyRecorder

log = logging.getLogger("sluice.worker")

#: Expired leases returned per reap call (each call is one script: bounded work).
REAP_BATCH = 200
#: Finished jobs forgotten per trim call (retention.py), for the same reason.
TRIM_BATCH = 100


class Upkeep:
    """The loops of one worker; each ends once :attr:`closing` is set (or when cancelled)."""

    def __init__(
        self,
        queue: Queue,
        config: RunConfig,
        attempts: Attempts,
        *,
        names: frozenset[str],
        unsent: Callable[[], list[Outcome]],
        wake: Callable[[], None],
        latency: LatencyRecorder,
        lag: LagMeter,
        provider_view: ProviderView,
    ) -> None:
        self.queue = queue
        self.keys = queue.keys
        self.config = config
        self.wid = config.worker_id
        self.lease_ms = config.lease_ms
        self.attempts = attempts
        self.names = names
        self.unsent = unsent
        self.wake = wake
        self.latency = latency
        self.lag = lag
        self.provider_view = provider_view
        self.closing = False

    async def _pause(self, what: str, exc: BaseException, failures: int) -> None:
        await pause_after(
            what, exc, failures, worker_id=self.wid, lease_ms=self.lease_ms, redis=self.queue.redis
        )

    async def renew_loop(self) -> None:
        interval = self.config.lease / 3
        failures = 0
        while not self.closing:
            # The first heartbeat goes out at start, so a worker is visible at once.
            try:
                await self.heartbeat()
                await self._renew()
                failures = 0
            except TRANSIENT as exc:
                reraise_if_cancelled()
                failures += 1
                await self._pause("lease renewal", exc, failures)
            await asyncio.sleep(interval)

    async def heartbeat(self, *, leaving: bool = False) -> None:
        """Say this worker is alive (or leaving); it counts as gone after two silent leases."""
        description = orjson.dumps({"names": sorted(self.names), "concurrency": self.config.concurrency})
        call = self.queue.core.commands.heartbeat(
            self.wid, description[:-1], 2 * self.lease_ms, leaving=leaving
        )
        await self.queue.core.run(call)

    async def _renew(self) -> None:
        # A handler told to stop keeps its lease until it has ended (a slow wind-down
        # must not turn a release into a stall); only a lost lease is let go.
        jobs = [j for j in self.attempts.running.values() if j.stop_reason != "lease_lost"]
        # Finished jobs whose outcomes Redis has not taken yet (it was away) keep their
        # leases too, or a short outage would turn every such job into a stall.
        unsent = [(o[0], o[1]) for o in self.unsent()]
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
            self.attempts.stop_handler(job, reason)

    async def reap_loop(self) -> None:
        interval = self.config.reap_interval
        failures = 0
        while not self.closing:
            await asyncio.sleep(interval * (0.75 + random.random() / 2))
            try:
                back, dead, swept = await self._reap()
                failures = 0
            except TRANSIENT as exc:
                reraise_if_cancelled()
                failures += 1
                await self._pause("reaping", exc, failures)
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
                self.wake()
            if swept:
                log.warning(
                    "worker %s: swept %d budget holds nobody settled in time, as unknown outcomes "
                    "(their tokens stay charged): %s",
                    self.wid,
                    len(swept),
                    ", ".join(swept[:10]) + (" ..." if len(swept) > 10 else ""),
                    extra={"worker_id": self.wid, "swept": len(swept)},
                )

    async def _reap(self) -> tuple[int, int, list[str]]:
        """(returned, dead-lettered, ids of the holds swept) of one round."""
        protocol = self.queue.protocol
        # Each call reaps a bounded batch; a full one means more may be expired.
        back = dead = 0
        while not self.closing:
            more_back, more_dead = await protocol.reap(limit=REAP_BATCH)
            back, dead = back + more_back, dead + more_dead
            if more_back + more_dead < REAP_BATCH:
                break
        # Finished jobs past the queue's retention, a bounded batch per call too.
        while not self.closing:
            _, more = await protocol.trim(limit=TRIM_BATCH)
            if not more:
                break
        # Callers' budget holds whose time ran out (their callers crashed).
        swept = await self.queue.budgets.sweep()
        return back, dead, [s.id for s in swept]

    async def latency_loop(self) -> None:
        while not self.closing:
            await asyncio.sleep(FLUSH_INTERVAL)
            try:
                await self.latency.flush()
            except TRANSIENT as exc:
                reraise_if_cancelled()
                # Dropped, not sent again: the call may have been applied (at most ~1 s lost).
                log.info(
                    "worker %s: latency samples of the last second dropped: %s",
                    self.wid,
                    describe(exc),
                    extra={"worker_id": self.wid, "error": describe(exc)},
                )

    async def lag_loop(self) -> None:
        """Report the dispatch-to-send delays and what providers said of their limits, each
        when there is something to say."""
        while not self.closing:
            await asyncio.sleep(SOON_INTERVAL_S)
            try:
                report = self.lag.report_due()
                seen = self.provider_view.take()
                if report is not None:
                    await self.report_lag(report)
                if seen:
                    core = self.queue.core
                    await core.run(core.commands.observe(a for r in seen for a in r.args()))
            except TRANSIENT as exc:
                reraise_if_cancelled()
                # The next report says it again; until then the last one holds.
                log.debug("worker %s: lag or limits report not sent: %s", self.wid, describe(exc))
            except Exception:
                log.exception("worker %s: the lag or limits report failed", self.wid)

    async def report_lag(self, report: tuple[float, float] | None) -> None:
        """Report (lowest, highest) dispatch-to-send delay (ms), or withdraw with None."""
        lo, hi = report if report is not None else (0.0, 0.0)
        core = self.queue.core
        call = core.commands.lag(self.wid, f"{lo:.3f}", f"{hi:.3f}", REPORT_TTL_MS, withdraw=report is None)
        await core.run(call)
