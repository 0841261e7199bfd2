"""The goodput benchmark's figures as the reports show them: a variant's rows, the ratio column, the spec.

Kept apart from :mod:`sluice_lab.goodput` (the run) for the command line's
tables, the matrix and the lab report.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from sluice_lab.goodput import LIMITED, NO_LIMITER, GoodputSpec, theoretical_min_s, workload


def compare(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """no-limiter / sluice-limited for every figure where a ratio means something (the table's column)."""
    a, b = results.get(LIMITED), results.get(NO_LIMITER)
    if a is None or b is None:
        return {}
    out = {}
    for (label, _, x), (_, _, y) in zip(rows(a), rows(b), strict=True):
        if x and y is not None:
            out[label] = round(y / x, 3)
    return out


def spec_meta(spec: GoodputSpec) -> dict[str, Any]:
    """The spec and the workload's totals, for the JSON and the table's caption."""
    calls = workload(spec.jobs)
    minimum, binds = theoretical_min_s(spec, calls)
    return {
        **asdict(spec),
        "workload_tokens": sum(c.tokens for c in calls),
        "theoretical_min_s": round(minimum, 3),
        "theoretical_binding": binds,
    }


def _n(value: float | None, digits: int = 0, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def rows(r: dict[str, Any]) -> list[tuple[str, str, float | None]]:
    """(figure, as shown, value for a ratio or None) of one variant: the report's rows."""
    lag = r["dispatch_to_arrival"]
    # A run that stopped with jobs left has no completion time, and the latencies of the
    # jobs that made it say nothing about the others (the JSON keeps them).
    e2e = r["e2e"] if r["complete"] else {}
    return [
        ("completion time, s", _n(r["completion_s"], 2), r["completion_s"]),
        ("theoretical minimum, s", _n(r["theoretical_min_s"], 2), None),
        (
            "goodput, % of the provider's limit",
            f"{_n(r['goodput_pct'], 1)} ({r['binding'] or '-'})",
            r["goodput_pct"],
        ),
        ("429s received", _n(r["rate_limited"]), None),
        ("wasted calls", _n(r["wasted_calls"]), None),
        ("total calls", _n(r["calls"]), r["calls"]),
        ("end-to-end p50, s", _n(e2e.get("p50_ms"), 2, 1e-3), e2e.get("p50_ms")),
        ("end-to-end p95, s", _n(e2e.get("p95_ms"), 2, 1e-3), e2e.get("p95_ms")),
        ("end-to-end p99, s", _n(e2e.get("p99_ms"), 2, 1e-3), e2e.get("p99_ms")),
        ("dispatch to arrival p50 / max, ms", f"{_n(lag['p50_ms'])} / {_n(lag['max_ms'])}", None),
        (
            "done / duplicates / not done",
            f"{r['completed']} / {r['duplicates']} / {r['lost_or_failed']}",
            None,
        ),
    ]
