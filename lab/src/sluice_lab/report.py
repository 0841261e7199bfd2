"""Rich tables of benchmark results (the JSON holds every figure; the table the headline)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _n(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _spread(row: dict[str, Any], key: str) -> str:
    vals = row.get(key + "_all") or []
    head = _n(row.get(key))
    if len(vals) > 1:
        head += f" ({_n(min(vals))}-{_n(max(vals))})"
    return head


def throughput_table(rows: list[dict[str, Any]], jobs: int) -> Table:
    """One row per (concurrency, processes); the JSON has start-up and per-run figures."""
    runs = max((row["runs"] for row in rows), default=0)
    title = f"Sluice throughput, {jobs:,} no-op jobs"
    if runs > 1:
        title += f" (medians of {runs} runs, min-max)"
    table = Table(title=title)
    for col in (
        "conc.",
        "procs",
        "enqueue/s",
        "drain/s",
        "worker µs/job",
        "Redis µs/job",
        "lost/dup",
        "split",
    ):
        table.add_column(col, justify="left" if col == "split" else "right")
    for row in rows:
        split = row.get("split") or {}
        table.add_row(
            str(row["concurrency"]),
            str(row["processes"]),
            _spread(row, "enqueue_rate"),
            _spread(row, "process_rate"),
            _n(row.get("worker_cpu_us_per_job")),
            _n(row.get("redis_cpu_us_per_job")),
            f"{row['lost_max']}/{row['duplicates_max']}",
            "/".join(str(v) for _, v in sorted(split.items())),
        )
    table.caption = (
        "drain/s: steady state, from the first completed job (2+ processes: from when all have one) "
        "to the last; µs/job: CPU over that window"
    )
    return table


def latency_table(result: dict[str, Any]) -> Table:
    gap = result.get("idle_gap_s") or 0
    title = "Sluice round trip: add one job, await job.result() (1 idle worker process)"
    if gap:
        title += f", worker idle {gap:g} s before each sample"
    table = Table(title=title)
    for col in ("samples", "p50 ms", "p95 ms", "p99 ms", "mean ms", "max ms", "worker µs/job", "errors"):
        table.add_column(col, justify="right")
    table.add_row(
        str(result.get("samples")),
        _n(result.get("p50_ms"), 3),
        _n(result.get("p95_ms"), 3),
        _n(result.get("p99_ms"), 3),
        _n(result.get("mean_ms"), 3),
        _n(result.get("max_ms"), 3),
        _n(result.get("worker_cpu_us_per_job")),
        str(len(result.get("errors") or [])),
    )
    return table


def scale_table(result: dict[str, Any]) -> Table:
    """Per phase and script: calls, p50, p99 and worst (ms), with the drain rate."""
    target = result["target_worst_ms"]
    table = Table(title=f"script time from SLOWLOG (ms; target: worst <= {target:g})", title_justify="left")
    for col in ("phase", "jobs", "drain jobs/s", "script", "calls", "p50", "p99", "worst"):
        table.add_column(col, justify="left" if col in ("phase", "script") else "right")
    for phase in result["phases"]:
        first = True
        for name, s in phase["scripts"].items():
            worst = s["worst_ms"]
            mark = "" if worst is None or worst <= target else " [red]!"
            table.add_row(
                phase["name"] if first else "",
                f"{phase['size']:,}" if first else "",
                _n(phase["drain_rate"]) if first else "",
                name,
                f"{s['calls']:,}",
                _n(s["p50_ms"], 2),
                _n(s["p99_ms"], 2),
                _n(worst, 2) + mark,
            )
            first = False
    return table
