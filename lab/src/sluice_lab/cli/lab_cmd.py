"""``sluice bench lab``: the dispatch lab, the project's first command.

It shows, on every run, what goes wrong when workers check a shared budget
with read-then-write (naive), and that the atomic ledger and the admission
gate in the dispatch script do not let it happen; with the shared
concurrency, rate limit, priorities and provider throttling checked on the
same run, and, for calls that use more tokens than they reserved, that the
spend stays within the documented bound and the ledger shows all of it.
Exit code 1 when any check fails.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from sluice.cli.runtime import run
from sluice.engine.connection import connect
from sluice_lab.cli.bench_cmd import RedisOpt, bench_app, console


class LabMode(enum.StrEnum):
    naive = "naive"
    atomic = "atomic"
    admission = "admission"
    compare = "compare"


@bench_app.command("lab")
def lab(
    mode: Annotated[
        LabMode,
        typer.Argument(
            help="naive: workers read the balance, decide, write it back; atomic: workers reserve "
            "with one Lua script; admission: the dispatch script reserves before a job starts; "
            "compare: all three, one after the other."
        ),
    ] = LabMode.compare,
    out: Annotated[
        Path, typer.Option(help="Directory for benchmark-results.json and lab-report.html.")
    ] = Path("lab-results"),
    report: Annotated[bool, typer.Option(help="Write the HTML report (with charts).")] = True,
    burst: Annotated[
        list[Path] | None,
        typer.Option(
            help="A `sluice bench burst --json` file to show in the report with its PNG (repeatable); "
            "burst*.json files in --out are shown too.",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    redis: RedisOpt = None,
) -> None:
    """Two worker processes under one budget, one rate limit and one concurrency ceiling.

    Load phase: 24 jobs of 100 tokens (16 at priority 10, then 8 at priority 1)
    against a 2,400-token budget, global concurrency 4, 4 starts per second,
    one provider 429 (retry after 500 ms). Race phase: 4 jobs of 100 tokens at
    once against 200 tokens. Overuse phase (no rate limit): 16 jobs reserving
    100 tokens that use 150, against 1,000 tokens: the spend may pass the
    limit by at most 4 x 50, and the budget must say what was spent. Prints
    the figures and the checks per mode.
    """
    from sluice_lab.burst_report import find_bursts
    from sluice_lab.cli.bench_cmd import progress_bar
    from sluice_lab.common import bench_redis, machine_meta
    from sluice_lab.lab import MODES, run_mode
    from sluice_lab.lab_report import lab_table, throttle_table, write_report
    from sluice_lab.lab_workload import Workload

    modes = list(MODES) if mode is LabMode.compare else [mode.value]
    workload = Workload()

    async def go(url: str, origin: str) -> list[dict[str, Any]]:
        client = connect(url)
        results = []
        try:
            meta = await machine_meta(client, url, origin)
            with progress_bar() as bar:
                tasks = {m: bar.add_task(m, total=workload.total_jobs) for m in modes}

                def show(m: str, done: int, total: int) -> None:
                    bar.update(tasks[m], completed=done, total=total)

                for m in modes:
                    result = await run_mode(client, url, m, workload, show)
                    results.append({**result, "meta": meta})
        finally:
            await client.aclose()
        return results

    with bench_redis(redis) as (url, origin):
        results = run(go(url, origin))
    console.print(lab_table(results))
    console.print(throttle_table(results))
    path = out / "benchmark-results.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    console.print(f"[dim]wrote {path}[/dim]")
    if report:
        console.print(f"[dim]wrote {write_report(results, out, find_bursts(out, burst or []))}[/dim]")
    failed = [r["mode"] for r in results if not r["checks"]["allPassed"]]
    if failed:
        console.print(f"[red]checks failed in: {', '.join(failed)}[/red] (see the table above)")
        raise typer.Exit(1)
    console.print("[green]all checks passed[/green]")
