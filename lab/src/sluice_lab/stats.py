"""Percentiles and small summaries of measured samples.

The percentile interpolates linearly between closest ranks, exactly like the
peer harness (bench-peers/run.py ``pct``), so a p99 printed here and a p99 in
the peer table mean the same thing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0-100) of already sorted values; None when there are none."""
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    k = (len(sorted_values) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo))


def summarize_ms(samples: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p95/p99/mean/min/max of latency samples in milliseconds."""
    s = sorted(samples)
    return {
        "samples": len(s),
        "p50_ms": percentile(s, 50),
        "p95_ms": percentile(s, 95),
        "p99_ms": percentile(s, 99),
        "mean_ms": statistics.fmean(s) if s else None,
        "min_ms": s[0] if s else None,
        "max_ms": s[-1] if s else None,
    }


def per_job_us(seconds: float | None, jobs: int) -> float | None:
    """CPU seconds spread over ``jobs``, in microseconds per job (None if unknown)."""
    if seconds is None or jobs <= 0:
        return None
    return round(seconds / jobs * 1e6, 1)


def rate(jobs: int, seconds: float | None) -> float | None:
    """Jobs per second, or None when no time elapsed (nothing measurable)."""
    if not seconds or seconds <= 0:
        return None
    return round(jobs / seconds, 1)
