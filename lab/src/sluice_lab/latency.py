"""Round-trip latency: one idle worker process; add one job, ``await job.result()``.

This is what a caller waiting on a job sees end to end: the add script, the
worker's wake-up from its blocking BZPOPMIN, the dispatch round trip, the
job, the outcome round trip, and the result arriving on the events stream.
Samples run one after another (never overlapping), after warm-ups that
absorb the worker's start-up and the first script loads, like the harness's
``lat`` mode; ``idle_gap`` > 0 lets the worker sit idle before each sample
(its ``lat_idle`` mode), which exposes back-off polling if there were any.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engine.queue import Queue
from sluice_lab.common import drop_queue, new_queue_name
from sluice_lab.noop import ENV_DONE_KEY, ENV_URL
from sluice_lab.procs import WorkerGroup, redis_cpu_s
from sluice_lab.stats import per_job_us, summarize_ms

if TYPE_CHECKING:
    from redis.asyncio import Redis

Progress = Callable[[int], None]

#: Most errors recorded before a run gives up (every loop here is bounded).
MAX_ERRORS = 20


@dataclass(frozen=True, slots=True)
class LatencySpec:
    samples: int = 300
    warmup: int = 20
    concurrency: int = 10
    idle_gap: float = 0.0
    #: seconds one sample may take (the first one also covers worker start-up: 60 s)
    timeout: float = 10.0
    #: seconds the whole run may take
    deadline: float = 300.0


async def latency_run(
    redis: Redis, url: str, spec: LatencySpec, log_dir: Path | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    name = new_queue_name("lat")
    queue = Queue(name, redis=redis)
    done_key = queue.keys.base + "bench-done"
    group = WorkerGroup(
        url, name, spec.concurrency, env={ENV_URL: url, ENV_DONE_KEY: done_key}, log_dir=log_dir
    )
    out: dict[str, Any] = {
        "concurrency": spec.concurrency,
        "warmup": spec.warmup,
        "idle_gap_s": spec.idle_gap,
    }
    try:
        group.start(1)
        out.update(await _sample(redis, queue, group, spec, progress))
        out["peak_rss_mib"] = group.peak_rss_mib()
        out["graceful_exit_s"] = group.stop()
    finally:
        if group.procs:
            group.stop()
        await queue.close()
        await drop_queue(redis, name)
    return out


async def _sample(
    redis: Redis, queue: Queue, group: WorkerGroup, spec: LatencySpec, progress: Progress | None
) -> dict[str, Any]:
    samples: list[float] = []
    errors: list[str] = []
    t_start = time.monotonic()
    cpu0 = redis_cpu0 = 0.0
    for i in range(spec.warmup + spec.samples):
        if time.monotonic() - t_start > spec.deadline:
            errors.append(f"deadline of {spec.deadline} s reached after {len(samples)} samples")
            break
        if i == spec.warmup:
            cpu0, redis_cpu0 = sum(group.cpu_s().values()), await redis_cpu_s(redis)
        if spec.idle_gap and i >= spec.warmup:
            await asyncio.sleep(spec.idle_gap)
        t0 = time.perf_counter()
        try:
            job = await queue.add("noop")
            await job.result(timeout=60.0 if i == 0 else spec.timeout)
        except Exception as exc:  # noqa: BLE001 - record and go on, bounded by MAX_ERRORS
            errors.append(f"sample {i}: {type(exc).__name__}: {exc}"[:300])
            if len(errors) > MAX_ERRORS or group.exited():
                errors.append(f"worker log: {group.log_tail('w1')}")
                break
            continue
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        if i >= spec.warmup:
            samples.append(elapsed_ms)
        if progress is not None:
            progress(i + 1)
    cpu = sum(group.cpu_s().values()) - cpu0
    redis_cpu = await redis_cpu_s(redis) - redis_cpu0
    return {
        **summarize_ms(samples),
        "errors": errors,
        "worker_cpu_us_per_job": per_job_us(cpu, len(samples)),
        "redis_cpu_us_per_job": per_job_us(redis_cpu, len(samples)),
        "wall_s": round(time.monotonic() - t_start, 2),
        "samples_ms": [round(x, 4) for x in samples],
    }
