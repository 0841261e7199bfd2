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
from sluice.settings import ENV_REDIS_SERVER

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
    from sluice_lab.common import bench_redis, machine_meta
    from sluice_lab.report import throughput_table
    from sluice_lab.throughput import DrainSpec, drain_once, summarize

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
    from sluice_lab.common import bench_redis, machine_meta
    from sluice_lab.latency import LatencySpec, latency_run
    from sluice_lab.report import latency_table

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


@bench_app.command("chaos")
def chaos(
    jobs: Annotated[int, typer.Option(min=1, max=1_000_000, help="Jobs the producers add.")] = 5000,
    workers: Annotated[
        int, typer.Option("--workers", "-w", min=1, max=16, help="Worker processes running at once.")
    ] = 3,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="Jobs at once per worker process.")
    ] = 8,
    producers: Annotated[int, typer.Option(min=1, max=16, help="Producers adding jobs at once.")] = 2,
    duration: Annotated[
        float,
        typer.Option(
            min=1.0, help="Seconds over which the jobs are added at an even pace; the faults happen then."
        ),
    ] = 30.0,
    seed: Annotated[int, typer.Option(help="Seed of the fault schedule and of the jobs' durations.")] = 1,
    kills: Annotated[
        int, typer.Option(min=0, help="Workers SIGKILLed mid-run (each replaced by a new process).")
    ] = 3,
    freezes: Annotated[
        int,
        typer.Option(
            min=0,
            help="Workers SIGSTOPped past their lease (3 to 6 s), then SIGCONTed (zombies that answer late).",
        ),
    ] = 2,
    redis_restarts: Annotated[
        int, typer.Option(min=0, help="Times Redis is killed with SIGKILL and restarted from its AOF.")
    ] = 2,
    redis_down: Annotated[float, typer.Option(min=0, help="Seconds Redis stays down each time.")] = 1.0,
    work_ms: Annotated[
        tuple[int, int], typer.Option(min=0, help="Each job sleeps between these milliseconds (seeded).")
    ] = (10, 100),
    slow_share: Annotated[
        float,
        typer.Option(
            min=0,
            max=1,
            help="Share of the jobs that sleep --slow-ms instead (still running when a zombie wakes).",
        ),
    ] = 0.02,
    slow_ms: Annotated[
        tuple[int, int], typer.Option(min=0, help="The slow jobs sleep between these milliseconds.")
    ] = (500, 2500),
    batch: Annotated[int, typer.Option(min=1, max=1000, help="Jobs per add call.")] = 20,
    drain_timeout: Annotated[
        float, typer.Option(min=1, help="Seconds the queue gets to finish every job after the last add.")
    ] = 180.0,
    redis_server: Annotated[
        Path | None,
        typer.Option(
            envvar=ENV_REDIS_SERVER,
            help="redis-server binary for the run's own Redis (default: as `sluice redis` picks it).",
        ),
    ] = None,
    keep: Annotated[
        Path | None,
        typer.Option(help="Keep the run's Redis data, witness files and worker logs in this folder."),
    ] = None,
    json_path: JsonOpt = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write the timeline PNG here (default: next to --json, as .png)."),
    ] = None,
) -> None:
    """Add N jobs through a seeded schedule of faults, then check the whole queue.

    Runs its own Redis (append-only file, appendfsync always) and real worker
    processes; kills workers (SIGKILL), freezes them past their lease
    (SIGSTOP/SIGCONT), kills Redis (SIGKILL) and restarts it from its AOF,
    while producers add jobs with idempotency keys through the outages. Every
    execution is witnessed in files outside Redis. Then checks that every
    accepted job completed once, with the result of exactly one execution and
    no stale commit accepted. Exit code 1 if not (see docs/chaos.md).
    """
    from sluice.local.embedded import find_binary
    from sluice_lab.chaos import run_chaos
    from sluice_lab.chaos_plan import ChaosSpec
    from sluice_lab.chaos_report import causes_table, chaos_table, faults_table, write_timeline

    try:
        spec = ChaosSpec(
            jobs=jobs,
            workers=workers,
            concurrency=concurrency,
            producers=producers,
            duration=duration,
            seed=seed,
            kills=kills,
            freezes=freezes,
            redis_restarts=redis_restarts,
            redis_down_s=redis_down,
            work_ms=work_ms,
            slow_share=slow_share,
            slow_ms=slow_ms,
            batch=batch,
            drain_timeout=drain_timeout,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    binary = find_binary(str(redis_server) if redis_server is not None else None)

    async def go() -> dict[str, Any]:
        with progress_bar() as bar:
            task = bar.add_task("chaos: starting", total=jobs)

            def show(done: int, doing: str) -> None:
                bar.update(task, completed=done, description=f"chaos: {doing}")

            return await run_chaos(spec, binary=binary, keep=keep, progress=show)

    data = run(go())
    console.print(faults_table(data))
    console.print(causes_table(data))
    console.print(chaos_table(data))
    print_warnings(data)
    save_json(json_path, data)
    if plot is None and json_path is not None:
        plot = json_path.with_suffix(".png")
    if plot is not None:
        console.print(f"[dim]wrote {write_timeline(data, plot)}[/dim]")
    if not data["check"]["passed"]:
        console.print("[red]chaos check failed:[/red] jobs were lost or doubled (see the table above)")
        raise typer.Exit(1)


@bench_app.command("scale")
def scale(
    waiting: Annotated[
        list[int] | None,
        typer.Option("--waiting", min=1, max=10_000_000, help="Backlog sizes drained (repeatable)."),
    ] = None,
    delayed: Annotated[
        int, typer.Option(min=0, help="Delayed jobs that all fall due at once (0: skip).")
    ] = 100_000,
    parked: Annotated[
        int, typer.Option(min=0, help="Jobs parked on a full rolling budget (0: skip).")
    ] = 100_000,
    token_window: Annotated[
        int, typer.Option(min=0, help="Entries in a token-rate window that then passes (0: skip).")
    ] = 60_000,
    processes: Annotated[int, typer.Option("--processes", "-p", min=1, max=16, help="Worker processes.")] = 2,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="Jobs at once per process.")
    ] = 50,
    redis: RedisOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Each script's cost at large sizes, from Redis's SLOWLOG: 1M waiting, 100k delayed, 100k
    parked on a full budget, a 60k-entry token window.

    Redis serves nobody while a script runs, so the worst call is what every
    other client waits for; the target is 5 ms at every size, and a drain rate
    that does not fall as the backlog grows. Use a throw-away Redis: the bench
    sets slowlog-log-slower-than to 0 while it runs (and restores it).
    """
    from sluice_lab.common import bench_redis, machine_meta
    from sluice_lab.report import scale_table
    from sluice_lab.scale import ScaleSpec, run_scale

    spec = ScaleSpec(
        waiting=tuple(waiting or (10_000, 100_000, 1_000_000)),
        delayed=delayed,
        parked=parked,
        token_window=token_window,
        processes=processes,
        concurrency=concurrency,
    )

    async def go(url: str, origin: str) -> dict[str, Any]:
        client = connect(url)
        try:
            meta = await machine_meta(client, url, origin)
            with console.status("building") as status:
                result = await run_scale(client, url, spec, status.update)
        finally:
            await client.aclose()
        return {"meta": meta, "scale": result}

    with bench_redis(redis) as (url, origin):
        data = run(go(url, origin))
    console.print(scale_table(data["scale"]))
    save_json(json_path, data)


@bench_app.command("ingest")
def ingest(
    rates: Annotated[
        list[float] | None,
        typer.Option(
            "--rate", "-r", min=1, help="Submissions/s offered, a constant arrival rate (repeatable)."
        ),
    ] = None,
    seconds: Annotated[float, typer.Option(min=1, help="Seconds at each rate.")] = 60.0,
    api_processes: Annotated[
        list[int] | None,
        typer.Option(
            "--api-processes", "-p", min=1, max=16, help="sluice serve -p N, each measured (repeatable)."
        ),
    ] = None,
    route: Annotated[str, typer.Option(help="The route loaded: /jobs, /v1/jobs or /enqueue.")] = "/jobs",
    generators: Annotated[
        int, typer.Option(min=1, max=16, help="Load generator processes sharing each rate.")
    ] = 1,
    client: Annotated[
        str, typer.Option(help="raw (the generator's own HTTP/1.1 client) or httpx (costs more CPU).")
    ] = "raw",
    timeout: Annotated[
        float, typer.Option(min=0.1, help="A request unanswered this long after it was due is an error.")
    ] = 10.0,
    warmup: Annotated[
        float, typer.Option(min=0, help="Seconds at 50/s before the measured rates (not counted).")
    ] = 3.0,
    keep_going: Annotated[
        bool,
        typer.Option(help="Run every rate after one is saturated (default: only the target's, 1,500/s)."),
    ] = False,
    race: Annotated[
        list[int] | None,
        typer.Option(
            "--race", min=0, max=20_000, help="Concurrent duplicates of one key (repeatable; 0: none)."
        ),
    ] = None,
    drain_jobs: Annotated[
        int, typer.Option(min=0, max=1_000_000, help="Jobs drained with the store and without (0: skip).")
    ] = 20_000,
    drain_workers: Annotated[int, typer.Option(min=1, max=16, help="Worker processes of the drain.")] = 2,
    drain_concurrency: Annotated[int, typer.Option(min=1, help="Jobs at once per worker process.")] = 50,
    drain_api_processes: Annotated[
        int | None,
        typer.Option(min=1, max=16, help="API processes (sinks) during the drain (default: the largest -p)."),
    ] = None,
    drain_worker: Annotated[
        str,
        typer.Option(
            help="The drain's worker (default: the service's job types with the API's events stream "
            "length; sluice.service.handlers:worker trims the stream to 10,000)."
        ),
    ] = "sluice_lab.ingest_worker:worker",
    drain_rounds: Annotated[
        int,
        typer.Option(
            min=1,
            max=20,
            help="Pairs of drains (with the store, then the engine alone); the ratio is their median "
            "(one pair's ratio moves by 0.1 and more from run to run on a shared 2-core machine).",
        ),
    ] = 3,
    durable: Annotated[
        bool,
        typer.Option(help="The embedded PostgreSQL fsyncs its commits, as a production server does."),
    ] = True,
    redis: RedisOpt = None,
    database: Annotated[
        str | None,
        typer.Option(
            help="PostgreSQL URL (default $SLUICE_DATABASE_URL, else a throw-away embedded server)."
        ),
    ] = None,
    logs: Annotated[
        Path | None, typer.Option(help="Keep the API servers' and workers' logs in this folder.")
    ] = None,
    json_path: JsonOpt = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write the latency PNG here (default: next to --json, as .png).")
    ] = None,
) -> None:
    """The HTTP service under load: sustained submissions, the idempotency race, drain with the store.

    Runs `sluice serve -p N` against Redis and PostgreSQL (throw-away servers
    unless given), makes an API key, and loads POST /jobs from separate
    generator processes at a constant arrival rate (an open model: latency
    counts from each request's due time). No worker runs meanwhile. Then N
    identical submissions of one idempotency key at once (one job, only 201s),
    and a drain by worker processes with the API's sink keeping the store up
    to date, against the same jobs drained by the engine alone.
    """
    from sluice_lab.bench_database import BenchDatabase, bench_database
    from sluice_lab.common import bench_redis, machine_meta
    from sluice_lab.ingest import run_ingest
    from sluice_lab.ingest_report import drain_table, ingest_table, race_table, targets_table, write_plot
    from sluice_lab.ingest_spec import DEFAULT_API_PROCESSES, DEFAULT_RACES, DEFAULT_RATES, IngestSpec

    try:
        spec = IngestSpec(
            rates=tuple(rates or DEFAULT_RATES),
            seconds=seconds,
            api_processes=tuple(api_processes or DEFAULT_API_PROCESSES),
            route=route,
            generators=generators,
            client=client,
            timeout=timeout,
            warmup_seconds=warmup,
            stop_when_saturated=not keep_going,
            races=tuple(n for n in (race if race is not None else DEFAULT_RACES) if n > 0),
            drain_jobs=drain_jobs,
            drain_workers=drain_workers,
            drain_concurrency=drain_concurrency,
            drain_api_processes=drain_api_processes,
            drain_worker=drain_worker,
            drain_rounds=drain_rounds,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc

    async def go(url: str, origin: str, db: BenchDatabase, log_dir: Path) -> dict[str, Any]:
        client = connect(url)
        try:
            meta = await machine_meta(client, url, origin)
            meta["database"] = db.origin
            with console.status("starting") as status:
                result = await run_ingest(client, url, db, spec, log_dir, status.update)
        finally:
            await client.aclose()
        return {"meta": meta, **result}

    with (
        bench_redis(redis) as (url, origin),
        bench_database(database, durable=durable) as db,
        tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as tmp,
    ):
        log_dir = logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        data = run(go(url, origin, db, log_dir))
    console.print(ingest_table(data))
    if data["race"]:
        console.print(race_table(data))
    drained = drain_table(data)
    if drained is not None:
        console.print(drained)
    console.print(targets_table(data))
    save_json(json_path, data)
    if plot is None and json_path is not None:
        plot = json_path.with_suffix(".png")
    if plot is not None:
        console.print(f"[dim]wrote {write_plot(data, plot)}[/dim]")


def print_warnings(result: dict[str, Any]) -> None:
    for warning in result.get("warnings") or []:
        console.print(f"[yellow]warning:[/yellow] {warning[:500]}")


def save_json(path: Path | None, data: dict[str, Any]) -> None:
    from sluice_lab.common import write_json

    if path is not None:
        write_json(path, data)
        console.print(f"[dim]wrote {path}[/dim]")
