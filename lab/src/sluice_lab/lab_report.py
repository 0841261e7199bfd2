"""Terminal tables and a one-file HTML report of ``sluice bench lab`` results.

The lab's JSON (one dict per mode; the field names follow the reference
implementation) is the record. This module only renders it: it never
recomputes a check, so a table can't disagree with the JSON it came from.
The terminal table and the HTML summary read the same row specs
(:mod:`sluice_lab.lab_rows`), so the two always show the same figures.

The report is one self-contained file (inline CSS, charts as base64 PNG data
URIs), so it can be attached to an issue or mailed as it is. The charts
(:mod:`sluice_lab.lab_charts`) need matplotlib (a dependency of sluice-lab):
without it the report keeps its tables and says how to get the charts.
Charts are drawn on a bare ``matplotlib.figure.Figure``, never through
pyplot, so rendering selects no GUI backend and leaves no global figure
state behind.

Every string from the results is untrusted (a worker id is whatever a worker
was told to call itself): it goes into rich as ``Text`` (never parsed as
markup), into HTML through ``html.escape``, and into matplotlib with ``$``
escaped (a stray pair would start mathtext and can fail the draw).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from sluice_lab.deps import INSTALL
from sluice_lab.lab_charts import _charts
from sluice_lab.lab_rows import (
    _CHECKS,
    _FIGURES,
    _LAST_BUDGET_CHECK,
    _THROTTLE_ROWS,
    Result,
    Row,
    _at,
    _caption,
    _is_num,
    _jobs,
    _num,
    _title,
    _workload_text,
)

__all__ = ["REPORT_NAME", "lab_table", "throttle_table", "write_report"]

#: File name of the report inside the output folder.
REPORT_NAME = "lab-report.html"


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
