"""``sluice bench``: benchmarks that print a table and write JSON.

Performance is measured here, never by timed tests: a figure is only worth
something next to the machine, the load and the peers it was measured with
(see benchmarks/README.md for the peer comparison).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from sluice.cli.runtime import run
from sluice.cli.server import ENV_URL
from sluice.engine.connection import connect

console = Console()

bench_app = typer.Typer(help="Benchmarks: figures on the terminal, details in JSON.", no_args_is_help=True)

RedisOpt = Annotated[
    str | None,
    typer.Option(help=f"Redis URL (default ${ENV_URL}, else a throw-away embedded redis-server)."),
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write every figure to this JSON file.")]


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        refresh_per_second=4,
    )


@bench_app.command("throughput")
def throughput(
    jobs: Annotated[int, typer.Option(min=1, max=1_000_000, help="No-op jobs per run.")] = 10_000,
    concurrency: Annotated[
        list[int] | None,
        typer.Option("--concurrency", "-c", min=1, help="Jobs at once per process (repeatable)."),
    ] = None,
    processes: Annotated[
        list[int] | None,
        typer.Option("--processes", "-p", min=1, max=16, help="Worker processes (repeatable)."),
    ] = None,
    reps: Annotated[int, typer.Option(min=1, max=20, help="Repetitions of every configuration.")] = 1,
    count: Annotated[
        bool, typer.Option(help="The job HINCRBYs a counter like the peers' job (--no-count: does nothing).")
    ] = True,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds one run may take.")] = 120.0,
    redis: RedisOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Enqueue N no-op jobs in bulk, then drain them with 1 and 2 worker processes."""
    # Imported here: every `sluice` command (a worker's start-up too) loads this module.
    from sluice.lab.common import bench_redis, machine_meta
    from sluice.lab.report import throughput_table
    from sluice.lab.throughput import DrainSpec, drain_once, summarize

    specs = [
        DrainSpec(jobs, p, c, timeout, count)
        for _ in range(reps)
        for c in concurrency or [10, 50]
        for p in processes or [1, 2]
    ]

    async def go(url: str, origin: str) -> dict[str, Any]:
        client = connect(url)
        try:
            meta = await machine_meta(client, url, origin)
            runs = []
            with tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as logs, progress_bar() as bar:
                for i, spec in enumerate(specs):
                    label = f"c={spec.concurrency} p={spec.processes} run {i + 1}/{len(specs)}"
                    task = bar.add_task(label, total=spec.jobs)

                    def show(done: int, task: TaskID = task) -> None:
                        bar.update(task, completed=done)

                    runs.append(await drain_once(client, url, spec, Path(logs), show))
                    print_warnings(runs[-1])
        finally:
            await client.aclose()
        return {"meta": {**meta, "jobs": jobs, "reps": reps}, "summary": summarize(runs), "runs": runs}

    with bench_redis(redis) as (url, origin):
        data = run(go(url, origin))
    console.print(throughput_table(data["summary"], jobs))
    save_json(json_path, data)


@bench_app.command("latency")
def latency(
    samples: Annotated[int, typer.Option(min=1, max=100_000, help="Measured samples.")] = 300,
    warmup: Annotated[int, typer.Option(min=1, max=10_000, help="Samples run first and not counted.")] = 20,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="The worker's concurrency.")
    ] = 10,
    idle_gap: Annotated[
        float, typer.Option(min=0, max=60, help="Seconds the worker sits idle before each sample.")
    ] = 0.0,
    redis: RedisOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """One idle worker process: add one job and await its result, sample after sample."""
    from sluice.lab.common import bench_redis, machine_meta
    from sluice.lab.latency import LatencySpec, latency_run
    from sluice.lab.report import latency_table

    spec = LatencySpec(samples, warmup, concurrency, idle_gap, deadline=max(300.0, samples * (idle_gap + 1)))

    async def go(url: str, origin: str) -> dict[str, Any]:
        client = connect(url)
        try:
            meta = await machine_meta(client, url, origin)
            with tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as logs, progress_bar() as bar:
                task = bar.add_task("round trips", total=warmup + samples)
                result = await latency_run(
                    client, url, spec, Path(logs), lambda done: bar.update(task, completed=done)
                )
        finally:
            await client.aclose()
        return {"meta": meta, "latency": result}

    with bench_redis(redis) as (url, origin):
        data = run(go(url, origin))
    console.print(latency_table(data["latency"]))
    for error in data["latency"]["errors"][:5]:
        console.print(f"[yellow]{error}[/yellow]")
    save_json(json_path, data)


def print_warnings(result: dict[str, Any]) -> None:
    for warning in result.get("warnings") or []:
        console.print(f"[yellow]warning:[/yellow] {warning[:500]}")


def save_json(path: Path | None, data: dict[str, Any]) -> None:
    from sluice.lab.common import write_json

    if path is not None:
        write_json(path, data)
        console.print(f"[dim]wrote {path}[/dim]")
