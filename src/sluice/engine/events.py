"""Lifecycle events, read from the queue's capped Redis stream.

One reader per Queue blocks on XREAD and resolves every waiter whose job
reached a final state, so waiting for many results costs one connection and
no polling. A waiter registers first, then reads the job's state; the reader
started from a stream id taken *before* that read, so an outcome that lands
in between is still seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from redis.asyncio import Redis

log = logging.getLogger("sluice.events")

#: Events after which a job never changes again.
FINAL_EVENTS = frozenset({b"completed", b"dead", b"cancelled", b"rejected", b"exhausted"})


@dataclass(frozen=True, slots=True)
class Event:
    """One lifecycle event: ``name`` (added, active, completed, failed, retrying,
    dead, stalled, released, cancelled, cancel_requested, redriven, throttled,
    rejected, exhausted, parked, unparked, overspent), the job id (empty for unparked, which names a budget),
    the stream id (which starts with the Unix ms it was written) and extra fields."""

    stream_id: str
    name: str
    job_id: str
    fields: dict[str, str]

    @property
    def at_ms(self) -> int:
        return int(self.stream_id.split("-", 1)[0])

    @classmethod
    def parse(cls, stream_id: bytes, raw: dict[bytes, bytes]) -> Event:
        fields = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        return cls(stream_id.decode(), fields.pop("ev", "?"), fields.pop("id", "?"), fields)


class Outcome:
    """The final event of one job, as the reader saw it."""

    __slots__ = ("event", "fields")

    def __init__(self, event: bytes, fields: dict[bytes, bytes]) -> None:
        self.event = event
        self.fields = fields


class ResultWaiter:
    """Resolves futures when their jobs' final events appear on the stream."""

    def __init__(self, blocking: Redis, events_key: str, block_ms: int = 1000) -> None:
        self._redis = blocking
        self._key = events_key
        self._block_ms = block_ms
        self._waiters: dict[bytes, list[asyncio.Future[Outcome]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._start_id: bytes | None = None
        self._started = asyncio.Event()

    async def register(self, job_id: str) -> asyncio.Future[Outcome]:
        """Register interest in one job; returns once the reader covers the present.

        If the reader cannot start (Redis unreachable), its error is raised here.
        """
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id.encode(), []).append(fut)
        if self._task is None or self._task.done():
            self._started.clear()
            self._task = asyncio.create_task(self._read(), name="sluice-result-waiter")
        task = self._task
        started = asyncio.ensure_future(self._started.wait())
        try:
            await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if not self._started.is_set():
            self.forget(job_id, fut)
            task.result()  # raises the reader's error
            raise RuntimeError("the result reader ended before it started")  # pragma: no cover
        return fut

    def forget(self, job_id: str, fut: asyncio.Future[Outcome]) -> None:
        key = job_id.encode()
        futs = self._waiters.get(key)
        if futs and fut in futs:
            futs.remove(fut)
            if not futs:
                del self._waiters[key]

    async def _read(self) -> None:
        last = await self._last_id()
        self._started.set()
        while self._waiters:
            try:
                reply: Any = await self._redis.xread({self._key: last}, count=1000, block=self._block_ms)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dropped connection must not strand waiters
                log.warning(
                    "reading the events stream failed (%s: %s); retrying in 0.2s",
                    type(exc).__name__,
                    exc,
                    extra={"error": f"{type(exc).__name__}: {exc}"},
                )
                await asyncio.sleep(0.2)
                continue
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    last = entry_id
                    event = fields.get(b"ev")
                    if event in FINAL_EVENTS:
                        for fut in self._waiters.pop(fields.get(b"id", b""), ()):
                            if not fut.done():
                                fut.set_result(Outcome(event, fields))

    async def _last_id(self) -> bytes:
        newest: Any = await self._redis.xrevrange(self._key, count=1)
        return bytes(newest[0][0]) if newest else b"0-0"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # A reader that failed to start already raised its error to the waiter.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        for futs in self._waiters.values():
            for fut in futs:
                fut.cancel()
        self._waiters.clear()


async def follow(
    redis: Redis, events_key: str, *, since: str = "$", block_ms: int = 1000
) -> AsyncIterator[Event]:
    """Yield events as they are written (``since='0'`` replays the stream first)."""
    last: str | bytes = since
    if since == "$":
        newest: Any = await redis.xrevrange(events_key, count=1)
        last = newest[0][0] if newest else b"0-0"
    while True:
        reply: Any = await redis.xread({events_key: last}, count=500, block=block_ms)
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                last = entry_id
                yield Event.parse(entry_id, fields)
