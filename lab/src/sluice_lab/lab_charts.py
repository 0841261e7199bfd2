"""The charts of the lab report: per mode, a job timeline beside its latency percentiles, as
base64 PNG.

They are drawn on a bare ``matplotlib.figure.Figure``, never through pyplot,
so rendering selects no GUI backend and leaves no global figure state
behind; a string from the results goes in with ``$`` escaped (a stray pair
would start mathtext and can fail the draw).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sluice_lab.lab_rows import Result, _at, _is_num, _jobs, _num

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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
