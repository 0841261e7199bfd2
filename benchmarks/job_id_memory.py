"""What a job's id costs Redis: the queue's number against the store's UUID.

The service enqueues each job under its store id (a UUID's 36 characters) and
the engine idempotency key ``job:<uuid>``; before one id went end to end it
enqueued the same job under the queue's number (and the same key). This
script adds N jobs shaped as the service's in each way, then completes them
all through the worker protocol (lease, complete, in steps of 500, as a worker
would, minus the handler), and reports per job: the memory Redis holds while
they wait and once they are done and retained, and Redis's CPU for the adds
and the drain. The retained records are what a day's retention keeps.

    .venv/bin/python benchmarks/job_id_memory.py --redis redis://127.0.0.1:6390/0 --jobs 50000

It flushes the given DB before each variant (use a benchmark Redis, not one
holding data you need), and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from redis.asyncio import Redis

from sluice.engine.job import JobSpec
from sluice.engine.protocol import LEASED_FIELDS
from sluice.engine.queue import Queue
from sluice.service.submit import NEST_BACKOFF

VARIANTS = ("numbered", "store id")
STEP = 500


async def _memory(redis: Redis) -> int:
    info: dict[str, Any] = await redis.info("memory")
    return int(info["used_memory"])


async def _cpu_us(redis: Redis) -> float:
    info: dict[str, Any] = await redis.info("cpu")
    return (float(info["used_cpu_user"]) + float(info["used_cpu_sys"])) * 1e6


async def measure(url: str, variant: str, jobs: int) -> dict[str, Any]:
    redis = Redis.from_url(url)
    await redis.flushdb()
    queue = Queue("idmem", redis=redis)
    ids = [uuid.uuid4() for _ in range(jobs)]
    specs = [
        JobSpec(
            "generic",
            {"n": i},
            priority=10,
            max_attempts=10,
            backoff=NEST_BACKOFF,
            idempotency_key=f"job:{job_id}",
            job_id=str(job_id) if variant == "store id" else None,
        )
        for i, job_id in enumerate(ids)
    ]
    # The events stream is trimmed to a length that does not depend on the id: measure the
    # job's own keys, not how many events the stream keeps.
    await redis.xadd(queue.keys.events, {"ev": "start"})
    base, cpu0 = await _memory(redis), await _cpu_us(redis)
    await queue.add_bulk(specs)
    waiting, cpu1 = await _memory(redis), await _cpu_us(redis)
    done = 0
    while done < jobs:
        reply = await queue.protocol.step(want=STEP, lease_ms=60_000, worker_id="w")
        leased = reply.jobs
        outcomes = [
            (leased[i].decode(), leased[i + 1], b"c", b"null", 0, -1)
            for i in range(0, len(leased), LEASED_FIELDS)
        ]
        await queue.protocol.step(want=0, lease_ms=60_000, worker_id="w", outcomes=outcomes)
        done += len(outcomes)
    retained, cpu2 = await _memory(redis), await _cpu_us(redis)
    await redis.delete(queue.keys.events)
    without_events = await _memory(redis)
    await queue.close()
    await redis.flushdb()
    await redis.aclose()
    return {
        "variant": variant,
        "jobs": jobs,
        "bytes_per_waiting_job": round((waiting - base) / jobs, 1),
        "bytes_per_retained_job": round((without_events - base) / jobs, 1),
        "bytes_per_retained_job_with_events": round((retained - base) / jobs, 1),
        "redis_cpu_us_per_add": round((cpu1 - cpu0) / jobs, 2),
        "redis_cpu_us_per_drained_job": round((cpu2 - cpu1) / jobs, 2),
    }


async def main(url: str, jobs: int, reps: int) -> list[dict[str, Any]]:
    rows = []
    for rep in range(reps):
        for variant in VARIANTS:
            row = await measure(url, variant, jobs) | {"rep": rep + 1}
            rows.append(row)
            print(
                f"{variant:>9}: {row['bytes_per_waiting_job']:7.1f} B/job waiting, "
                f"{row['bytes_per_retained_job']:7.1f} B/job retained, Redis CPU "
                f"{row['redis_cpu_us_per_add']:5.1f} µs/add, {row['redis_cpu_us_per_drained_job']:5.1f} "
                f"µs/drained job (rep {rep + 1})"
            )
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", default="redis://127.0.0.1:6390/0")
    ap.add_argument("--jobs", type=int, default=50_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if urlparse(args.redis).hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("job_id_memory.py flushes the DB it is given: only a loopback Redis URL")
    result = asyncio.run(main(args.redis, args.jobs, args.reps))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
