"""``sluice bench goodput``: the provider's rate limit used by a limited queue vs retry-on-429.

Registered on ``bench_app`` when imported (``sluice_lab.cli`` imports it).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.progress import TaskID

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

if TYPE_CHECKING:
    from rich.table import Table

    from sluice_lab.goodput import GoodputSpec


#: Defaults of the single run and of the matrix's cells (see --help).
SINGLE_JOBS, MATRIX_JOBS = 2000, 1000
SINGLE_TIMEOUT_S = 180.0
MATRIX_JSON = Path("goodput-matrix.json")


@bench_app.command("goodput")
def goodput(
    jobs: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=100_000,
            help=f"Provider calls (one per job): {SINGLE_JOBS:,}, or {MATRIX_JOBS:,} per cell with --matrix.",
        ),
    ] = None,
    processes: Annotated[
        list[int] | None,
        typer.Option(
            "--processes",
            "-p",
            min=1,
            max=16,
            help="Worker processes: 2, or 1 and 2 with --matrix (repeatable there, to narrow it).",
        ),
    ] = None,
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
    network_delay_ms: Annotated[
        list[float] | None,
        typer.Option(
            "--network-delay-ms",
            min=0,
            max=10_000,
            help="Milliseconds between the workers and the provider, each way: 0, or 0, 5 and 50 with "
            "--matrix (repeatable there).",
        ),
    ] = None,
    count_rejected: Annotated[
        bool | None,
        typer.Option(
            "--count-rejected/--free-rejected",
            help="The provider counts refused calls against its request limit (as OpenAI documents), "
            "or not (the default); --matrix runs both unless one is given.",
        ),
    ] = None,
    matrix: Annotated[
        bool,
        typer.Option(
            "--matrix",
            help="Every variant x processes x network delay x refusals counted or not, a fresh provider "
            f"per cell; writes --json (default ./{MATRIX_JSON}) and a PNG beside it.",
        ),
    ] = False,
    pace: Annotated[
        int, typer.Option(min=1, help="sluice-limited: the request limit in this many steps per window.")
    ] = 1,
    headroom_ms: Annotated[
        int | None,
        typer.Option(min=0, max=60_000, help="sluice-limited: the queue's headroom, ms (default: its own)."),
    ] = None,
    tolerance_ms: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=60_000,
            help="sluice-limited: the pacer's tolerance, ms (default: the queue's).",
        ),
    ] = None,
    pacer: Annotated[
        bool | None,
        typer.Option(
            "--pacer/--no-pacer", help="sluice-limited: pace the starts or not (default: as the queue does)."
        ),
    ] = None,
    max_attempts: Annotated[
        int, typer.Option(min=1, help="no-limiter and aiolimiter: attempts per job.")
    ] = 50,
    backoff_base: Annotated[
        float, typer.Option(min=0, help="no-limiter and aiolimiter: first retry delay, seconds.")
    ] = 0.05,
    backoff_max: Annotated[
        float, typer.Option(min=0, help="no-limiter and aiolimiter: longest retry delay, seconds.")
    ] = 1.0,
    variant: Annotated[
        list[str] | None,
        typer.Option(
            "--variant", help="sluice-limited, no-limiter and/or aiolimiter (repeatable; default all three)."
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            min=1,
            help=f"Seconds one variant may take: {SINGLE_TIMEOUT_S:g}, or with --matrix twice the "
            "theoretical minimum + 10 per cell.",
        ),
    ] = None,
    client: Annotated[
        str,
        typer.Option(help="provider: calls through Sluice's OpenAIProvider; raw: a bare httpx client."),
    ] = "provider",
    redis: RedisOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """LLM calls against a simulated rate-limited provider: Sluice's limits, retry-on-429, aiolimiter."""
    # Imported here: every `sluice` command (a worker's start-up too) loads this module.
    from sluice_lab.goodput import CLIENT_LIMITED, VARIANTS, GoodputSpec

    chosen = variant or list(VARIANTS)
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        _fail(f"unknown variant {unknown[0]!r}; use {', '.join(VARIANTS)}")
    if not matrix:
        for option, values in (("--processes", processes), ("--network-delay-ms", network_delay_ms)):
            if values is not None and len(values) > 1:
                _fail(f"{option} takes one value without --matrix, got {len(values)}")
    try:
        spec = GoodputSpec(
            jobs=jobs or (MATRIX_JOBS if matrix else SINGLE_JOBS),
            processes=processes[0] if processes else 2,
            concurrency=concurrency,
            window=window,
            requests=rpw,
            tokens=tpw,
            latency=latency,
            latency_per_token=latency_per_token,
            count_rejected=bool(count_rejected),
            network_delay=network_delay_ms[0] / 1000 if network_delay_ms else 0.0,
            pace=pace,
            headroom_ms=headroom_ms,
            tolerance_ms=tolerance_ms,
            pacer=pacer,
            max_attempts=max_attempts,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            timeout=timeout or SINGLE_TIMEOUT_S,
            client=client,
        )
        if CLIENT_LIMITED in chosen and not matrix:
            spec.client_limits()  # the matrix checks each cell's
    except ValueError as exc:
        _fail(str(exc))
    # The driver reads the provider's counters ten times a second; httpx logs each read at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if matrix:
        from sluice_lab.cli.goodput_matrix import run_matrix_command

        run_matrix_command(
            spec,
            chosen,
            processes,
            network_delay_ms,
            None if count_rejected is None else [count_rejected],
            timeout,
            redis,
            json_path or MATRIX_JSON,
        )
        return
    _single(spec, chosen, redis, json_path)


