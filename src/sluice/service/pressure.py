"""Backpressure: how far behind the queue is, and whether submissions are refused.

The pressure score is the backlog measured in time: jobs waiting divided by
how fast the workers drain them (completions per second, an exponentially
weighted average of the engine's ``completed`` counter, sampled at most once
a second), against ``max_backlog_seconds``. A score of 1.0 means the queue
would take exactly that long to drain; above it, submissions get 429 with a
Retry-After of the time the excess would take to drain. A queue with no
drain yet (no worker, or none finished) is judged by depth alone
(``max_depth``), so a burst into an idle queue is not refused for having no
history. Every API process measures it itself from Redis's counters, so all
of them agree within a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.errors import RedisUnavailable

if TYPE_CHECKING:
    from sluice.engine.queue import Queue

#: Weight of the newest sample in the drain-rate average.
_ALPHA = 0.3


@dataclass(frozen=True, slots=True)
class Pressure:
    depth: int
    drain_rate: float
    backlog_seconds: float | None
    score: float
    refusing: bool
    retry_after: int


class PressureGauge:
    def __init__(self, queue: Queue, *, max_backlog_seconds: float, max_depth: int) -> None:
        self.queue = queue
        self.max_backlog_seconds = max_backlog_seconds
        self.max_depth = max_depth
        self._last: tuple[float, int] | None = None
        self._rate = 0.0
        self._cached: tuple[float, Pressure] | None = None
        self._reading: asyncio.Task[Pressure] | None = None

    async def read(self) -> Pressure:
        """The queue's pressure now (remembered for a second: a check per request costs nothing;
        the requests that arrive while it is read wait for that one reading)."""
        if self._cached is not None and time.monotonic() - self._cached[0] < 1.0:
            return self._cached[1]
        if self._reading is None:
            self._reading = asyncio.create_task(self._read())
            self._reading.add_done_callback(self._read_done)
        return await asyncio.shield(self._reading)

    def _read_done(self, _task: asyncio.Task[Pressure]) -> None:
        self._reading = None

    async def _read(self) -> Pressure:
        now = time.monotonic()
        try:
            counts = await self.queue.counts()
        except RedisUnavailable:
            # Unknown without Redis: no pressure, for a second (then Redis is asked again).
            # Submissions are stored meanwhile and enqueued when Redis is back; refusing them
            # all would turn a Redis restart into lost work for clients that do not retry.
            unknown = self._judge(self._cached[1].depth if self._cached else 0, 0.0)
            unknown = dataclasses.replace(unknown, refusing=False, retry_after=0)
            self._cached = (now, unknown)
            return unknown
        depth = counts["waiting"] + counts["parked"]
        done = counts["completed"] + counts["dead_total"] + counts["cancelled"]
        if self._last is not None and now > self._last[0]:
            sample = max(done - self._last[1], 0) / (now - self._last[0])
            self._rate = sample if self._rate == 0 else _ALPHA * sample + (1 - _ALPHA) * self._rate
        self._last = (now, done)
        found = self._judge(depth, self._rate)
        self._cached = (now, found)
        return found

    def _judge(self, depth: int, rate: float) -> Pressure:
        by_depth = depth / self.max_depth
        backlog = depth / rate if rate > 0 else None
        by_time = backlog / self.max_backlog_seconds if backlog is not None else 0.0
        score = max(by_depth, by_time)
        refusing = score > 1.0
        retry_after = 0
        if refusing:
            excess = depth - min(
                self.max_depth, rate * self.max_backlog_seconds if rate > 0 else self.max_depth
            )
            retry_after = max(1, math.ceil(excess / rate)) if rate > 0 else 5
        return Pressure(
            depth,
            round(rate, 3),
            round(backlog, 3) if backlog is not None else None,
            round(score, 4),
            refusing,
            retry_after,
        )
