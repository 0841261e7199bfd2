"""``sluice bench goodput --matrix``: every variant under every condition, a progress bar over the cells.

The run itself is :func:`sluice_lab.goodput_matrix.run_matrix`; this module
turns the command's options into its matrix, shows the progress, and writes
the table, the JSON and the PNG.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from sluice.cli.runtime import run
from sluice.engine.connection import connect
from sluice_lab.cli.bench_cmd import console, progress_bar, save_json

if TYPE_CHECKING:
    from rich.console import JustifyMethod
    from rich.table import Table

    from sluice_lab.goodput import GoodputSpec
    from sluice_lab.goodput_matrix import Cell, Matrix


def build_matrix(
    variants: list[str],
    processes: list[int] | None,
    delays_ms: list[float] | None,
    count_rejected: list[bool] | None,
) -> Matrix:
    """The matrix of the command's options: each axis narrowed to the values given, else all of it."""
    from sluice_lab.goodput_matrix import Matrix

    full = Matrix()
    return Matrix(
        variants=tuple(variants),
        processes=tuple(processes or full.processes),
        network_delay_ms=tuple(delays_ms or full.network_delay_ms),
        count_rejected=tuple(full.count_rejected if count_rejected is None else count_rejected),
    )


def run_matrix_command(
    spec: GoodputSpec,
    variants: list[str],
    processes: list[int] | None,
    delays_ms: list[float] | None,
    count_rejected: list[bool] | None,
    timeout: float | None,
    redis: str | None,
    json_path: Path,
) -> dict[str, Any]:
    """Run the matrix, print its table, write its JSON and PNG; returns the data written."""
    from sluice_lab.common import bench_redis, machine_meta
    from sluice_lab.goodput_matrix import cell_specs, cell_timeout, run_matrix

    try:
        matrix = build_matrix(variants, processes, delays_ms, count_rejected)
        base = dataclasses.replace(spec, timeout=timeout or cell_timeout(spec))
        cells = [cell for cell, _ in cell_specs(base, matrix)]
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None

    async def go(url: str, origin: str) -> dict[str, Any]:
        client = connect(url)
        try:
            meta = await machine_meta(client, url, origin)
            with tempfile.TemporaryDirectory(prefix="sluice-bench-logs-") as logs, progress_bar() as bar:
                overall = bar.add_task("cells", total=len(cells))
                jobs = bar.add_task("", total=base.jobs)
                current: list[Cell] = []

                def on_cell(i: int, cell: Cell) -> None:
                    current[:] = [cell]
                    bar.update(overall, completed=i, description=f"cell {i + 1}/{len(cells)}")
                    bar.reset(jobs, total=base.jobs, description=cell.label())

                def show(done: int, rejected: int) -> None:
                    label = current[0].label() if current else ""
                    bar.update(jobs, completed=done, description=f"{label} ({rejected:,} x 429)")

                data = await run_matrix(client, url, base, matrix, Path(logs), on_cell, show)
                bar.update(overall, completed=len(cells))
        finally:
            await client.aclose()
        return {"meta": meta, **data}

    with bench_redis(redis) as (url, origin):
        data = run(go(url, origin))
    for cell in data["cells"]:
        for warning in cell["result"].get("warnings") or []:
            console.print(f"[yellow]warning:[/yellow] {cell['label']}: {warning[:500]}")
    console.print(matrix_table(data))
    save_json(json_path, data)
    _plot(data, json_path.with_suffix(".png"))
    return data


def _plot(data: dict[str, Any], path: Path) -> None:
    from sluice.errors import MissingExtra
    from sluice_lab.goodput_matrix import write_plot

    try:
        console.print(f"[dim]wrote {write_plot(data, path)}[/dim]")
    except MissingExtra as exc:
        console.print(f"[yellow]no plot:[/yellow] {exc}")


def _n(value: float | None, digits: int = 0, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def matrix_row(cell: dict[str, Any]) -> list[str]:
    """One cell as the table shows it (see the columns of :func:`matrix_table`)."""
    r = cell["result"]
    lag = r["dispatch_to_arrival"]
    e2e = r["e2e"] if r["complete"] else {}
    pct = r["goodput_pct"]
    goodput = "-" if pct is None else f"{pct:.1f} ({(r['binding'] or '-')[0]})"
    return [
        cell["variant"],
        str(cell["processes"]),
        f"{cell['network_delay_ms']:g}",
        "counted" if cell["count_rejected"] else "free",
        goodput,
        _n(r["rate_limited"]),
        "-" if r["completion_vs_min"] is None else f"x{r['completion_vs_min']:.2f}",
        _n(e2e.get("p95_ms"), 2, 1e-3),
        f"{_n(lag.get('p50_ms'))} / {_n(lag.get('max_ms'))}",
        f"{r['completed']} / {r['duplicates']} / {r['lost_or_failed']}",
        "[green]yes[/green]" if cell["meets_target"] else "[red]no[/red]",
    ]


def matrix_table(data: dict[str, Any]) -> Table:
    """A row per cell, the variants of one condition together."""
    from rich.table import Table

    spec = data["spec"]
    title = (
        f"Goodput matrix: {spec['jobs']:,} LLM calls per cell, {spec['concurrency']} at once per process, "
        f"provider limit {spec['requests']:,} requests and {spec['tokens']:,} tokens per {spec['window']:g} s"
    )
    table = Table(title=title)
    columns: list[tuple[str, JustifyMethod]] = [
        ("variant", "left"),
        ("procs", "right"),
        ("delay ms", "right"),
        ("refusals", "left"),
        ("goodput %", "right"),
        ("429s", "right"),
        ("time / min", "right"),
        ("e2e p95 s", "right"),
        ("disp→arr p50 / max ms", "right"),
        ("done / dup / not done", "right"),
        (f">= {data['target_pct']:g} %, 0 x 429", "center"),
    ]
    for name, justify in columns:
        table.add_column(name, justify=justify)
    previous = None
    for cell in data["cells"]:
        condition = (cell["processes"], cell["network_delay_ms"], cell["count_rejected"])
        if previous is not None and condition != previous:
            table.add_section()
        previous = condition
        table.add_row(*matrix_row(cell))
    table.caption = (
        f"{data['met']} of {len(data['cells'])} cells meet the target. Workload {spec['workload_tokens']:,} "
        f"tokens, theoretical minimum {spec['theoretical_min_s']:g} s ({spec['theoretical_binding']} bind). "
        "goodput: accepted calls (r) or tokens (t) per complete window while jobs waited, as a share of "
        "the binding limit. 429s: calls the provider refused. time / min: add of all jobs to the last "
        "finish, over the minimum. e2e: add to finish. disp→arr: the job's start in the queue to its "
        "accepted call's arrival at the provider (one network delay included). refusals counted: the "
        "provider counts them against its request limit, as OpenAI documents."
    )
    return table
