"""The ingest run on the terminal (rich tables) and as a PNG (latency percentiles against the rate).

Both render the run's JSON and compute nothing: the verdicts come from
:mod:`sluice_lab.ingest`, so the tables, the picture and the file agree. The
plot is drawn on a bare matplotlib ``Figure`` (never pyplot), as the memory
report is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from sluice_lab.deps import require
from sluice_lab.ingest_spec import TARGET_DRAIN_RATIO, TARGET_P95_MS, TARGET_RATE

_COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _yes(ok: bool) -> Text:
    return Text("yes", style="bold green") if ok else Text("NO", style="bold red")


def ingest_table(result: Mapping[str, Any]) -> Table:
    """One row per (API processes, offered rate)."""
    spec = result["spec"]
    table = Table(
        title=f"sluice serve: POST {spec['route']} at a constant arrival rate, {spec['seconds']:g} s each "
        f"({spec['generators']} {spec['client']} generator{'s' if spec['generators'] > 1 else ''})"
    )
    for col in ("API procs", "offered/s", "achieved/s", "errors", "p50 ms", "p95 ms", "p99 ms", "max ms"):
        table.add_column(col, justify="right")
    for col in ("CPU µs/req gen / API / Redis / PG", "machine busy", "target"):
        table.add_column(col, justify="right")
    for row in result["ingest"]:
        if "skipped" in row:
            table.add_row(str(row["api_processes"]), _n(row["rate"]), f"skipped ({row['skipped']})")
            continue
        lat = row["latency_ms"]
        cpu = " / ".join(
            _n(row[k])
            for k in (
                "generator_cpu_us_per_request",
                "api_cpu_us_per_request",
                "redis_cpu_us_per_request",
                "postgres_cpu_us_per_request",
            )
        )
        busy = row["machine_busy_share"]
        table.add_row(
            str(row["api_processes"]),
            _n(row["rate"]),
            _n(row["achieved_rate"]),
            f"{row['errors']:,}",
            _n(lat["p50_ms"], 2),
            _n(lat["p95_ms"], 2),
            _n(lat["p99_ms"], 2),
            _n(lat["max_ms"], 1),
            cpu,
            "-" if busy is None else f"{busy:.0%}",
            _yes(row["met"]),
        )
    table.caption = (
        f"latency from each request's due time (open model); errors: every answer but a 201, and "
        f"timeouts; target: {TARGET_RATE:,.0f}/s (or the offered rate, if lower) with 0 errors at "
        f"p95 <= {TARGET_P95_MS:g} ms"
    )
    return table


def race_table(result: Mapping[str, Any]) -> Table:
    table = Table(title="The idempotency race: concurrent duplicates of one key")
    for col in ("API procs", "duplicates", "answers", "distinct ids", "store rows", "engine jobs"):
        table.add_column(col, justify="right")
    for col in ("answer all s", "API CPU s per process", "one job, only 201s"):
        table.add_column(col, justify="right")
    for row in result["race"]:
        answers = ", ".join(f"{v:,}x{k}" for k, v in row["statuses"].items())
        if row["exceptions"]:
            answers += ", " + ", ".join(f"{v:,} {k}" for k, v in row["exceptions"].items())
        table.add_row(
            str(row["api_processes"]),
            f"{row['duplicates']:,}",
            answers,
            str(row["distinct_ids"]),
            str(row["store_rows"]),
            str(row["engine_jobs"]),
            _n(row["answer_all_s"], 3),
            " / ".join(_n(v, 2) for v in row["api_cpu_s_per_process"]),
            _yes(row["passed"]),
        )
    return table


def drain_table(result: Mapping[str, Any]) -> Table | None:
    d = result.get("drain")
    if not d:
        return None
    table = Table(
        title=f"Drain of {d['jobs']:,} generic jobs by {d['workers']} worker processes "
        f"(concurrency {d['concurrency']})"
    )
    for col in ("run", "jobs/s (engine)", "jobs/s (store COMPLETED)", "store behind at end s", "startup s"):
        table.add_column(col, justify="right" if col != "run" else "left")
    table.add_column("CPU µs/job workers / API+sink / Redis / PG", justify="right")
    table.add_column("machine busy", justify="right")
    w, a = d["with_store"], d["engine_alone"]
    table.add_row(
        f"API ({d['api_processes']} procs) + sink",
        _n(w.get("engine_rate")),
        _n(w.get("store_rate")),
        _n(w.get("store_lag_at_end_s"), 2),
        _n(w.get("startup_to_first_s"), 2),
        *_drain_cpu(w),
    )
    table.add_row(
        "engine alone", _n(a.get("engine_rate")), "-", "-", _n(a.get("startup_to_first_s"), 2), *_drain_cpu(a)
    )
    ratio = d["ratio"]
    met = ratio is not None and ratio >= TARGET_DRAIN_RATIO
    rounds = d.get("rounds") or []
    ratios = ", ".join(_n(r["ratio"], 2) for r in rounds)
    of_rounds = (
        f" (median of {len(rounds)} pairs: {ratios}; the rows are its pair)" if len(rounds) > 1 else ""
    )
    table.caption = Text.assemble(
        f"store-complete rate / engine-alone rate = {_n(ratio, 2)}{of_rounds} "
        f"(target >= {TARGET_DRAIN_RATIO:.2f}): ",
        _yes(met),
        f"; closed-loop submit rate while loading: {_n(w.get('submit_closed_loop_rate'))}/s",
    )
    return table


def _drain_cpu(run: Mapping[str, Any]) -> tuple[str, str]:
    cpu = run.get("cpu")
    if not cpu:
        return "-", "-"
    keys = ("worker_cpu_us_per_job", "api_cpu_us_per_job", "redis_cpu_us_per_job", "postgres_cpu_us_per_job")
    parts = [_n(cpu.get(k)) for k in keys]
    busy = cpu.get("machine_busy_share")
    return " / ".join(parts), "-" if busy is None else f"{busy:.0%}"


def targets_table(result: Mapping[str, Any]) -> Table:
    table = Table(title="Targets (issue 10, section 8)")
    table.add_column("target")
    table.add_column("measured", justify="right")
    table.add_column("met", justify="right")
    t = result["targets"]
    best = t["ingest"]["best"]
    measured = "-"
    if best is not None:
        measured = (
            f"{_n(best['achieved_rate'])}/s at p95 {_n(best['p95_ms'], 2)} ms, {best['errors']} errors "
            f"(-p {best['api_processes']}, offered {_n(best['rate'])}/s)"
        )
    table.add_row(t["ingest"]["target"], measured, _yes(t["ingest"]["met"]))
    table.add_row(t["race"]["target"], f"up to {t['race']['largest']:,} duplicates", _yes(t["race"]["met"]))
    table.add_row(t["drain"]["target"], f"ratio {_n(t['drain']['ratio'], 2)}", _yes(t["drain"]["met"]))
    return table


def write_plot(result: Mapping[str, Any], path: Path) -> Path:
    """Latency percentiles (left) and achieved rate (right) against the offered rate, per API
    process count."""
    require("the ingest plot", "matplotlib")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12.0, 5.0), dpi=100, layout="constrained")
    lat_ax, rate_ax = fig.subplots(1, 2)
    rows = [r for r in result["ingest"] if "skipped" not in r]
    counts = sorted({r["api_processes"] for r in rows})
    top = max((r["rate"] for r in rows), default=TARGET_RATE)
    for color, procs in zip(_COLORS, counts, strict=False):
        mine = sorted((r for r in rows if r["api_processes"] == procs), key=lambda r: r["rate"])
        xs = [r["rate"] for r in mine]
        for key, style in (("p50_ms", ":"), ("p95_ms", "-"), ("p99_ms", "--")):
            lat_ax.plot(
                xs,
                [r["latency_ms"][key] for r in mine],
                color=color,
                ls=style,
                marker="o",
                ms=3,
                label=f"-p {procs} {key.removesuffix('_ms')}",
            )
        rate_ax.plot(
            xs, [r["achieved_rate"] or 0 for r in mine], color=color, marker="o", label=f"-p {procs}"
        )
    lat_ax.axhline(TARGET_P95_MS, color="#cf222e", lw=1, label=f"target p95 {TARGET_P95_MS:g} ms")
    lat_ax.axvline(TARGET_RATE, color="#57606a", lw=0.8, ls=":")
    lat_ax.set_yscale("log")
    lat_ax.set_xlabel("offered submissions/s (constant arrival rate)")
    lat_ax.set_ylabel("latency from due time, ms")
    lat_ax.set_title("POST latency percentiles", loc="left", fontsize=10)
    rate_ax.plot([0, top], [0, top], color="#57606a", lw=0.8, ls=":", label="achieved = offered")
    rate_ax.axhline(TARGET_RATE, color="#cf222e", lw=1, label=f"target {TARGET_RATE:,.0f}/s")
    rate_ax.set_xlabel("offered submissions/s")
    rate_ax.set_ylabel("201s per second achieved")
    rate_ax.set_title("throughput", loc="left", fontsize=10)
    for ax in (lat_ax, rate_ax):
        ax.grid(color="#d0d7de", lw=0.6)
        ax.set_axisbelow(True)
        ax.legend(loc="upper left", fontsize=7, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", facecolor="white")
    return path
