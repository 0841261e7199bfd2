"""The ceiling the peer harness's job sets for any Python worker: the job body alone.

Every job in bench-peers runs ``benchcore.mark_done_async()``: one HINCRBY
through a redis-py asyncio client (a connection pool). This script runs
nothing but that, from ``concurrency`` tasks in one process under uvloop
(as a ``sluice worker`` runs), so no queue is involved at all. Its rate and
CPU per call bound what a Python worker can reach in the harness: a worker
adds its own dequeue/ack work on top. Node BullMQ's job does the same HINCRBY
through ioredis, on one pipelined connection.

    .venv/bin/python benchmarks/job_body_ceiling.py --redis redis://127.0.0.1:6390/0

The job counts into ``bench:done`` of the given DB, which it deletes before and
after (run it on the benchmark Redis, not on one holding data you need).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

PEERS = Path(os.environ.get("BENCH_PEERS", "/work/shared/bench-peers"))


async def measure(concurrency: int, calls: int) -> dict[str, Any]:
    import benchcore

    per_task = calls // concurrency

    async def lane() -> None:
        for _ in range(per_task):
            await benchcore.mark_done_async()

    await benchcore.mark_done_async()  # connect outside the timing
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    n = per_task * concurrency
    return {
        "concurrency": concurrency,
        "calls": n,
        "rate": round(n / wall, 1),
        "cpu_us_per_call": round(cpu / n * 1e6, 1),
    }


async def main(url: str, concurrencies: list[int], calls: int, reps: int) -> list[dict[str, Any]]:
    import benchcore
    import redis.asyncio as aioredis

    os.environ[benchcore.ENV_URL] = url
    admin = aioredis.Redis.from_url(url)
    out = []
    try:
        for rep in range(reps):
            for c in concurrencies:
                await admin.delete(benchcore.DONE_KEY)
                row = await measure(c, calls)
                row["rep"] = rep + 1
                out.append(row)
                print(
                    f"concurrency {c:3d}: {row['rate']:8,.0f} HINCRBY/s, "
                    f"{row['cpu_us_per_call']:6.1f} µs CPU per call (rep {rep + 1})"
                )
        await admin.delete(benchcore.DONE_KEY)
    finally:
        await admin.aclose()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", default="redis://127.0.0.1:6390/0")
    ap.add_argument("--concurrency", type=int, action="append", default=None)
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if urlparse(args.redis).hostname not in {"127.0.0.1", "localhost", "::1"}:
        sys.exit("only a loopback Redis is allowed")
    sys.path.insert(0, str(PEERS))
    import uvloop

    rows = uvloop.run(main(args.redis, args.concurrency or [10, 50], args.calls, args.reps))
    if args.json:
        args.json.write_text(json.dumps({"load_avg": os.getloadavg(), "runs": rows}, indent=1) + "\n")
