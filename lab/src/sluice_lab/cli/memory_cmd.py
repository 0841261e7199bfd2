"""``sluice bench memory``: Redis memory under a steady load levels off once retention trims.

Registered on ``bench_app`` when imported (``sluice_lab.cli`` imports it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from sluice.cli.runtime import run
from sluice.engine.connection import connect
from sluice_lab.cli.bench_cmd import (
    JsonOpt,
    RedisOpt,
    bench_app,
    console,
    print_warnings,
    progress_bar,
    save_json,
)


@bench_app.command("memory")
def memory(
    seconds: Annotated[
        float, typer.Option(min=1, help="Seconds of load; the verdict judges the last half.")
    ] = 600.0,
    rate: Annotated[float, typer.Option(min=0.1, help="Jobs added per second, evenly.")] = 100.0,
    retain_seconds: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Retention age of every kind (completed, dead, cancelled, rejected), seconds. "
            "Choose --seconds at least twice it, so the plateau starts after the first records go.",
        ),
    ] = 60.0,
    retain_count: Annotated[
        int | None, typer.Option(min=1, help="Also keep at most this many records per kind.")
    ] = None,
    processes: Annotated[int, typer.Option("--processes", "-p", min=1, max=16, help="Worker processes.")] = 2,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="Jobs at once per process.")
    ] = 16,
    tokens: Annotated[
        int, typer.Option(min=1, help="Each job's token estimate, reserved from the budget.")
    ] = 50,
    budget_window: Annotated[
        float,
        typer.Option(
            min=1,
            help="The budget's rolling window, seconds (its log holds one entry per job for that "
            "long; its limit is twice what the rate reserves in it).",
        ),
    ] = 60.0,
    work_ms: Annotated[float, typer.Option(min=0, help="Milliseconds each job's handler takes.")] = 5.0,
    payload_bytes: Annotated[int, typer.Option(min=0, help="Bytes of each job's prompt.")] = 256,
    result_bytes: Annotated[int, typer.Option(min=0, help="Bytes of each job's result.")] = 128,
    usage_share: Annotated[
        float, typer.Option(min=0, max=1, help="Share of the completing jobs that report their token usage.")
    ] = 0.5,
    fail_share: Annotated[
        float, typer.Option(min=0, max=1, help="Share of the jobs that fail permanently (dead-lettered).")
    ] = 0.01,
    cancel_share: Annotated[
        float, typer.Option(min=0, max=1, help="Share of the jobs added delayed and cancelled at once.")
    ] = 0.01,
    reject_share: Annotated[
        float,
        typer.Option(min=0, max=1, help="Share of the jobs that name a budget of 0 tokens (rejected)."),
    ] = 0.005,
    events_maxlen: Annotated[
        int, typer.Option(min=1, help="Cap of the queue's events stream (about 3 events per job).")
    ] = 10_000,
    sample_interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between two memory samples.")
    ] = 1.0,
    flat_share: Annotated[
        float,
        typer.Option(
            min=0,
            max=1,
            help="Flat when the plateau grows by at most this share of what keeping every job "
            "would add a minute (rate x 60 x bytes per retained job).",
        ),
    ] = 0.05,
    seed: Annotated[int, typer.Option(help="Seed of the job mix.")] = 1,
    redis: RedisOpt = None,
    json_path: JsonOpt = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write the memory plot PNG here (default: next to --json, as .png)."),
    ] = None,
) -> None:
    """Run LLM-style jobs with token budgets at a steady rate and sample Redis memory.

    Real worker processes run every job; a share reports token usage, fails
    for good (dead-lettered), is cancelled or is rejected by its budget, so
    every retention kind keeps records. Every sample reads INFO memory and
    the records each kind retains. With retention set for the queue,
    used_memory should level off within the retention age and stay there:
    the verdict fits a line through the last half of the run. Exit code 1
    when memory kept growing.
    """
    # Imported here: every `sluice` command (a worker's start-up too) loads this module.
    from sluice_lab.common import bench_redis, machine_meta
    from sluice_lab.memory import MemorySpec, run_memory
    from sluice_lab.memory_report import memory_table, write_plot

    try:
        spec = MemorySpec(
            seconds=seconds,
            rate=rate,
            retain_seconds=retain_seconds,
            retain_count=retain_count,
            processes=processes,
            concurrency=concurrency,
            tokens=tokens,
            budget_window=budget_window,
            work_ms=work_ms,
            payload_bytes=payload_bytes,
            result_bytes=result_bytes,
            usage_share=usage_share,
            fail_share=fail_share,
            cancel_share=cancel_share,
            reject_share=reject_share,
            events_maxlen=events_maxlen,
            sample_interval=sample_interval,
            flat_share=flat_share,
            seed=seed,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None

    async def go(url: str, origin: str) -> dict[str, Any]:
        client = connect(url)
        try:
            meta = await machine_meta(client, url, origin)
            with tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as logs, progress_bar() as bar:
                task = bar.add_task("memory", total=round(seconds))

                def show(elapsed: float, sample: dict[str, Any]) -> None:
                    kept = sum(sample["retained"].values())
                    bar.update(
                        task,
                        completed=min(round(elapsed), round(seconds)),
                        description=f"{sample['used_memory'] / 2**20:,.1f} MiB, {kept:,} jobs kept",
                    )

                result = await run_memory(client, url, spec, Path(logs), show)
        finally:
            await client.aclose()
        return {"meta": meta, **result}

    with bench_redis(redis) as (url, origin):
        data = run(go(url, origin))
    print_warnings(data)
    console.print(memory_table(data))
    save_json(json_path, data)
    if plot is None and json_path is not None:
        plot = json_path.with_suffix(".png")
    if plot is not None:
        console.print(f"[dim]wrote {write_plot(data, plot)}[/dim]")
    if not data["flat"]:
        console.print("[red]memory kept growing[/red] over the last half of the run (see the table above)")
        raise typer.Exit(1)
