"""``sluice bench goodput``: the provider's rate limit used by a limited queue vs retry-on-429.

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


@bench_app.command("goodput")
def goodput(
    jobs: Annotated[int, typer.Option(min=1, max=100_000, help="Provider calls (one per job).")] = 2000,
    processes: Annotated[int, typer.Option("--processes", "-p", min=1, max=16, help="Worker processes.")] = 2,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="Jobs at once per process.")
    ] = 32,
    window: Annotated[
        float, typer.Option(min=1.0, help="The provider's window in seconds (a token window is >= 1 s).")
    ] = 1.0,
    rpw: Annotated[int, typer.Option(min=1, help="The provider's request limit per window.")] = 100,
    tpw: Annotated[int, typer.Option(min=500, help="The provider's token limit per window.")] = 30_000,
    latency: Annotated[float, typer.Option(min=0, help="Seconds each accepted call takes.")] = 0.1,
    latency_per_token: Annotated[
        float, typer.Option(min=0, help="Plus seconds per completion token.")
    ] = 0.0002,
    count_rejected: Annotated[
        bool,
        typer.Option(
            "--count-rejected/--free-rejected",
            help="The provider counts refused calls against its request limit (as OpenAI documents).",
        ),
    ] = False,
    pace: Annotated[
        int, typer.Option(min=1, help="sluice-limited: the request limit in this many steps per window.")
    ] = 1,
    headroom_ms: Annotated[
        int, typer.Option(min=0, max=60_000, help="sluice-limited: the queue's headroom, ms.")
    ] = 30,
    tolerance_ms: Annotated[
        int, typer.Option(min=0, max=60_000, help="sluice-limited: the queue's pacer's tolerance, ms.")
    ] = 20,
    pacer: Annotated[
        bool, typer.Option("--pacer/--no-pacer", help="sluice-limited: pace the starts (or not).")
    ] = True,
    max_attempts: Annotated[int, typer.Option(min=1, help="no-limiter: attempts per job.")] = 50,
    backoff_base: Annotated[
        float, typer.Option(min=0, help="no-limiter: first retry delay, seconds.")
    ] = 0.05,
    backoff_max: Annotated[
        float, typer.Option(min=0, help="no-limiter: longest retry delay, seconds.")
    ] = 1.0,
    variant: Annotated[
        list[str] | None,
        typer.Option("--variant", help="sluice-limited and/or no-limiter (repeatable; default both)."),
    ] = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds one variant may take.")] = 180.0,
    client: Annotated[
        str,
        typer.Option(help="provider: calls through Sluice's OpenAIProvider; raw: a bare httpx client."),
    ] = "provider",
    redis: RedisOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Run LLM calls against a simulated rate-limited provider: a limited queue vs retry-on-429."""
    # Imported here: every `sluice` command (a worker's start-up too) loads this module.
    from sluice.lab.common import bench_redis, machine_meta
    from sluice.lab.goodput import VARIANTS, GoodputSpec, compare, run_variant, spec_meta

    chosen = variant or list(VARIANTS)
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        console.print(f"[red]error:[/red] unknown variant {unknown[0]!r}; use {' or '.join(VARIANTS)}")
        raise typer.Exit(2)
    try:
        spec = GoodputSpec(
            jobs=jobs,
            processes=processes,
            concurrency=concurrency,
            window=window,
            requests=rpw,
            tokens=tpw,
            latency=latency,
            latency_per_token=latency_per_token,
            count_rejected=count_rejected,
            pace=pace,
            headroom=headroom_ms / 1000,
            tolerance_ms=tolerance_ms if pacer else None,
            max_attempts=max_attempts,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            timeout=timeout,
            client=client,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None

    async def go(url: str, origin: str) -> dict[str, Any]:
        client = connect(url)
        results: dict[str, dict[str, Any]] = {}
        try:
            meta = await machine_meta(client, url, origin)
            with tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as logs, progress_bar() as bar:
                for name in chosen:
                    task = bar.add_task(name, total=jobs)

                    def show(done: int, rejected: int, task: TaskID = task, name: str = name) -> None:
                        bar.update(task, completed=done, description=f"{name} ({rejected:,} x 429)")

                    results[name] = await run_variant(client, url, spec, name, Path(logs), show)
                    print_warnings(results[name])
        finally:
            await client.aclose()
        return {"meta": meta, "spec": spec_meta(spec), "variants": results, "ratios": compare(results)}

    with bench_redis(redis) as (url, origin):
        data = run(go(url, origin))
    console.print(goodput_table(data))
    save_json(json_path, data)


def _queue_limits(meta: dict[str, Any]) -> str:
    window, pace, headroom_ms = meta["window"], meta["pace"], meta["headroom"] * 1000
    starts = f"{meta['requests'] // pace:,} starts per {window / pace:g} s"
    if pace > 1:
        starts += f" (the provider's {meta['requests']:,} per {window:g} s in {pace} steps)"
    tolerance = meta.get("tolerance_ms")
    pacer = "no pacer" if tolerance is None else f"paced, {tolerance} ms tolerance"
    return (
        f"{starts} and {meta['tokens']:,} tokens per {window:g} s, every window + {headroom_ms:g} ms headroom"
        f", {pacer}"
    )


def goodput_table(data: dict[str, Any]) -> Table:
    """One column per variant, and their ratio; the JSON has the provider's and the engine's counters."""
    from rich.table import Table

    from sluice.lab.goodput import LIMITED, NO_LIMITER, compare, rows

    meta = data["spec"]
    variants: dict[str, dict[str, Any]] = data["variants"]
    title = (
        f"Goodput: {meta['jobs']:,} LLM calls, {meta['processes']} worker processes x "
        f"{meta['concurrency']}, provider limit {meta['requests']:,} requests and "
        f"{meta['tokens']:,} tokens per {meta['window']:g} s"
    )
    table = Table(title=title)
    table.add_column("")
    for name in variants:
        table.add_column(name, justify="right")
    both = LIMITED in variants and NO_LIMITER in variants
    if both:
        table.add_column("no-limiter / limited", justify="right")
    columns = {name: rows(r) for name, r in variants.items()}
    ratios = compare(variants)
    for i, (label, _, _) in enumerate(next(iter(columns.values()), [])):
        cells = [columns[name][i][1] for name in variants]
        if both:
            cells.append(f"x{ratios[label]:.2f}" if label in ratios else "")
        table.add_row(label, *cells)
    refusals = "count against its request limit" if meta["count_rejected"] else "cost the client nothing"
    table.caption = (
        f"The provider's refusals {refusals}. Workload {meta['workload_tokens']:,} tokens: "
        f"the minimum is {meta['theoretical_min_s']:g} s "
        f"({meta['theoretical_binding']} bind). Goodput: accepted calls (or tokens) per complete window "
        f"while jobs waited, as a share of the limit that binds. End to end: add to finish. "
        f"sluice-limited: {_queue_limits(meta)}. no-limiter: up to {meta['max_attempts']} attempts, backoff "
        f"{meta['backoff_base']:g}-{meta['backoff_max']:g} s with full jitter."
    )
    return table
