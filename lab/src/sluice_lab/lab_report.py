"""Terminal tables and a one-file HTML report of ``sluice bench lab`` results.

The lab's JSON (one dict per mode; the field names follow the reference
implementation) is the record. This module only renders it: it never
recomputes a check, so a table can't disagree with the JSON it came from.
The terminal table and the HTML summary read the same row specs, so the two
always show the same figures.

The report is one self-contained file (inline CSS, charts as base64 PNG data
URIs), so it can be attached to an issue or mailed as it is. The charts need
matplotlib (a dependency of sluice-lab): without it the report keeps
its tables and says how to get the charts. Charts are drawn on a bare
``matplotlib.figure.Figure``, never through pyplot, so rendering selects no
GUI backend and leaves no global figure state behind.

Every string from the results is untrusted (a worker id is whatever a worker
was told to call itself): it goes into rich as ``Text`` (never parsed as
markup), into HTML through ``html.escape``, and into matplotlib with ``$``
escaped (a stray pair would start mathtext and can fail the draw).
"""

from __future__ import annotations

import base64
import html
import io
import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from rich.table import Table
from rich.text import Text

from sluice_lab.deps import INSTALL

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["REPORT_NAME", "lab_table", "throttle_table", "write_report"]

#: File name of the report inside the output folder.
REPORT_NAME = "lab-report.html"

Result = Mapping[str, Any]
Cell = Callable[[Result], str]
Row = tuple[str, Cell]


# -- reading the results ------------------------------------------------------------------------------------


