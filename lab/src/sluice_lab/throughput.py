"""Throughput: enqueue N no-op jobs in bulk, then time worker processes draining them.

The method is the peer harness's (bench-peers/run.py), so that Sluice's
figures sit next to the peers' on equal terms:

* all N jobs are added (``add_bulk``) before any worker starts, so the
  enqueue rate and the drain rate are measured apart;
* the drain rate is taken over the steady-state window: from the first
  completed job (with several processes: from the moment every process has
  completed one) until all N are done, so interpreter start-up is excluded
  (the JSON has the rate including start-up too);
* every job counts itself (``HINCRBY``, see :mod:`sluice_lab.noop`), so a
  lost or twice-run job shows, whatever the engine's own counters say;
* CPU is read from the OS for the workers (psutil) and from INFO for Redis,
  over the same window, and per job including start-up as the harness does.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engine.job import JobSpec
from sluice.engine.queue import BULK_CHUNK, Queue
from sluice_lab.common import drop_queue, new_queue_name
from sluice_lab.noop import ENV_DONE_KEY, ENV_URL
from sluice_lab.procs import WorkerGroup, redis_cpu_s
from sluice_lab.stats import per_job_us, rate

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: Seconds between two reads of the completion counters: fine enough for a
#: window of a second or more, coarse enough not to load a 2-core machine.
POLL_S = 0.005
#: Seconds to wait after the last job for duplicates to show up.
SETTLE_S = 0.5

Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class DrainSpec:
    """One throughput measurement."""

    jobs: int
    processes: int
    concurrency: int
    timeout: float = 120.0
    #: True: the job HINCRBYs a counter like the peers' job; False: the job does nothing
    count_in_job: bool = True


@dataclass(slots=True)
class _Mark:
    """A moment of the drain: when, how many jobs were done, CPU used so far."""

    t: float
    done: int
    worker_cpu: float
    redis_cpu: float


async def drain_once(
    redis: Redis, url: str, spec: DrainSpec, log_dir: Path | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Enqueue ``spec.jobs`` jobs, run ``spec.processes`` workers until all are done."""
    name = new_queue_name("tp")
    queue = Queue(name, redis=redis)
    done_key = queue.keys.base + "bench-done"
    env = {ENV_URL: url, ENV_DONE_KEY: done_key} if spec.count_in_job else {}
    group = WorkerGroup(url, name, spec.concurrency, env=env, log_dir=log_dir)
    out: dict[str, Any] = {"processes": spec.processes, "concurrency": spec.concurrency, "n": spec.jobs}
    try:
        out.update(await _enqueue(redis, queue, spec.jobs))
        out.update(await _drain(redis, queue, group, spec, done_key, progress))
    finally:
        if group.procs:
            out["graceful_exit_s"] = group.stop()
        await queue.close()
        await drop_queue(redis, name)
    return out


async def _enqueue(redis: Redis, queue: Queue, n: int) -> dict[str, Any]:
    cpu0 = await redis_cpu_s(redis)
    t0 = time.perf_counter()
    await queue.add_bulk(JobSpec("noop") for _ in range(n))
    elapsed = time.perf_counter() - t0
    cpu = await redis_cpu_s(redis) - cpu0
    return {
        "enqueue_s": round(elapsed, 4),
        "enqueue_rate": rate(n, elapsed),
        "enqueue_redis_cpu_us_per_job": per_job_us(cpu, n),
        "enqueue_method": f"Queue.add_bulk (one add script call per {BULK_CHUNK} jobs)",
    }


async def _done_counts(redis: Redis, queue: Queue, done_key: str, count_in_job: bool) -> dict[str, int]:
    if count_in_job:
        raw: Any = await redis.hgetall(done_key)
        return {k.decode(): int(v) for k, v in raw.items()}
    completed: Any = await redis.hget(queue.keys.stats, "completed")
    return {"all": int(completed or 0)}


