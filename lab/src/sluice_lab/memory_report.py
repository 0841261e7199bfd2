"""The memory run on the terminal (a rich table) and as a PNG.

Both render the run's JSON and compute nothing: the plateau, the verdict and
the bytes per job come from :mod:`sluice_lab.memory`, so the table and the
picture cannot disagree with the file. The plot is drawn on a bare matplotlib
``Figure`` (never pyplot: no GUI backend, no global figure state), as the
chaos report is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from sluice_lab.deps import require

#: Sample rows the table shows (evenly spread, the first and the last included).
TABLE_ROWS = 10
_KIND_COLORS = {"completed": "#009E73", "dead": "#cf222e", "cancelled": "#E69F00", "rejected": "#56B4E9"}


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f}"


def _kib(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024:,.1f}"


def pick_rows(samples: list[dict[str, Any]], rows: int = TABLE_ROWS) -> list[dict[str, Any]]:
    """About ``rows`` samples spread evenly over the run, the first and the last always in."""
    if len(samples) <= rows:
        return samples
    step = (len(samples) - 1) / (rows - 1)
    return [samples[round(i * step)] for i in range(rows)]


def memory_table(result: Mapping[str, Any]) -> Table:
    """A few samples (memory, records retained per kind, jobs completed) and the verdict."""
    spec = result["spec"]
    age = spec["retain_seconds"]
    table = Table(
        title=(
            f"Redis memory at {spec['rate']:g} jobs/s for {spec['seconds']:g} s, "
            f"retention {'no age limit' if age is None else f'{age:g} s'}"
            + (f", at most {spec['retain_count']:,} per kind" if spec["retain_count"] else "")
        )
    )
    table.add_column("s", justify="right")
    table.add_column("used_memory MiB", justify="right")
    for kind in ("completed", "dead", "cancelled", "rejected"):
        table.add_column(f"kept {kind}", justify="right")
    table.add_column("completed so far", justify="right")
    for s in pick_rows(result["samples"]):
        kept = s["retained"]
        table.add_row(
            f"{s['t']:,.1f}",
            _mib(s["used_memory"]),
            *(f"{kept[k]:,}" for k in ("completed", "dead", "cancelled", "rejected")),
            f"{s['completed']:,}",
        )
    p, v = result["plateau"], result["verdict"]
    slope = result["memory_vs_retained"]["bytes_per_retained_job"]
    verdict = Text("FLAT", style="bold green") if v["flat"] else Text("GROWING", style="bold red")
    table.caption = Text.assemble(
        f"bytes per retained job {result['bytes_per_retained_job'] or 0:,.0f} (MEMORY USAGE; "
        f"slope of memory over records {slope or 0:,.0f}). Plateau from {p['since_s']:g} s: "
        f"{_mib(p['min'])}-{_mib(p['max'])} MiB, growth {_kib(p['growth_per_min'])} KiB/min "
        f"(threshold {_kib(v['threshold_per_min'])} KiB/min; keeping every job would add "
        f"{_kib(result['keep_everything_bytes_per_min'])} KiB/min): ",
        verdict,
    )
    return table


def write_plot(result: Mapping[str, Any], path: Path) -> Path:
    """Memory over time (with the plateau's fitted line) above the records retained per kind."""
    require("the memory plot", "matplotlib")
    from matplotlib.figure import Figure

    samples = result["samples"]
    ts = [s["t"] for s in samples]
    p, v = result["plateau"], result["verdict"]
    fig = Figure(figsize=(11.0, 7.0), dpi=100, layout="constrained")
    mem, kept = fig.subplots(2, 1, sharex=True)
    mem.plot(ts, [s["used_memory"] / 2**20 for s in samples], color="#0072B2", lw=1.5, label="used_memory")
    mem.plot(ts, [s["dataset"] / 2**20 for s in samples], color="#56B4E9", lw=1, ls="--", label="dataset")
    mem.axvspan(p["since_s"], ts[-1], color="#57606a", alpha=0.08, lw=0, label="plateau (last half)")
    # The least-squares line through the plateau, anchored at its mean (what the verdict judges).
    on = [s for s in samples if s["t"] >= p["since_s"]]
    mid = (on[0]["t"] + on[-1]["t"]) / 2
    per_s = p["growth_per_min"] / 60
    line = [(p["mean"] + per_s * (s["t"] - mid)) / 2**20 for s in (on[0], on[-1])]
    mem.plot([on[0]["t"], on[-1]["t"]], line, color="#cf222e", lw=1.5, label="plateau fit")
    verdict = "flat" if v["flat"] else "GROWING"
    mem.set_title(
        f"{result['spec']['rate']:g} jobs/s, retention {result['spec']['retain_seconds']} s: "
        f"growth {p['growth_per_min'] / 1024:,.1f} KiB/min "
        f"(threshold {v['threshold_per_min'] / 1024:,.1f}): {verdict}",
        loc="left",
        fontsize=10,
    )
    mem.set_ylabel("Redis memory, MiB")
    mem.set_ylim(bottom=0)
    for kind, color in _KIND_COLORS.items():
        kept.plot(ts, [s["retained"][kind] for s in samples], color=color, lw=1.5, label=kind)
    spec = result["spec"]
    if spec["retain_seconds"] is not None:
        share = 1 - spec["fail_share"] - spec["cancel_share"] - spec["reject_share"]
        allowed = spec["rate"] * share * spec["retain_seconds"]
        kept.axhline(allowed, color="#009E73", lw=1, ls=":", label="completed within the age (rate x age)")
    kept.set_ylabel("jobs retained (index entries)")
    kept.set_xlabel("seconds since the first add")
    kept.set_yscale("symlog", linthresh=10)
    kept.set_ylim(bottom=0)
    for ax in (mem, kept):
        ax.grid(color="#d0d7de", lw=0.6)
        ax.set_axisbelow(True)
        ax.legend(loc="upper left", fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", facecolor="white")
    return path
