"""``sluice bench burst``: N jobs at once on serving workers; drain time, peak depth, latency.

Registered on ``bench_app`` when imported (``sluice_lab.cli`` imports it).
"""

from __future__ import annotations

import enum
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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

    from sluice_lab.burst import BurstSpec
    from sluice_lab.burst_peer import BullmqSetup


class Peer(enum.StrEnum):
    auto = "auto"
    bullmq_node = "bullmq-node"
    none = "none"


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
    peer: Annotated[
        Peer,
        typer.Option(
            help="The same burst on BullMQ for Node beside Sluice's. auto: when node and bullmq are "
            "installed; bullmq-node: required (says how to install it when missing); none: Sluice alone."
        ),
    ] = Peer.auto,
    node_modules: Annotated[
        Path | None,
        typer.Option(
            help="node_modules with bullmq and ioredis for --peer "
            "(default: ~/.cache/bench-peers/node-bullmq/node_modules, where the peer harness installs them)."
        ),
    ] = None,
    redis: RedisOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Add N jobs at once to a queue with serving workers: drain time, peak depth, latency percentiles.

    With BullMQ for Node installed, every burst also runs on BullMQ, right after Sluice's, with
    the same worker processes, concurrency and sampling, and the ratios Sluice / BullMQ are shown.
    """
    # Imported here: every `sluice` command (a worker's start-up too) loads this module.
    from sluice_lab.burst import SAMPLE_S, BurstSpec, peer_note
    from sluice_lab.burst_peer import PEER, PeerFailed, PeerUnavailable, node_url
    from sluice_lab.common import bench_redis

    specs = [
        BurstSpec(n, processes, concurrency, work_ms, timeout) for n in jobs or [500] for _ in range(reps)
    ]
    setup, unavailable = _peer_setup(peer, node_modules)
    settings: dict[str, Any] = {
        "processes": processes,
        "concurrency": concurrency,
        "work_ms": work_ms,
        "reps": reps,
        "sample_interval_ms": SAMPLE_S * 1000,
    }
    try:
        with bench_redis(redis) as (url, origin):
            if setup is not None:
                try:
                    node_url(url)
                except PeerUnavailable as exc:
                    if peer is Peer.bullmq_node:
                        raise
                    setup, unavailable = None, str(exc)
            settings["peers"] = peer_note(setup.versions if setup is not None else None, unavailable)
            data = run(_measure(url, origin, specs, setup, settings))
    except (PeerUnavailable, PeerFailed) as exc:
        console.print(f"[red]--peer {PEER}:[/red] {exc}")
        raise typer.Exit(2 if isinstance(exc, PeerUnavailable) else 1) from None
    console.print(burst_table(data))
    save_json(json_path, data)
    if plot is None and json_path is not None:
        plot = json_path.with_suffix(".png")
    if plot is not None:
        _plot(data, plot)


def _peer_setup(peer: Peer, node_modules: Path | None) -> tuple[BullmqSetup | None, str]:
    """BullMQ's Node and node_modules, or None and why; exit 2 with how to install when it is required."""
    from sluice_lab.burst_peer import PEER, PeerUnavailable, find_bullmq

    if peer is Peer.none:
        return None, "--peer none"
    try:
        return find_bullmq(node_modules), ""
    except PeerUnavailable as exc:
        if peer is Peer.bullmq_node:
            console.print(f"[red]--peer {PEER}:[/red] {exc}")
            raise typer.Exit(2) from None
        return None, str(exc)