async def _drain(
    redis: Redis, queue: Queue, group: WorkerGroup, spec: DrainSpec, done_key: str, progress: Progress | None
) -> dict[str, Any]:
    n = spec.jobs

    async def mark(done: int) -> _Mark:
        return _Mark(time.perf_counter(), done, sum(group.cpu_s().values()), await redis_cpu_s(redis))

    launch = await mark(0)
    group.start(spec.processes)
    wids = list(group.ids)
    deadline = launch.t + spec.timeout
    first = everyone = finished = None
    warnings: list[str] = []
    while True:
        counts = await _done_counts(redis, queue, done_key, spec.count_in_job)
        total = sum(counts.values())
        if progress is not None:
            progress(total)
        if first is None and total > 0:
            first = await mark(total)
        if everyone is None and all(counts.get(w, 0) > 0 for w in wids):
            everyone = await mark(total)
        if total >= n:
            finished = await mark(total)
            break
        if time.perf_counter() > deadline:
            warnings.append(f"time limit of {spec.timeout} s reached with {total}/{n} jobs done")
            break
        if len(group.exited()) == len(wids):
            tails = {w: group.log_tail(w) for w in wids}
            warnings.append(f"all workers exited early: {tails}")
            break
        await asyncio.sleep(POLL_S)
    end = finished or await mark(total)
    if finished is not None:
        await asyncio.sleep(SETTLE_S)
    final = await _done_counts(redis, queue, done_key, spec.count_in_job)
    final_total = sum(final.values())
    if spec.processes > 1 and everyone is None:
        warnings.append("not every worker process completed a job")
    start, kind = first, "first-job"
    if spec.processes > 1 and everyone is not None:
        start, kind = everyone, "all-workers-active"
    window_jobs = end.done - start.done if start else 0
    window_s = end.t - start.t if start else None
    worker_cpu = end.worker_cpu - start.worker_cpu if start else None
    redis_cpu = end.redis_cpu - start.redis_cpu if start else None
    cpu_total = sum(group.cpu_s().values())
    out: dict[str, Any] = {
        "complete": finished is not None,
        "completed": final_total,
        "duplicates": max(0, final_total - n),
        "lost_or_unfinished": max(0, n - final_total),
        "per_worker": final,
        "startup_to_first_job_s": round(first.t - launch.t, 3) if first else None,
        "all_active_after_s": round(everyone.t - launch.t, 3) if everyone else None,
        "window": kind,
        "window_s": round(window_s, 4) if window_s else None,
        "window_jobs": window_jobs,
        "process_rate": rate(window_jobs, window_s),
        "wall_incl_startup_s": round(end.t - launch.t, 3),
        "process_rate_incl_startup": rate(end.done, end.t - launch.t),
        "worker_cpu_us_per_job": per_job_us(worker_cpu, window_jobs),
        "redis_cpu_us_per_job": per_job_us(redis_cpu, window_jobs),
        "worker_cpu_us_per_job_incl_startup": per_job_us(cpu_total, final_total),
        "redis_cpu_us_per_job_drain": per_job_us(end.redis_cpu - launch.redis_cpu, end.done),
        "worker_cpu_s": group.cpu_s(),
        "peak_rss_mib": group.peak_rss_mib(),
        "engine_counts": await queue.counts(),
        "warnings": warnings,
    }
    out["graceful_exit_s"] = group.stop()
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (concurrency, processes) over repetitions, in first-seen order."""
    keys = (
        "enqueue_rate",
        "process_rate",
        "process_rate_incl_startup",
        "worker_cpu_us_per_job",
        "redis_cpu_us_per_job",
        "worker_cpu_us_per_job_incl_startup",
        "startup_to_first_job_s",
    )
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["concurrency"], r["processes"]), []).append(r)
    rows = []
    for (c, p), rs in groups.items():
        row: dict[str, Any] = {"concurrency": c, "processes": p, "runs": len(rs)}
        for k in keys:
            vals = sorted(r[k] for r in rs if r.get(k) is not None)
            row[k] = statistics.median(vals) if vals else None
            row[k + "_all"] = vals
        row["lost_max"] = max(r.get("lost_or_unfinished", 0) for r in rs)
        row["duplicates_max"] = max(r.get("duplicates", 0) for r in rs)
        row["split"] = rs[0].get("per_worker")
        rows.append(row)
    return rows
