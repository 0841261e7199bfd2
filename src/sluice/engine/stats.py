"""The latency report of ``sluice stats --json`` and ``GET /v1/stats``: every metric's
percentiles over a few windows, from the queue's merged sketches (sketch.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sluice.engine.clock import queue_now_ms
from sluice.engine.sketch import RELATIVE_ACCURACY

if TYPE_CHECKING:
    from sluice.engine.queue import Queue

#: The windows ``sluice stats`` and ``GET /v1/stats`` report, by label (seconds).
WINDOWS = {"1m": 60, "5m": 300, "1h": 3600}


async def latency_report(queue: Queue, windows: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Every metric's percentiles over each window, on one reading of Redis's clock: the
    JSON of ``sluice stats --json`` and the body of ``GET /v1/stats``."""
    now = await queue_now_ms(queue)
    out: dict[str, Any] = {}
    for label, seconds in (windows or WINDOWS).items():
        window = await queue.latency(seconds, now=now)
        out[label] = {"seconds": window.window_s, "metrics": window.to_dict()["metrics"]}
    return {
        "queue": queue.name,
        "accuracy": RELATIVE_ACCURACY,
        "now_ms": now,
        "windows": out,
    }
