"""Markdown table of a bench-peers results JSON, with every peer as a ratio to Sluice.

    python benchmarks/ratio_table.py benchmarks/results/results-<date>-sluice.json

Each peer is compared with the Sluice entry of the same worker concurrency
(``sluice`` = 10 jobs at once per process, ``sluice-c50`` = 50); peers that
have no concurrency setting (huey, dramatiq: threads) are compared with
``sluice``. A ratio is peer / Sluice for rates (above 1: the peer is faster)
and for latency and CPU per job (above 1: the peer is slower / costlier).
Medians over the run's repetitions, as the harness reports them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _get(agg: dict[str, Any], lib: str, mode: str, key: str) -> float | None:
    value = agg.get(lib, {}).get(mode, {}).get(key)
    return float(value) if value is not None else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(peer: float | None, ref: float | None) -> str:
    if peer is None or ref is None or ref == 0:
        return "-"
    return f"{peer / ref:.2f}x"


def reference(agg: dict[str, Any], lib: str) -> str:
    """The Sluice entry a peer is compared with: same concurrency per process."""
    return "sluice-c50" if agg.get(lib, {}).get("concurrency") == 50 and "sluice-c50" in agg else "sluice"


def table(data: dict[str, Any]) -> str:
    agg = data["summary"]
    libs = [lib for lib in data["meta"]["libs"] if lib in agg]
    rows = [
        "| library | conc. | drain/s 1 proc | vs Sluice | drain/s 2 procs | vs Sluice "
        "| latency p50 / p95 / p99 ms | p50 vs Sluice | worker CPU µs/job | vs Sluice "
        "| Redis CPU µs/job | vs Sluice | enqueue/s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for lib in libs:
        ref = reference(agg, lib)
        tp1 = _get(agg, lib, "tp1", "process_rate")
        tp2 = _get(agg, lib, "tp2", "process_rate")
        p50 = _get(agg, lib, "lat", "p50_ms")
        lat = (
            f"{_fmt(p50, 2)} / {_fmt(_get(agg, lib, 'lat', 'p95_ms'), 2)} / "
            f"{_fmt(_get(agg, lib, 'lat', 'p99_ms'), 2)}"
            if p50 is not None
            else "-"
        )
        wcpu = _get(agg, lib, "tp1", "worker_cpu_us_per_job")
        rcpu = _get(agg, lib, "tp1", "redis_cpu_us_per_job")
        rows.append(
            f"| {lib} | {agg[lib].get('concurrency') or '-'} "
            f"| {_fmt(tp1)} | {_ratio(tp1, _get(agg, ref, 'tp1', 'process_rate'))} "
            f"| {_fmt(tp2)} | {_ratio(tp2, _get(agg, ref, 'tp2', 'process_rate'))} "
            f"| {lat} | {_ratio(p50, _get(agg, 'sluice', 'lat', 'p50_ms'))} "
            f"| {_fmt(wcpu)} | {_ratio(wcpu, _get(agg, ref, 'tp1', 'worker_cpu_us_per_job'))} "
            f"| {_fmt(rcpu)} | {_ratio(rcpu, _get(agg, ref, 'tp1', 'redis_cpu_us_per_job'))} "
            f"| {_fmt(_get(agg, lib, 'tp1', 'enqueue_rate'))} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(table(json.loads(Path(sys.argv[1]).read_text())))
