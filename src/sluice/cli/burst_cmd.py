"""``sluice bench burst``: N jobs at once on serving workers; drain time, peak depth, latency.

Registered on ``bench_app`` when imported (``sluice.cli.app`` imports it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import TaskID

from sluice.cli.bench_cmd import (
    JsonOpt,
    RedisOpt,
    bench_app,
    console,
    print_warnings,
    progress_bar,
    save_json,
)
from sluice.cli.runtime import run
from sluice.engine.connection import connect

if TYPE_CHECKING:
    from rich.table import Table


@bench_app.command("burst")
def burst(
    jobs: Annotated[
        list[int] | None,
        typer.Option(
            "--jobs", "-n", min=1, max=1_000_000, help="Jobs added at once (repeatable; default 500)."
        ),
    ] = None,
    processes: Annotated[int, typer.Option("--processes", "-p", min=1, max=16, help="Worker processes.")] = 2,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="Jobs at once per process.")
    ] = 50,
    work_ms: Annotated[
        float, typer.Option(min=0, max=60_000, help="Milliseconds each job sleeps (0: returns at once).")
    ] = 0.0,
    reps: Annotated[int, typer.Option(min=1, max=20, help="Repetitions of every burst size.")] = 1,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds one drain may take.")] = 120.0,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write the depth-over-time PNG here (default: next to --json, as .png)."),
    ] = None,
    redis: RedisOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Add N jobs at once to a queue with serving workers: drain time, peak depth, latency percentiles."""
    # Imported here: every `sluice` command (a worker's start-up too) loads this module.
    from sluice.lab.burst import PEER_NOTE, SAMPLE_S, BurstSpec, burst_once, summarize, write_plot
    from sluice.lab.common import bench_redis, machine_meta

    specs = [
        BurstSpec(n, processes, concurrency, work_ms, timeout) for n in jobs or [500] for _ in range(reps)
    ]

    async def go(url: str, origin: str) -> dict[str, Any]:
        client = connect(url)
        runs = []
        try:
            meta = await machine_meta(client, url, origin)
            with tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as logs, progress_bar() as bar:
                for i, spec in enumerate(specs):
                    task = bar.add_task(f"{spec.jobs:,} jobs run {i + 1}/{len(specs)}", total=spec.jobs)

                    def show(done: int, task: TaskID = task) -> None:
                        bar.update(task, completed=done)

                    runs.append(await burst_once(client, url, spec, Path(logs), show))
                    print_warnings(runs[-1])
        finally:
            await client.aclose()
        return {
            "meta": {
                **meta,
                "processes": processes,
                "concurrency": concurrency,
                "work_ms": work_ms,
                "reps": reps,
                "sample_interval_ms": SAMPLE_S * 1000,
                "peers": PEER_NOTE,
            },
            "summary": summarize(runs),
            "runs": runs,
        }

    with bench_redis(redis) as (url, origin):
        data = run(go(url, origin))
    console.print(burst_table(data))
    save_json(json_path, data)
    if plot is None and json_path is not None:
        plot = json_path.with_suffix(".png")
    if plot is not None:
        from sluice.errors import MissingExtra

        try:
            console.print(f"[dim]wrote {write_plot(data, plot)}[/dim]")
        except MissingExtra as exc:
            console.print(f"[yellow]no plot:[/yellow] {exc}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def burst_table(data: dict[str, Any]) -> Table:
    """One row per burst size (medians over the repetitions)."""
    from rich.table import Table

    meta = data["meta"]
    table = Table(
        title=(
            f"Burst: N jobs at once on {meta['processes']} worker process(es) x c={meta['concurrency']}, "
            f"job {meta['work_ms']:g} ms (medians of {meta['reps']} run(s))"
        ),
        caption=(
            f"{meta['peers']}. Drain: from the add to the last completion; depth sampled every "
            f"{meta['sample_interval_ms']:g} ms. Latency: Queue.latency(60), ms, within 1 %."
        ),
    )
    for col in ("jobs", "drain s", "jobs/s", "peak waiting", "lost/dup"):
        table.add_column(col, justify="right")
    for metric in ("wait", "processing", "end to end"):
        table.add_column(f"{metric} p50/p95/p99", justify="right")
    for row in data["summary"]:
        lat = [
            "/".join(_ms(row[m][q]) for q in ("p50", "p95", "p99"))
            for m in ("queue_wait", "processing", "end_to_end")
        ]
        table.add_row(
            f"{row['jobs']:,}",
            "-" if row["drain_s"] is None else f"{row['drain_s']:.3f}",
            "-" if row["rate"] is None else f"{row['rate']:,.0f}",
            "-" if row["peak_waiting"] is None else f"{row['peak_waiting']:,.0f}",
            f"{row['lost_max']}/{row['duplicates_max']}",
            *lat,
        )
    return table
