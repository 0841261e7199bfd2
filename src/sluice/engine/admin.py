"""Looking after a queue: counts, listings, live workers and the dead-letter queue.

A part of a queue (core.py), whose calls :class:`~sluice.engine.queue.Queue`
offers beside the producer's (queue.py) and the flow controls (flow.py); the
worker protocol lives apart (protocol.py), since only workers speak it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from sluice.engine.job import JobRecord, JobState
from sluice.engine.keys import check_job_id
from sluice.engine.sketch import (
    METRICS,
    OTHER_PRIORITIES,
    RELATIVE_ACCURACY,
    Percentiles,
    bucket_keys,
    buckets,
    merge,
    short_name,
    summarize,
)
from sluice.engine.transport import reads, writes
from sluice.errors import InvalidJobError, JobNotFound, JobStateError

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.core import QueueCore
    from sluice.engine.records import JobRecords

#: Cumulative counters of the ``stats`` hash, in the order ``counts()`` gives them.
#: How long a heartbeat without an entry in the alive set (an older worker's) counts.
LEGACY_ALIVE_MS = 120_000

COUNTERS = (
    "added",
    "completed",
    "failed",
    "retried",
    "stalled",
    "cancelled",
    "released",
    "stale_refused",
    "orphaned",
    "throttled",
    "rejected",
    "exhausted",
    "unknown_outcome",
    "overrun",
)

#: The dispatch script's gates, as its refusals are counted (``refused:<gate>`` in stats).
GATES = ("paused", "throttled", "concurrency", "rate", "token_rate", "budget")

#: Ids per redrive / purge script call: bounded work per call.
ADMIN_CHUNK = 500


@dataclass(frozen=True, slots=True)
class LatencyWindow:
    """Latency percentiles of one queue over one sliding window (see engine/sketch.py).

    ``metrics`` maps queue_wait, processing and end_to_end to their count and
    p50/p95/p99 in ms. Each percentile is within ``accuracy`` (relative) of the
    exact value at rank ``floor(q * (n - 1))`` of the samples flushed so far; the
    window covers between ``window_s`` and one bucket more (10 s up to 6 min,
    1 min above).
    """

    window_s: float
    accuracy: float
    metrics: dict[str, Percentiles]

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "accuracy": self.accuracy,
            "metrics": {name: p.to_dict() for name, p in self.metrics.items()},
        }


@dataclass(frozen=True, slots=True)
class LatencySeries:
    """Latency percentiles of one queue per time bucket (:meth:`QueueAdmin.latency_series`).

    ``starts_ms[i]`` is when bucket ``i`` began (Redis's clock); ``metrics`` maps
    queue_wait, processing and end_to_end to one :class:`Percentiles` per bucket,
    each within ``accuracy`` of the exact value at its rank among that bucket's samples.
    """

    step_ms: int
    starts_ms: list[int]
    accuracy: float
    metrics: dict[str, list[Percentiles]]
    resolution: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_ms": self.step_ms,
            "resolution": self.resolution,
            "accuracy": self.accuracy,
            "starts_ms": self.starts_ms,
            "metrics": {name: [p.to_dict() for p in points] for name, points in self.metrics.items()},
        }


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker's last heartbeat (written at start and every lease/3)."""

    id: str
    names: tuple[str, ...]
    concurrency: int | None
    seen_ms: int | None


class QueueAdmin:
    """A queue's calls for operators and dashboards (offered by :class:`Queue`)."""

    def __init__(self, core: QueueCore, records: JobRecords) -> None:
        self.keys = core.keys
        self.scripts = core.scripts
        self.events_maxlen = core.events_maxlen
        self._core = core
        self._records = records

    @property
    def redis(self) -> Redis:
        return self._core.redis

    @reads
    async def counts(self) -> dict[str, int]:
        """Jobs in each live state now, and cumulative counters since the queue began.

        Live: waiting, delayed, parked (waiting for a budget), active, dead.
        Cumulative: added, completed, failed (attempts), retried, stalled,
        cancelled, released, dead_total, stale_refused (late answers from
        workers that had lost their lease), orphaned (queue entries whose
        record had vanished), throttled (attempts the provider refused),
        rejected (jobs their budget refused before they spent), exhausted (jobs their
        budget refused to run again after earlier attempts spent), unknown_outcome (reservations
        kept charged because the attempt's outcome is unknown), overrun
        (attempts stopped hard past their timeout; also counted in failed).
        """
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in (k.waiting, k.delayed, k.active, k.dead):
                pipe.zcard(key)
            pipe.hgetall(k.stats)
            pipe.zrange(k.parkedby, 0, -1)
            waiting, delayed, active, dead, stats, parked_on = await pipe.execute()
        parked = 0
        if parked_on:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name in parked_on:
                    pipe.zcard(k.parked_prefix + name.decode())
                parked = sum(await pipe.execute())
        out = {"waiting": waiting, "delayed": delayed, "parked": parked, "active": active, "dead": dead}
        for name in COUNTERS:
            out[name] = int(stats.get(name.encode(), 0))
        out["dead_total"] = int(stats.get(b"dead", 0))
        return out

    @reads
    async def ids(self, state: JobState, offset: int = 0, limit: int = 100) -> list[str]:
        """Ids of jobs in a live state, in the order they will run (or died).

        Parked jobs are kept per budget; their ids come in waiting order
        across all budgets.
        """
        if state is JobState.PARKED:
            return (await self._parked_ids())[offset : offset + limit]
        key = {
            JobState.WAITING: self.keys.waiting,
            JobState.DELAYED: self.keys.delayed,
            JobState.ACTIVE: self.keys.active,
            JobState.DEAD: self.keys.dead,
        }.get(state)
        if key is None:
            raise InvalidJobError(
                f"finished jobs of state {state} are not indexed; "
                "use waiting, delayed, parked, active or dead"
            )
        raw: list[bytes] = await self.redis.zrange(key, offset, offset + limit - 1)  # type: ignore[assignment]
        return [r.decode() for r in raw]

    async def _parked_ids(self) -> list[str]:
        k = self.keys
        names: list[bytes] = await self.redis.zrange(k.parkedby, 0, -1)  # type: ignore[assignment]
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.zrange(k.parked_prefix + name.decode(), 0, -1, withscores=True)
            sets: list[list[tuple[bytes, float]]] = await pipe.execute()
        return [m.decode() for m, _ in sorted((e for s in sets for e in s), key=lambda e: e[1])]

    @reads
    async def workers(self) -> list[WorkerInfo]:
        """Workers serving this queue now, with their last heartbeat (Redis's clock).

        A worker counts as gone once it misses heartbeats for two leases (see
        lua/heartbeat.lua); gone workers are left out here and removed from
        Redis by the next heartbeat of any worker.
        """
        k = self.keys
        now = await self._core.now_ms()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(k.workers)
            pipe.zrange(k.alive, 0, -1, withscores=True)
            raw, alive = await pipe.execute()
        until = {wid: score for wid, score in alive}
        out: list[WorkerInfo] = []
        for wid, beat in sorted(raw.items()):
            try:
                data: Any = orjson.loads(beat)
                names = tuple(str(n) for n in data.get("names", ()))
                concurrency = data.get("concurrency")
                seen = data.get("seen_ms")
            except (orjson.JSONDecodeError, AttributeError, TypeError):
                names, concurrency, seen = (), None, None
            seen = seen if isinstance(seen, int) else None
            # A heartbeat of a version without the alive set counts for two minutes.
            deadline = until.get(wid, (seen + LEGACY_ALIVE_MS) if seen is not None else 0)
            if deadline < now:
                continue
            out.append(
                WorkerInfo(
                    wid.decode(errors="replace"),
                    names,
                    concurrency if isinstance(concurrency, int) else None,
                    seen,
                )
            )
        return out

    @reads
    async def latency(self, window_seconds: float = 60.0, *, now: int | None = None) -> LatencyWindow:
        """Percentiles of queue wait, processing and end-to-end time over the last
        ``window_seconds`` (up to 3,780), from the bins every worker flushes.

        queue_wait: from when the attempt became runnable (the job's creation, or the
        end of its delay or retry backoff) to its dispatch; processing: dispatch to
        outcome; end_to_end: creation to the outcome that ended the job (completed or
        dead). ``now`` (ms) replaces Redis's clock (tests).
        """
        window_ms = int(window_seconds * 1000)
        at = now if now is not None else await self._core.now_ms()
        per_metric = [bucket_keys(self.keys, metric, at, window_ms) for metric in METRICS]
        async with self.redis.pipeline(transaction=False) as pipe:
            for keys in per_metric:
                for key in keys:
                    pipe.hgetall(key)
            raw: list[dict[bytes, bytes]] = await pipe.execute()
        out: dict[str, Percentiles] = {}
        start = 0
        for metric, keys in zip(METRICS, per_metric, strict=True):
            out[metric] = summarize(merge(raw[start : start + len(keys)]))
            start += len(keys)
        return LatencyWindow(window_seconds, RELATIVE_ACCURACY, out)

    @reads
    async def latency_series(self, window_seconds: float = 300.0, *, now: int | None = None) -> LatencySeries:
        """Percentiles per bucket over the last ``window_seconds`` (up to 3,780): one point
        per 10 s up to 6 min, per minute above; what a chart of the tail over time needs.
        A bucket still filling (the last one) is included; one without samples has count 0."""
        at = now if now is not None else await self._core.now_ms()
        res, size, numbers = buckets(at, int(window_seconds * 1000))
        async with self.redis.pipeline(transaction=False) as pipe:
            for metric in METRICS:
                for key in bucket_keys(self.keys, metric, at, int(window_seconds * 1000)):
                    pipe.hgetall(key)
            raw: list[dict[bytes, bytes]] = await pipe.execute()
        per = len(numbers)
        points = {
            metric: [summarize(merge([h])) for h in raw[i * per : (i + 1) * per]]
            for i, metric in enumerate(METRICS)
        }
        return LatencySeries(size, [n * size for n in numbers], RELATIVE_ACCURACY, points, res)

    @reads
    async def refusals(self) -> dict[str, int]:
        """Dispatch calls each gate refused since the queue began (one per gate per call,
        however many jobs it turned away): paused, throttled, concurrency, rate,
        token_rate (the token-rate window was full, or a job's estimate exceeded it), budget (a
        budget rejected, parked or held back a job)."""
        raw = await self.redis.hmget(self.keys.stats, [f"refused:{gate}" for gate in GATES])
        return {gate: int(v or 0) for gate, v in zip(GATES, raw, strict=True)}

    @reads
    async def latency_totals(self) -> dict[str, dict[str, dict[str, int]]]:
        """Every latency metric's cumulative bins since the queue began, per priority
        (engine/sketch.py): queue_wait, processing, end_to_end -> {priority: {bin: count}}.
        The first 32 priorities the queue saw have their own; later ones share ``other``."""
        members = await self.redis.smembers(self.keys.latency_priorities)
        labels = sorted((m.decode() if isinstance(m, bytes) else m for m in members), key=_priority_order)
        labels.append(OTHER_PRIORITIES)
        async with self.redis.pipeline(transaction=False) as pipe:
            for metric in METRICS:
                for label in labels:
                    pipe.hgetall(self.keys.latency_total(short_name(metric), label))
            raw: list[dict[bytes, bytes]] = await pipe.execute()
        out: dict[str, dict[str, dict[str, int]]] = {}
        for i, metric in enumerate(METRICS):
            hashes = raw[i * len(labels) : (i + 1) * len(labels)]
            out[metric] = {label: merge([h]) for label, h in zip(labels, hashes, strict=True) if h}
        return out

    async def dead_letters(self, offset: int = 0, limit: int = 100) -> list[JobRecord]:
        """Dead-lettered jobs, oldest first, with their last error."""
        ids = await self.ids(JobState.DEAD, offset, limit)
        return [r for r in await self._records.get_jobs(ids) if r is not None]

    @writes
    async def redrive(self, job_ids: Iterable[str] | None = None) -> int:
        """Move dead jobs (all if ``job_ids`` is None) back to waiting, attempts reset."""
        ids = list(job_ids) if job_ids is not None else await self._all_dead()
        for job_id in ids:
            check_job_id(job_id)
        if job_ids is not None:
            await self._check_dead(ids, "only dead jobs can be redriven")
        moved = 0
        for chunk in _chunks(ids, ADMIN_CHUNK):
            codes = await self._core.run(self._core.commands.redrive(chunk))
            # A job that left the dead set since the check (another redrive) is skipped.
            moved += sum(code == 1 for code in codes)
        return moved

    async def _check_dead(self, ids: list[str], wanted: str) -> None:
        """Refuse the whole call, before any change, if one of ``ids`` is missing or not dead."""
        for chunk in _chunks(ids, ADMIN_CHUNK):
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in chunk:
                    pipe.hget(self.keys.job(job_id), "state")
                states: list[bytes | None] = await pipe.execute()
            for job_id, state in zip(chunk, states, strict=True):
                if state is None:
                    raise JobNotFound(job_id)
                if state != b"dead":
                    raise JobStateError(job_id, state.decode(), wanted)

    @writes
    async def purge_dead(self, job_ids: Iterable[str] | None = None) -> int:
        """Delete dead jobs for good (all if ``job_ids`` is None)."""
        ids = list(job_ids) if job_ids is not None else await self._all_dead()
        for job_id in ids:
            check_job_id(job_id)
        removed = 0
        for chunk in _chunks(ids, ADMIN_CHUNK):
            removed += await self._core.run(self._core.commands.purge(chunk))
        return removed

    async def _all_dead(self) -> list[str]:
        raw: list[bytes] = await self.redis.zrange(self.keys.dead, 0, -1)  # type: ignore[assignment]
        return [r.decode() for r in raw]


def _chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _priority_order(label: str) -> tuple[int, str]:
    """Priorities in their numeric order (a label that is not a number, last)."""
    try:
        return int(label), ""
    except ValueError:
        return 2**63, label
