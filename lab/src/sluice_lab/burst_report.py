"""The burst results (``sluice bench burst --json``) as a section of the lab's HTML report.

The lab report is one portable file, so each burst's PNG is embedded as a
data URI, with links to the JSON and the PNG beside it for whoever has the
folder. The figures come from the JSON as written (medians per burst size,
and the ratios Sluice / BullMQ when BullMQ ran): nothing is recomputed here.

Which bursts: those given with ``sluice bench lab --burst FILE`` and every
``burst*.json`` in the lab's output folder (:func:`find_bursts`), so a
``sluice bench burst --json lab-results/burst.json`` before the lab is picked
up without an option.
"""

from __future__ import annotations

import base64
import html
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bursts_html", "find_bursts"]

_METRICS = (
    ("queue_wait", "queue wait"),
    ("processing", "processing"),
    ("end_to_end", "end to end"),
    ("since_add", "since the add"),
)


def find_bursts(folder: Path, given: Sequence[Path] = ()) -> list[Path]:
    """``given`` first, then every ``burst*.json`` in ``folder`` (sorted), each once."""
    found = sorted(folder.glob("burst*.json")) if folder.is_dir() else []
    out: list[Path] = []
    for path in [*given, *found]:
        if path.resolve() not in {p.resolve() for p in out}:
            out.append(path)
    return out


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, fmt: str) -> str:
    return "-" if not isinstance(value, int | float) or isinstance(value, bool) else format(value, fmt)


def _link(path: Path, base: Path) -> str:
    try:
        href = os.path.relpath(path.resolve(), base.resolve())
    except ValueError:  # another drive on Windows
        href = path.resolve().as_uri()
    return f'<a href="{_esc(Path(href).as_posix())}">{_esc(path.name)}</a>'


def _row(jobs: str, queue: str, row: Mapping[str, Any]) -> str:
    cells = [
        jobs,
        queue,
        _num(row.get("drain_s"), ".3f"),
        _num(row.get("rate"), ",.0f"),
        _num(row.get("peak_waiting"), ",.0f"),
        f"{row.get('lost_max', '-')}/{row.get('duplicates_max', '-')}",
    ]
    for key, _ in _METRICS:
        m = row.get(key) or {}
        cells.append("/".join(_num(m.get(q), ",.1f") for q in ("p50", "p95", "p99")))
    return "<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>"


def _ratio_row(ratio: Mapping[str, Any]) -> str:
    def x(value: Any) -> str:
        return _num(value, ".2f") + ("x" if isinstance(value, int | float) else "")

    cells = ["", "Sluice / BullMQ", x(ratio.get("drain_s")), "", "", ""]
    for key, _ in _METRICS:
        m = ratio.get(key) or {}
        cells.append("-/" + "/".join(x(m.get(q)) for q in ("p95", "p99")))
    return '<tr class="ratio">' + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>"


def _table(data: Mapping[str, Any]) -> str:
    head = ["jobs", "queue", "drain s", "jobs/s", "peak waiting", "lost/dup"]
    head += [f"{label} ms p50/p95/p99" for _, label in _METRICS]
    peer = data.get("peer") or {}
    theirs = {r.get("jobs"): r for r in peer.get("summary") or []}
    ratios = {r.get("jobs"): r for r in data.get("ratios") or []}
    bodies = []
    for row in data.get("summary") or []:
        jobs = _num(row.get("jobs"), ",")
        lines = [_row(jobs, "Sluice", row)]
        if row.get("jobs") in theirs:
            lines.append(_row("", "BullMQ (Node)", theirs[row["jobs"]]))
        if row.get("jobs") in ratios:
            lines.append(_ratio_row(ratios[row["jobs"]]))
        bodies.append("<tbody>" + "".join(lines) + "</tbody>")
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    return f'<table class="burst"><thead><tr>{th}</tr></thead>{"".join(bodies)}</table>'


def _one(path: Path, base: Path) -> str:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("summary"), list):
            raise ValueError("no 'summary' list: not a `sluice bench burst --json` file")
    except (OSError, ValueError) as exc:
        return f'<section><h3>{_esc(path.name)}</h3><p class="note">Not shown: {_esc(exc)}</p></section>'
    meta = data.get("meta") or {}
    parts = [f"<section><h3>{_esc(path.name)}</h3>"]
    parts.append(
        f"<p>{_esc(meta.get('processes', '?'))} worker process(es) x concurrency "
        f"{_esc(meta.get('concurrency', '?'))}, job {_esc(meta.get('work_ms', '?'))} ms, medians of "
        f"{_esc(meta.get('reps', '?'))} run(s), measured {_esc(meta.get('date', '?'))}. "
        f"{_esc(meta.get('peers', ''))}.</p>"
    )
    parts.append(_table(data))
    png = path.with_suffix(".png")
    links = [_link(path, base)]
    if png.is_file():
        b64 = base64.b64encode(png.read_bytes()).decode("ascii")
        parts.append(f'<img src="data:image/png;base64,{b64}" alt="{_esc(path.stem)}: depth over time">')
        links.append(_link(png, base))
    parts.append(f'<p class="caption">Files: {", ".join(links)}</p></section>')
    return "".join(parts)


def bursts_html(paths: Sequence[Path], base: Path) -> str:
    """The report's burst section ("" when there is no burst result); links relative to ``base``."""
    if not paths:
        return ""
    intro = (
        "<h2>Burst: N jobs at once</h2><p>From <code>sluice bench burst</code>: the time from the add to "
        "the last completion, the peak waiting depth and the latency percentiles, with the same burst on "
        "BullMQ for Node where it was installed. Ratios under 1: Sluice took less.</p>"
    )
    return intro + "".join(_one(p, base) for p in paths)
