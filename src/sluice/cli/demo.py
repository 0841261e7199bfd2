"""``sluice demo``: two worker processes drain a few hundred jobs of mixed priority.

Both worker processes are serving before every job arrives in one atomic
add, so the order in which jobs start shows the priorities at work; the table
shows which process ran what and how long each priority waited.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import subprocess
import time
from collections import defaultdict
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sluice.cli.runtime import run
from sluice.cli.server import ENV_URL, redis_url
from sluice.engine import JobContext, JobRecord, JobSpec, Queue, Worker
from sluice.engine.connection import connect
from sluice.local.processes import worker_process

console = Console()

#: The demo's worker; `sluice demo` starts it with `sluice worker sluice.cli.demo:worker`.
worker = Worker("demo", concurrency=8, shutdown_grace=5.0)

PRIORITIES = (0, 5, 9)


@worker.handler
async def simulated_llm_call(job: JobContext) -> dict[str, int]:
    """Stands in for an LLM call: waits as long as the payload says."""
    await asyncio.sleep(job.payload["ms"] / 1000)
    return {"tokens": job.payload["tokens"]}


def demo(
    jobs: Annotated[int, typer.Option(min=1, max=100_000, help="How many jobs to enqueue.")] = 300,
    processes: Annotated[int, typer.Option(min=1, max=16, help="Worker processes.")] = 2,
    concurrency: Annotated[int, typer.Option(min=1, help="Jobs at once per worker process.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the simulated workload.")] = 7,
    redis: Annotated[str | None, typer.Option(help=f"Redis URL (default ${ENV_URL}, else embedded).")] = None,
) -> None:
    """Enqueue jobs of mixed priority, run two worker processes, show what ran where."""
    with redis_url(redis, console) as url:
        run(_demo(url, jobs, processes, concurrency, seed))


async def _demo(url: str, n: int, processes: int, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    name = f"demo-{secrets.token_hex(3)}"
    client = connect(url)
    queue = Queue(name, redis=client, known_names=worker.names)
    specs = [
        JobSpec(
            "simulated_llm_call",
            {"ms": rng.randint(5, 30), "tokens": rng.randint(50, 500)},
            priority=rng.choice(PRIORITIES),
        )
        for _ in range(n)
    ]
    procs = [_start_worker(url, name, concurrency, i) for i in range(processes)]
    try:
        # Every process is serving before the jobs arrive in one atomic add, so
        # the order they start in shows the priorities, and each takes a share.
        await _wait_for_workers(queue, procs)
        t0 = time.perf_counter()
        handles = await queue.add_bulk(specs)
        console.print(
            f"{processes} worker processes ready; enqueued {n} jobs on queue [bold]{name}[/bold] "
            f"in one call ({(time.perf_counter() - t0) * 1000:.1f} ms)"
        )
        await _progress(queue, n)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
    records = [r for r in await queue.get_jobs([h.id for h in handles]) if r is not None]
    _report(records, procs)
    # The demo's queue is throw-away: leave nothing behind in the local Redis.
    keys = [k async for k in client.scan_iter(match=queue.keys.base + "*", count=1000)]
    for start in range(0, len(keys), 1000):
        await client.unlink(*keys[start : start + 1000])
    await queue.close()
    await client.aclose()


def _start_worker(url: str, queue: str, concurrency: int, i: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SLUICE_LOG_LEVEL="warning")
    return worker_process(url, queue, concurrency, f"worker-{i + 1}", "sluice.cli.demo:worker", env=env)


async def _wait_for_workers(queue: Queue, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60
    with console.status(f"starting {len(procs)} worker processes"):
        while await queue.redis.hlen(queue.keys.workers) < len(procs):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(
                    "a demo worker process exited at start; run `sluice worker "
                    "sluice.cli.demo:worker` to see why"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("the demo's worker processes did not start within 60 s")
            await asyncio.sleep(0.05)


async def _progress(queue: Queue, n: int) -> None:
    columns = (TextColumn("running jobs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("jobs", total=n)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            counts = await queue.counts()
            bar.update(task, completed=counts["completed"] + counts["dead"])
            if counts["completed"] + counts["dead"] >= n:
                return
            await asyncio.sleep(0.1)
    raise RuntimeError("the demo's jobs did not finish within 120 s; are the worker processes running?")


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _report(records: list[JobRecord], procs: list[subprocess.Popen[bytes]]) -> None:
    groups: dict[tuple[str, int], list[JobRecord]] = defaultdict(list)
    for r in records:
        groups[(r.worker or "?", r.priority)].append(r)
    table = Table(title="What ran where, and how long it waited (ms)")
    for col in ("worker", "priority", "jobs", "wait p50", "wait p95", "wait max", "run p50"):
        table.add_column(col, justify="right" if col not in ("worker",) else "left")
    for (wid, prio), rs in sorted(groups.items()):
        waits = [float((r.started_ms or 0) - r.created_ms) for r in rs]
        runs = [float((r.finished_ms or 0) - (r.started_ms or 0)) for r in rs]
        table.add_row(
            wid,
            str(prio),
            str(len(rs)),
            f"{_pct(waits, 50):.0f}",
            f"{_pct(waits, 95):.0f}",
            f"{max(waits):.0f}",
            f"{_pct(runs, 50):.0f}",
        )
    console.print(table)
    order = sorted(records, key=lambda r: (r.started_ms or 0, int(r.id)))
    firsts = {p: next((i for i, r in enumerate(order) if r.priority == p), -1) for p in PRIORITIES}
    console.print(
        "start order by priority: "
        + ", ".join(f"priority {p}: first started as #{i + 1}" for p, i in firsts.items() if i >= 0)
    )
    done = sum(r.state == "completed" for r in records)
    codes = [p.returncode for p in procs]
    console.print(f"{done}/{len(records)} completed; worker processes exited with {codes} after SIGTERM")