def _at(data: Any, *path: str) -> Any:
    """The value at a path of keys, or None where a step is missing: a partial result still renders."""
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _is_num(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _num(value: Any, digits: int = 1) -> str:
    return f"{value:,.{digits}f}" if _is_num(value) else "-"


def _field(*path: str, digits: int = 1) -> Cell:
    def cell(result: Result) -> str:
        value = _at(result, *path)
        if isinstance(value, str):
            return value
        return _num(value, digits)

    return cell


def _of(part: tuple[str, ...], whole: tuple[str, ...]) -> Cell:
    """'n of limit': a remaining budget or a peak reads only against what it may reach."""

    def cell(result: Result) -> str:
        return f"{_num(_at(result, *part), 0)} of {_num(_at(result, *whole), 0)}"

    return cell


def _admitted(budget: str) -> Cell:
    def cell(result: Result) -> str:
        tokens = _num(_at(result, budget, "admittedTokens"), 0)
        return f"{tokens} ({_num(_at(result, budget, 'acceptedReservations'), 0)} jobs)"

    return cell


def _workers(result: Result) -> str:
    ids = _at(result, "metrics", "workerIds")
    return ", ".join(str(w) for w in ids) if isinstance(ids, list) and ids else "-"


def _latency_rows(name: str, key: str) -> tuple[Row, ...]:
    return tuple((f"{name} {p} ms", _field("metrics", key, p)) for p in ("p50", "p95", "p99"))


#: Rows of figures, in groups (a rule between groups); shared by the terminal and HTML tables.
_FIGURES: tuple[tuple[Row, ...], ...] = (
    (
        ("throughput, jobs/s", _field("metrics", "throughputJobsPerSecond", digits=2)),
        ("max concurrent", _of(("metrics", "maxConcurrent"), ("workload", "globalConcurrency"))),
        ("min ms between every 5th start", _field("metrics", "minimumMsBetweenEveryFifthStart")),
    ),
    (
        *_latency_rows("queue wait", "queueWaitMs"),
        *_latency_rows("processing", "processingMs"),
        *_latency_rows("end to end", "endToEndMs"),
    ),
    (
        ("race admitted, tokens", _admitted("raceBudget")),
        ("race rejected, jobs", _field("raceBudget", "rejectedReservations", digits=0)),
        ("race remaining, tokens", _of(("raceBudget", "remaining"), ("raceBudget", "initial"))),
        ("race admitted util. %", _field("raceBudget", "admittedUtilizationPct")),
        ("race ledger util. %", _field("raceBudget", "ledgerUtilizationPct")),
        ("load budget remaining", _of(("loadBudget", "remaining"), ("loadBudget", "initial"))),
    ),
    (
        ("overuse spend, tokens", _of(("overuseBudget", "realSpend"), ("overuseBudget", "limit"))),
        ("overuse overspend", _field("overuseBudget", "overspend", digits=0)),
        ("overuse bound", _field("overuseBudget", "bound", digits=0)),
        ("overuse ledger used", _field("overuseBudget", "ledgerUsed", digits=0)),
        ("overuse ledger overspent", _field("overuseBudget", "ledgerOverspent", digits=0)),
        ("overuse admitted, jobs", _field("overuseBudget", "admittedJobs", digits=0)),
    ),
    (("workers", _workers),),
)

#: (label, key in "checks"); "all checks" last, after a rule.
_CHECKS: tuple[tuple[str, str], ...] = (
    ("two workers used", "usedTwoWorkers"),
    ("priority order enforced", "priorityOrderEnforced"),
    ("concurrency ceiling held", "sharedConcurrencyCeilingHeld"),
    ("global rate limit observed", "globalRateLimitObserved"),
    ("budget never overspent", "atomicBudgetNeverOverspent"),
    ("race outcome as expected", "raceOutcomeMatchedExpectation"),
    ("overuse spend within bound", "overuseWithinBound"),
    ("ledger used = real spend", "ledgerMatchesRealSpend"),
    ("429 paused the queue, no failure", "throttleRecovered"),
    ("all checks", "allPassed"),
)
#: The last of the budget checks: a rule after it in the terminal table.
_LAST_BUDGET_CHECK = "ledgerMatchesRealSpend"

_THROTTLE_ROWS: tuple[Row, ...] = (
    ("job", _field("throttle", "jobId")),
    ("retry after ms", _field("throttle", "retryAfterMs", digits=0)),
    ("paused ms", _field("throttle", "pausedMs")),
    ("attempts", _field("throttle", "attempts", digits=0)),
    ("failures", _field("throttle", "failures", digits=0)),
    ("status", _field("throttle", "status")),
)


def _title(results: Sequence[Result]) -> str:
    if not results:
        return "Sluice lab (no modes run)"
    work = _at(results[0], "workload")
    overuse = (
        f" + {_num(_at(work, 'overuseJobs'), 0)} overuse" if _at(work, "overuseJobs") is not None else ""
    )
    return (
        f"Sluice lab: {_num(_at(work, 'loadJobs'), 0)} load + {_num(_at(work, 'raceJobs'), 0)} race"
        f"{overuse} jobs, {_num(_at(work, 'workerProcesses'), 0)} worker processes"
    )


def _caption(results: Sequence[Result]) -> str:
    work = _at(results[0], "workload") if results else None
    text = (
        "5th start: least time between starts n and n+4 (the rate limit allows "
        f"{_num(_at(work, 'rateLimitMax'), 0)} per {_num(_at(work, 'rateLimitDurationMs'), 0)} ms). "
        "Util. %: tokens admitted, or recorded in the budget ledger, over the budget."
    )
    overuse = _at(results[0], "overuseBudget") if results else None
    if overuse is not None:
        e, u, c = (_num(_at(overuse, key), 0) for key in ("estimate", "usage", "concurrency"))
        text += (
            f" Overuse: jobs estimating {e} tokens use {u}; spend is what their handlers reported, "
            f"bound = limit + {c} running at once x ({u} - {e}), ledger is what the budget says."
        )
    if any(_at(r, "mode") == "naive" for r in results):
        text += (
            " naive is the check-then-act baseline: it may overspend and counts estimates only,"
            " and its 'all checks' does not count that."
        )
    return text


def _workload_text(results: Sequence[Result]) -> str:
    """The fixed workload in one paragraph, so the report reads on its own."""
    if not results:
        return "No modes were run."
    first = results[0]

    def w(key: str) -> str:
        return _num(_at(first, "workload", key), 0)

    jobs = [j for j in _at(first, "jobs") or [] if isinstance(j, Mapping) and j.get("phase") == "load"]
    runs = [(p, len(list(run))) for p, run in itertools.groupby(j.get("priority") for j in jobs)]
    mix = ", then ".join(f"{n} at priority {p}" for p, n in runs)
    return (
        f"{w('workerProcesses')} worker processes (local concurrency {w('localConcurrency')} each) share a "
        f"global concurrency of {w('globalConcurrency')} and a rate limit of {w('rateLimitMax')} starts per "
        f"{w('rateLimitDurationMs')} ms. Load phase: {w('loadJobs')} jobs of {w('tokensPerJob')} tokens"
        f"{f' ({mix})' if mix else ''} against a "
        f"{_num(_at(first, 'loadBudget', 'initial'), 0)}-token budget. "
        f"Race phase: {w('raceJobs')} jobs of {w('tokensPerJob')} tokens at once against a "
        f"{_num(_at(first, 'raceBudget', 'initial'), 0)}-token budget." + _overuse_text(first)
    )


def _overuse_text(first: Result) -> str:
    overuse = _at(first, "overuseBudget")
    if overuse is None:
        return ""

    def o(key: str) -> str:
        return _num(_at(overuse, key), 0)

    return (
        f" Overuse phase, without the rate limit: {_num(_at(first, 'workload', 'overuseJobs'), 0)} jobs "
        f"estimating {o('estimate')} tokens whose calls use {o('usage')} against a {o('limit')}-token "
        f"budget; with at most {o('concurrency')} running at once, the spend may pass the limit by at most "
        f"{o('concurrency')} x ({o('usage')} - {o('estimate')}) tokens, and the ledger must show it all."
    )


# -- terminal tables ----------------------------------------------------------------------------------------


def _mark(value: Any) -> Text:
    if value is True:
        return Text("✓", style="bold green")
    if value is False:
        return Text("✗", style="bold red")
    return Text("-", style="dim")


def _mode_table(results: Sequence[Result], title: str) -> Table:
    table = Table(title=title, caption_justify="left")
    table.add_column("")
    for result in results:
        table.add_column(Text(str(_at(result, "mode"))), justify="right")
    return table


def lab_table(results: Sequence[Result]) -> Table:
    """One column per mode, so the modes compare across a row; every figure and check of the run."""
    table = _mode_table(results, _title(results))
    table.caption = _caption(results)
    for group in _FIGURES:
        for i, (label, cell) in enumerate(group):
            table.add_row(label, *(Text(cell(r)) for r in results), end_section=i == len(group) - 1)
    for label, key in _CHECKS:
        table.add_row(
            Text(label, style="bold" if key == "allPassed" else ""),
            *(_mark(_at(r, "checks", key)) for r in results),
            end_section=key == _LAST_BUDGET_CHECK,
        )
    return table


def throttle_table(results: Sequence[Result]) -> Table:
    """The throttle scenario per mode: a job told to retry later must pause, not count as failed."""
    table = _mode_table(results, "Sluice lab: throttle scenario (retry-after)")
    for label, cell in _THROTTLE_ROWS:
        table.add_row(label, *(Text(cell(r)) for r in results))
    table.add_row("no failure recorded", *(_mark(_at(r, "throttle", "noFailureRecorded")) for r in results))
    return table


# -- charts (matplotlib, optional) --------------------------------------------------------------------------

_QUEUE_COLOUR = "#c9d1d9"
#: Okabe-Ito: tells workers apart for colour-blind readers too.
_WORKER_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00")
_UNKNOWN_COLOUR = "#8c959f"
_RACE_BAND = "#fff1c2"
_OVERUSE_BAND = "#e3eefc"
#: Phases whose rows the timeline shades: (band colour, tick label colour, legend label).
_PHASE_BANDS = {
    "race": (_RACE_BAND, "#9a6700", "race phase"),
    "overuse": (_OVERUSE_BAND, "#0a4f9e", "overuse phase"),
}
_REJECTED_COLOUR = "#cf222e"
_OTHER_STATUS_COLOUR = "#57606a"
_THROTTLE_COLOUR = "#8250df"
_LATENCIES = (("queue wait", "queueWaitMs"), ("processing", "processingMs"), ("end to end", "endToEndMs"))
_PERCENTILES = (("p50", "#9ecae1"), ("p95", "#4292c6"), ("p99", "#08519c"))


def _safe(text: object) -> str:
    return str(text).replace("$", r"\$")


def _seconds(ms: Any, t0: float) -> float | None:
    return (float(ms) - t0) / 1000.0 if _is_num(ms) else None


def _jobs(result: Result) -> list[Mapping[str, Any]]:
    return [j for j in _at(result, "jobs") or [] if isinstance(j, Mapping)]


def _worker_colours(result: Result, jobs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    listed = _at(result, "metrics", "workerIds")
    ids = [str(w) for w in listed] if isinstance(listed, list) else []
    ids += sorted({str(j["workerId"]) for j in jobs if j.get("workerId") is not None} - set(ids))
    return {w: _WORKER_COLOURS[i % len(_WORKER_COLOURS)] for i, w in enumerate(ids)}


def _draw_job(ax: Axes, row: int, job: Mapping[str, Any], t0: float, colours: Mapping[str, str]) -> None:
    enqueued, started, done = (_seconds(job.get(k), t0) for k in ("enqueuedAt", "startedAt", "completedAt"))
    status = job.get("status")
    band = _PHASE_BANDS.get(str(job.get("phase")))
    if band is not None:
        ax.axhspan(row - 0.5, row + 0.5, color=band[0], lw=0, zorder=0)
    if enqueued is not None and started is not None:
        ax.barh(row, started - enqueued, left=enqueued, height=0.62, color=_QUEUE_COLOUR, zorder=2)
    if started is not None and done is not None and status != "rejected":
        worker = job.get("workerId")
        colour = colours.get(str(worker), _UNKNOWN_COLOUR) if worker is not None else _UNKNOWN_COLOUR
        ax.barh(row, max(done - started, 0.0), left=started, height=0.62, color=colour, zorder=2)
    if status != "completed":
        at = next((t for t in (done, started, enqueued) if t is not None), None)
        if at is not None:
            rejected = status == "rejected"
            ax.plot(
                [at],
                [row],
                ls="none",
                marker="X" if rejected else "o",
                ms=8,
                color=_REJECTED_COLOUR if rejected else _OTHER_STATUS_COLOUR,
                zorder=4,
            )


def _draw_throttle(ax: Axes, throttle: Any, ids: list[str], t0: float) -> bool:
    """Mark the throttled attempt on its job's row (or a row of its own); False if there is none."""
    at = _seconds(_at(throttle, "throttledAt"), t0)
    if at is None:
        return False
    job_id = str(_at(throttle, "jobId"))
    if job_id not in ids:
        ids.append(job_id)
    row = ids.index(job_id)
    resumed = _seconds(_at(throttle, "resumedAt"), t0)
    if resumed is not None:
        ax.barh(
            row,
            max(resumed - at, 0.0),
            left=at,
            height=0.62,
            facecolor="none",
            edgecolor=_THROTTLE_COLOUR,
            hatch="////",
            lw=1,
            zorder=3,
        )
    ax.plot([at], [row], ls="none", marker="v", ms=8, color=_THROTTLE_COLOUR, zorder=4)
    return True


def _legend(colours: Mapping[str, str], jobs: Sequence[Mapping[str, Any]], throttled: bool) -> list[Artist]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Artist] = [Patch(color=_QUEUE_COLOUR, label="queue wait")]
    handles += [Patch(color=c, label=_safe(f"processing on {w}")) for w, c in colours.items()]
    statuses = {j.get("status") for j in jobs}
    phases = {j.get("phase") for j in jobs}
    handles += [Patch(color=band, label=label) for p, (band, _, label) in _PHASE_BANDS.items() if p in phases]
    if "rejected" in statuses:
        handles.append(Line2D([], [], ls="none", marker="X", color=_REJECTED_COLOUR, label="rejected"))
    if statuses - {"completed", "rejected"}:
        handles.append(
            Line2D([], [], ls="none", marker="o", color=_OTHER_STATUS_COLOUR, label="not completed")
        )
    if throttled:
        handles.append(
            Line2D([], [], ls="none", marker="v", color=_THROTTLE_COLOUR, label="throttled (hatched: paused)")
        )
    return handles


def _draw_timeline(ax: Axes, result: Result) -> list[Artist]:
    """One row per job: queue wait then processing, against seconds since the first enqueue."""
    jobs = _jobs(result)
    throttle = _at(result, "throttle")
    stamps = [float(j["enqueuedAt"]) for j in jobs if _is_num(j.get("enqueuedAt"))]
    throttled_at = _at(throttle, "throttledAt")
    t0 = min(stamps) if stamps else float(throttled_at) if _is_num(throttled_at) else 0.0
    colours = _worker_colours(result, jobs)
    for row, job in enumerate(jobs):
        _draw_job(ax, row, job, t0, colours)
    ids = [str(j.get("jobId")) for j in jobs]
    throttled = _draw_throttle(ax, throttle, ids, t0)
    labels = [f"{job_id}  p{_num(j.get('priority'), 0)}" for job_id, j in zip(ids, jobs, strict=False)]
    labels += [f"{job_id}  throttle" for job_id in ids[len(jobs) :]]
    ax.set_yticks(range(len(ids)), [_safe(label) for label in labels], fontsize=7)
    for tick, job in zip(ax.get_yticklabels(), jobs, strict=False):
        band = _PHASE_BANDS.get(str(job.get("phase")))
        if band is not None:
            tick.set_color(band[1])
    ax.set_ylim(len(ids) - 0.5, -0.5)
    ax.set_xlabel("seconds since the first enqueue")
    ax.set_title("job timeline", loc="left", fontsize=11)
    ax.grid(axis="x", color="#d0d7de", lw=0.6)
    ax.set_axisbelow(True)
    return _legend(colours, jobs, throttled)


def _draw_latency(ax: Axes, result: Result) -> None:
    width = 0.27
    for i, (p, colour) in enumerate(_PERCENTILES):
        raw = [_at(result, "metrics", key, p) for _, key in _LATENCIES]
        heights = [float(v) if _is_num(v) else 0.0 for v in raw]
        xs = [g + (i - 1) * width for g in range(len(_LATENCIES))]
        bars = ax.bar(xs, heights, width, label=p, color=colour)
        ax.bar_label(bars, labels=[_num(v, 0) for v in raw], fontsize=7, padding=2, rotation=90)
    ax.set_xticks(range(len(_LATENCIES)), [name for name, _ in _LATENCIES], fontsize=9)
    ax.set_ylabel("ms")
    ax.margins(y=0.18)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.set_title("latency percentiles", loc="left", fontsize=11)
    ax.grid(axis="y", color="#d0d7de", lw=0.6)
    ax.set_axisbelow(True)


def _chart_png(figure: type[Figure], result: Result) -> str:
    """The mode's figure as base64 PNG: a timeline beside its latency percentiles."""
    rows = len(_jobs(result)) + 1
    fig = figure(figsize=(12.0, max(4.5, 0.2 * rows + 2.2)), dpi=100, layout="constrained")
    timeline, latency = fig.subplots(1, 2, width_ratios=[3.0, 1.2])
    handles = _draw_timeline(timeline, result)
    _draw_latency(latency, result)
    fig.suptitle(_safe(f"mode: {_at(result, 'mode')}"), x=0.01, ha="left", fontsize=13, fontweight="bold")
    lines = -(-len(handles) // 5)  # at most 5 to a line, the lines evenly filled
    ncols = -(-len(handles) // lines) if handles else 1
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=8, frameon=False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", facecolor="white")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _charts(results: Sequence[Result]) -> list[str] | None:
    """One base64 PNG per mode, or None when matplotlib (the ``lab`` extra) is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return [_chart_png(Figure, r) for r in results]


# -- HTML ---------------------------------------------------------------------------------------------------

_CSS = """
:root { --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --pass: #1a7f37; --fail: #cf222e; }
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       max-width: 1240px; margin: 2rem auto; padding: 0 1.25rem; }
h1 { font-size: 1.6rem; margin: 0 0 .4rem; }
h2 { font-size: 1.25rem; margin-top: 2.2rem; border-bottom: 1px solid var(--line); padding-bottom: .2rem; }
h3 { font-size: 1.1rem; margin: 1.6rem 0 .4rem; }
p { max-width: 80ch; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin: .6rem 0 .4rem; }
th, td { padding: .28rem .8rem; border-bottom: 1px solid var(--line); text-align: right;
         white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
thead th { border-bottom: 2px solid var(--fg); }
tbody + tbody { border-top: 2px solid var(--muted); }
.pass { color: var(--pass); font-weight: 700; }
.fail { color: var(--fail); font-weight: 700; }
.caption, .note { color: var(--muted); font-size: .9rem; }
.note { border-left: 3px solid var(--line); padding-left: .8rem; }
img { max-width: 100%; height: auto; border: 1px solid var(--line); border-radius: 4px; }
details { margin: .4rem 0 1rem; }
details table { font-size: .82rem; }
code { background: #f6f8fa; padding: .1rem .3rem; border-radius: 4px; }
table.burst { font-size: .82rem; }
table.burst th, table.burst td { padding: .22rem .5rem; }
table.burst th { white-space: normal; vertical-align: bottom; }
table.burst th:nth-child(2), table.burst td:nth-child(2) { text-align: left; }
tr.ratio td { color: var(--muted); }
"""


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _mark_td(value: Any) -> str:
    if value is True:
        return '<td class="pass" title="passed">✓</td>'
    if value is False:
        return '<td class="fail" title="failed">✗</td>'
    return '<td title="not reported">-</td>'


def _head(results: Sequence[Result]) -> str:
    cells = "".join(f"<th>{_esc(_at(r, 'mode'))}</th>" for r in results)
    return f"<thead><tr><th></th>{cells}</tr></thead>"


def _body(rows: Sequence[Row], results: Sequence[Result]) -> str:
    lines = [
        f"<tr><td>{_esc(label)}</td>{''.join(f'<td>{_esc(cell(r))}</td>' for r in results)}</tr>"
        for label, cell in rows
    ]
    return "<tbody>" + "".join(lines) + "</tbody>"


def _checks_body(checks: Sequence[tuple[str, str]], section: str, results: Sequence[Result]) -> str:
    lines = [
        f"<tr><td>{_esc(label)}</td>{''.join(_mark_td(_at(r, section, key)) for r in results)}</tr>"
        for label, key in checks
    ]
    return "<tbody>" + "".join(lines) + "</tbody>"


def _summary_html(results: Sequence[Result]) -> str:
    bodies = [_body(group, results) for group in _FIGURES]
    bodies.append(_checks_body(_CHECKS[:-1], "checks", results))
    bodies.append(_checks_body(_CHECKS[-1:], "checks", results))
    return f'<table class="summary">{_head(results)}{"".join(bodies)}</table>'


def _throttle_html(results: Sequence[Result]) -> str:
    flag = _checks_body((("no failure recorded", "noFailureRecorded"),), "throttle", results)
    return f"<table>{_head(results)}{_body(_THROTTLE_ROWS, results)}{flag}</table>"


_JOB_COLUMNS = (
    "job",
    "phase",
    "worker",
    "priority",
    "attempt",
    "enqueued +ms",
    "queue wait ms",
    "service ms",
    "end to end ms",
    "tokens",
    "reserved",
    "budget left",
    "status",
)


def _job_cells(job: Mapping[str, Any], t0: float) -> list[str]:
    enqueued = job.get("enqueuedAt")
    reserved = job.get("reserved")
    return [
        str(job.get("jobId")),
        str(job.get("phase", "-")),
        str(job.get("workerId") if job.get("workerId") is not None else "-"),
        _num(job.get("priority"), 0),
        _num(job.get("attempt"), 0),
        _num(enqueued - t0 if _is_num(enqueued) else None),
        _num(job.get("queueWaitMs")),
        _num(job.get("serviceMs")),
        _num(job.get("endToEndMs")),
        _num(job.get("tokenCost"), 0),
        "yes" if reserved is True else "no" if reserved is False else "-",
        _num(job.get("remainingBudget"), 0),
        str(job.get("status", "-")),
    ]


def _jobs_html(result: Result) -> str:
    jobs = _jobs(result)
    stamps = [float(j["enqueuedAt"]) for j in jobs if _is_num(j.get("enqueuedAt"))]
    t0 = min(stamps, default=0.0)
    head = "".join(f"<th>{_esc(c)}</th>" for c in _JOB_COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in _job_cells(j, t0)) + "</tr>" for j in jobs)
    return (
        f"<details><summary>{len(jobs)} jobs</summary>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></details>"
    )


def _mode_html(result: Result, chart: str | None) -> str:
    mode = _esc(_at(result, "mode"))
    parts = [f"<h3>{mode}</h3>"]
    if chart is not None:
        alt = f"{mode}: job timeline and latency percentiles"
        parts.append(f'<img src="data:image/png;base64,{chart}" alt="{alt}">')
    parts.append(_jobs_html(result))
    return "<section>" + "".join(parts) + "</section>"


def _report_html(results: Sequence[Result], charts: Sequence[str] | None, bursts: str = "") -> str:
    """The whole page as one string (pure: write_report only adds the file)."""
    note = ""
    if charts is None:
        note = (
            '<p class="note">This report has tables only: matplotlib is not installed. '
            f"<code>{_esc(INSTALL)}</code> gives the charts.</p>"
        )
    modes = [_mode_html(r, charts[i] if charts is not None else None) for i, r in enumerate(results)]
    return "\n".join(
        [
            '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{_esc(_title(results))}</title>\n<style>{_CSS}</style>\n</head>\n<body>",
            f"<h1>{_esc(_title(results))}</h1>",
            f"<p>{_esc(_workload_text(results))}</p>",
            note,
            "<h2>Summary</h2>",
            _summary_html(results),
            f'<p class="caption">{_esc(_caption(results))}</p>',
            "<h2>Throttle scenario</h2>",
            "<p>A job told by its provider to retry after a delay must pause and resume, "
            "not be counted as a failure.</p>",
            _throttle_html(results),
            bursts,
            "<h2>Modes</h2>",
            '<p class="caption">Timeline: one row per job, grey while it waits in the queue, then coloured '
            "by the worker that ran it. Race-phase and overuse-phase rows are shaded; rejected jobs are "
            "marked at the moment of rejection.</p>",
            *modes,
            "</body>\n</html>\n",
        ]
    )


def write_report(results: Sequence[Result], out_dir: Path, bursts: Sequence[Path] = ()) -> Path:
    """Write ``out_dir/lab-report.html``, one portable file (charts inlined), and return its path.

    ``bursts``: ``sluice bench burst`` JSON files shown in a section of their own, each with its PNG.
    """
    from sluice_lab.burst_report import bursts_html

    page = _report_html(results, _charts(results), bursts_html(bursts, out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_NAME
    path.write_text(page, encoding="utf-8")
    return path
