"""The chaos run on the terminal (rich tables) and as a timeline PNG.

Both render the run's JSON and compute nothing: the verdict and every count
come from :mod:`sluice_lab.chaos_check`, so the table and the picture cannot
disagree with the file. The plot is drawn on a bare matplotlib ``Figure``
(never pyplot: no GUI backend, no global figure state), as the lab's report is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from sluice_lab.deps import require

#: Rows of the verdict: (label, key of check.counts, must it be zero).
VERDICT_ROWS = (
    ("jobs accepted by the producers", "accepted", False),
    ("completed", "completed", False),
    ("lost (accepted, never finished)", "lost", True),
    ("ended otherwise (dead, cancelled...)", "ended_otherwise", True),
    ("unexpected (ran, never accepted)", "unexpected_executions", True),
    ("unexpected job records", "unexpected_jobs", True),
    ("duplicate results (2+ commits)", "duplicate_results", True),
    ("stale commits accepted", "stale_commits_accepted", True),
    ("results no execution returned", "results_not_witnessed", True),
    ("completed with no commit event", "completed_without_event", True),
)
_FAULT_STYLE = {
    "kill": {"color": "#cf222e", "label": "worker SIGKILLed"},
    "freeze": {"color": "#E69F00", "label": "worker frozen (SIGSTOP..SIGCONT)"},
    "redis": {"color": "#57606a", "label": "Redis down (kill -9 .. restarted)"},
}


def chaos_table(result: Mapping[str, Any]) -> Table:
    """The verdict: every count that must be zero, in red when it is not."""
    check = result["check"]
    counts = check["counts"]
    timings = result["timings"]
    table = Table(title=f"Chaos check, seed {result['config']['seed']}")
    table.caption = (
        f"{counts['accepted']:,} jobs, {len(result['faults'])} faults, {timings['run_s']:.1f} s, "
        f"{timings['jobs_per_s'] or 0:,.0f} jobs/s"
    )
    table.add_column("check")
    table.add_column("jobs", justify="right")
    for label, key, must_be_zero in VERDICT_ROWS:
        value = counts[key]
        bad = (must_be_zero and value) or (key == "completed" and value != counts["accepted"])
        table.add_row(label, Text(f"{value:,}", style="bold red" if bad else ""))
    verdict = Text("PASSED", style="bold green") if check["passed"] else Text("FAILED", style="bold red")
    table.add_row(Text("verdict", style="bold"), verdict)
    return table


def causes_table(result: Mapping[str, Any]) -> Table:
    """What the faults cost: executions beyond one per job, by cause, and the engine's own counters."""
    check = result["check"]
    engine = result["engine_counts"]
    table = Table(title=f"Re-executions: {check['re_executions']:,} of {check['executions']:,} executions")
    table.add_column("cause (from the witnesses)")
    table.add_column("executions", justify="right")
    for cause, n in check["re_executions_by_cause"].items():
        table.add_row(cause, Text(f"{n:,}", style="yellow" if cause == "unexplained" and n else ""))
    producers = result["producers"]
    errors = producers["errors"]
    table.add_row("  of which began after their job had completed", f"{check['started_after_completion']:,}")
    table.add_section()
    table.add_row("engine: stalls (leases expired)", f"{engine.get('stalled', 0):,}")
    table.add_row("engine: late answers refused", f"{engine.get('stale_refused', 0):,}")
    table.add_row(
        "producers: adds retried (unavailable / outcome unknown)",
        f"{errors.get('RedisUnavailable', 0):,} / {errors.get('OutcomeUnknown', 0):,}",
    )
    table.add_row(
        "producers: retries the key deduplicated", f"{producers['applied_before_outcome_unknown']:,}"
    )
    return table


def faults_table(result: Mapping[str, Any]) -> Table:
    table = Table(title="Faults")
    for col in ("at s", "until s", "fault", "worker", "pid", "note"):
        table.add_column(col, justify="right" if col in ("at s", "until s", "pid") else "left")
    for f in result["faults"]:
        table.add_row(
            f"{f['at_s']:.2f}",
            f"{f['until_s']:.2f}",
            f["kind"],
            Text(str(f.get("worker", ""))),
            str(f.get("pid", "")),
            Text(str(f.get("note", ""))),
        )
    return table


def write_timeline(result: Mapping[str, Any], path: Path) -> Path:
    """Jobs added, executions started and jobs completed over time, with every fault marked."""
    require("the chaos timeline plot", "matplotlib")
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    line = result["timeline"]
    step = float(line["bin_s"])
    xs = [i * step for i in range(len(line["completed"]))]
    fig = Figure(figsize=(11.0, 5.0), dpi=100, layout="constrained")
    ax = fig.subplots()
    ax.plot(xs, line["added"], color="#0072B2", lw=1.5, label="jobs accepted")
    ax.plot(xs, line["started"], color="#56B4E9", lw=1, ls="--", label="executions started")
    ax.plot(xs, line["completed"], color="#009E73", lw=2, label="jobs completed")
    handles: list[Any] = ax.get_lines()[:]
    seen: set[str] = set()
    for f in result["faults"]:
        style = _FAULT_STYLE.get(f["kind"])
        if style is None:
            continue
        if f["kind"] == "kill":
            ax.axvline(f["at_s"], color=style["color"], lw=1.2)
            ax.annotate(
                str(f.get("worker", "")).replace("$", r"\$"),
                (f["at_s"], 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                color=style["color"],
                ha="left",
                va="top",
            )
        else:
            ax.axvspan(f["at_s"], f["until_s"], color=style["color"], alpha=0.18, lw=0)
        if f["kind"] not in seen:
            seen.add(f["kind"])
            if f["kind"] == "kill":
                handles.append(Line2D([], [], color=style["color"], label=style["label"]))
            else:
                handles.append(Patch(color=style["color"], alpha=0.3, label=style["label"]))
    check = result["check"]
    verdict = "passed" if check["passed"] else "FAILED"
    counts = check["counts"]
    ax.set_title(
        f"chaos run, seed {result['config']['seed']}: {counts['accepted']:,} jobs, "
        f"lost {counts['lost']}, duplicates {counts['duplicate_results']}, "
        f"stale accepted {counts['stale_commits_accepted']}, "
        f"{check['re_executions']} re-executions: {verdict}",
        loc="left",
        fontsize=10,
    )
    ax.set_xlabel("seconds since the first add")
    ax.set_ylabel("jobs (cumulative)")
    ax.grid(color="#d0d7de", lw=0.6)
    ax.set_axisbelow(True)
    ax.legend(handles=handles, loc="upper left", fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", facecolor="white")
    return path