def _fail(message: str) -> NoReturn:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def _single(spec: GoodputSpec, chosen: list[str], redis: str | None, json_path: Path | None) -> None:
    """Each chosen variant once, against a fresh provider; a column each in the table."""
    from sluice_lab.common import bench_redis, machine_meta
    from sluice_lab.goodput import run_variant
    from sluice_lab.goodput_report import compare, spec_meta

    async def go(url: str, origin: str) -> dict[str, Any]:
        client = connect(url)
        results: dict[str, dict[str, Any]] = {}
        try:
            meta = await machine_meta(client, url, origin)
            with tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as logs, progress_bar() as bar:
                for name in chosen:
                    task = bar.add_task(name, total=spec.jobs)

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


def _queue_limits(meta: dict[str, Any], limits: dict[str, Any] | None) -> str:
    """sluice-limited's limits and pacing (``limits``: its run's queue_limits, None if it did not run)."""
    window, pace = meta["window"], meta["pace"]
    starts = f"{meta['requests'] // pace:,} starts per {window / pace:g} s"
    if pace > 1:
        starts += f" (the provider's {meta['requests']:,} per {window:g} s in {pace} steps)"
    return f"{starts} and {meta['tokens']:,} tokens per {window:g} s, {pacing_text(limits)}"


def pacing_text(limits: dict[str, Any] | None) -> str:
    """The queue's pacing as the run found it, and whether the bench set it or left the defaults."""
    if not limits:
        return "paced as the queue's defaults say"
    now = ", ".join(f"{k} {'off' if v is None else v}" for k, v in (limits.get("pacing") or {}).items())
    origin = "as set" if limits.get("pacing_set") else "the queue's defaults"
    return f"pacing {now or '?'} ({origin})"


def client_limiter_text(limits: dict[str, Any] | None) -> str:
    """The aiolimiter variant's buckets per process."""
    found = (limits or {}).get("client_limiter")
    if not found:
        return "per process, 1 / P of each limit in aiolimiter's leaky buckets"
    requests, tokens = found["request_bucket"], found["token_bucket"]
    return (
        f"per process, 1 call per {requests['time_period'] * 1000:g} ms and a bucket of "
        f"{tokens['max_rate']:,} tokens draining {tokens['max_rate'] / tokens['time_period']:,.0f} per s "
        f"({found['tokens_pct_of_limit']:g} % of the token limit over all processes)"
    )


def goodput_table(data: dict[str, Any]) -> Table:
    """One column per variant, and their ratio; the JSON has the provider's and the engine's counters."""
    from rich.table import Table

    from sluice_lab.goodput import CLIENT_LIMITED, LIMITED, NO_LIMITER
    from sluice_lab.goodput_report import compare, rows

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
    delay = meta.get("network_delay", 0.0) * 1000
    table.caption = (
        f"The provider's refusals {refusals}; {delay:g} ms of network delay each way. Workload "
        f"{meta['workload_tokens']:,} tokens: the minimum is {meta['theoretical_min_s']:g} s "
        f"({meta['theoretical_binding']} bind). Goodput: accepted calls (or tokens) per complete window "
        f"while jobs waited, as a share of the limit that binds. End to end: add to finish. "
        f"sluice-limited: {_queue_limits(meta, variants.get(LIMITED, {}).get('queue_limits'))}. "
        f"no-limiter: up to {meta['max_attempts']} attempts, backoff "
        f"{meta['backoff_base']:g}-{meta['backoff_max']:g} s with full jitter. aiolimiter: "
        f"{client_limiter_text(variants.get(CLIENT_LIMITED, {}).get('queue_limits'))}, its 429s retried so."
    )
    return table