async def _measure(
    url: str, origin: str, specs: list[BurstSpec], setup: BullmqSetup | None, settings: dict[str, Any]
) -> dict[str, Any]:
    """Every burst on Sluice, each followed by the same burst on BullMQ when ``setup`` is given."""
    from sluice_lab.burst import burst_once, summarize
    from sluice_lab.burst_peer import bullmq_burst_once, with_peer
    from sluice_lab.common import machine_meta

    client = connect(url)
    runs: list[dict[str, Any]] = []
    peer_runs: list[dict[str, Any]] = []
    try:
        meta = await machine_meta(client, url, origin)
        with tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as logs, progress_bar() as bar:
            for i, spec in enumerate(specs):
                task = bar.add_task(f"{spec.jobs:,} jobs run {i + 1}/{len(specs)}", total=spec.jobs)

                def show(done: int, task: TaskID = task) -> None:
                    bar.update(task, completed=done)

                runs.append(await burst_once(client, url, spec, Path(logs), show))
                print_warnings(runs[-1])
                if setup is not None:
                    bar.update(task, description=f"{spec.jobs:,} jobs run {i + 1}/{len(specs)}, BullMQ")
                    peer_runs.append(await bullmq_burst_once(setup, url, spec))
                    print_warnings(peer_runs[-1])
    finally:
        await client.aclose()
    data = {"meta": {**meta, **settings}, "summary": summarize(runs), "runs": runs}
    return with_peer(data, setup, peer_runs) if setup is not None else data


def _plot(data: dict[str, Any], path: Path) -> None:
    from sluice.errors import MissingExtra
    from sluice_lab.burst import write_plot

    try:
        console.print(f"[dim]wrote {write_plot(data, path)}[/dim]")
    except MissingExtra as exc:
        console.print(f"[yellow]no plot:[/yellow] {exc}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


_METRICS = ("queue_wait", "processing", "end_to_end", "since_add")


def _cells(row: dict[str, Any]) -> list[str]:
    return [
        "-" if row["drain_s"] is None else f"{row['drain_s']:.3f}",
        "-" if row["rate"] is None else f"{row['rate']:,.0f}",
        "-" if row["peak_waiting"] is None else f"{row['peak_waiting']:,.0f}",
        f"{row['lost_max']}/{row['duplicates_max']}",
        *["/".join(_ms((row.get(m) or {}).get(q)) for q in ("p50", "p95", "p99")) for m in _METRICS],
    ]


def burst_table(data: dict[str, Any]) -> Table:
    """One row per burst size and queue (medians over the repetitions), with the ratios when BullMQ ran."""
    from rich.table import Table

    meta = data["meta"]
    peer = data.get("peer")
    table = Table(
        title=(
            f"Burst: N jobs at once on {meta['processes']} worker process(es) x c={meta['concurrency']}, "
            f"job {meta['work_ms']:g} ms (medians of {meta['reps']} run(s))"
        ),
        caption=(
            f"{meta['peers']}. Drain: from the add to the last completion; depth sampled every "
            f"{meta['sample_interval_ms']:g} ms. Latency ms: Sluice from Queue.latency(60), within 1 %"
            + ("; BullMQ exact, from its job stamps (whole ms)" if peer else "")
            + ". Since add: from the add call until that share of the jobs had counted themselves, "
            "read off the samples (the same way for both)"
            + (". Ratio: Sluice / BullMQ, under 1 is Sluice less." if peer else ".")
        ),
    )
    for col in ("jobs", "queue", "drain s", "jobs/s", "peak waiting", "lost/dup"):
        table.add_column(col, justify="left" if col == "queue" else "right")
    for metric in ("wait", "processing", "end to end", "since add"):
        table.add_column(f"{metric} p50/p95/p99", justify="right")
    theirs = {row["jobs"]: row for row in peer["summary"]} if peer else {}
    ratios = {r["jobs"]: r for r in data.get("ratios", [])}
    for row in data["summary"]:
        table.add_row(f"{row['jobs']:,}", "Sluice", *_cells(row))
        if row["jobs"] in theirs:
            table.add_row("", "BullMQ", *_cells(theirs[row["jobs"]]))
        if (ratio := ratios.get(row["jobs"])) is not None:
            lat = ["-/" + "/".join(_x((ratio.get(m) or {}).get(q)) for q in ("p95", "p99")) for m in _METRICS]
            table.add_row("", "ratio", _x(ratio["drain_s"]), "", "", "", *lat, end_section=True)
    return table
