"""``sluice stats``: latency percentiles of a queue over sliding windows."""

from __future__ import annotations

from typing import Any

from sluice.cli.options import JsonOpt, PrefixOpt, QueueOpt, RedisOpt, Target
from sluice.cli.output import note, plain_table, print_json, span, stdout
from sluice.cli.runtime import with_queue
from sluice.engine import Queue
from sluice.engine.sketch import METRICS
from sluice.engine.stats import latency_report
from sluice.settings import DEFAULT_PREFIX, DEFAULT_QUEUE

_LABELS = {"queue_wait": "queue wait", "processing": "processing", "end_to_end": "end to end"}


def stats(
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Queue wait, processing and end-to-end time: p50/p95/p99 and counts over the last
    1 min, 5 min and 1 h, from the latency bins every worker flushes about once a second.

    Each percentile is within 1 % (relative) of the exact one; a window covers up to one
    bucket more (10 s, or 1 min for the hour)."""
    target = Target(queue, prefix, redis)

    async def fetch(q: Queue) -> dict[str, Any]:
        return await latency_report(q)

    report = with_queue(target, fetch)
    if as_json:
        print_json(report)
        return
    windows: dict[str, Any] = report["windows"]
    table = plain_table(f"latency of {target.describe()} (percentiles within 1 %)")
    table.add_column("metric")
    for label in windows:
        for col in ("p50", "p95", "p99", "count"):
            table.add_column(f"{label} {col}", justify="right")
    for metric in METRICS:
        row = [_LABELS[metric]]
        for window in windows.values():
            m = window["metrics"][metric]
            row += [_ms(m["p50"]), _ms(m["p95"]), _ms(m["p99"]), f"{m['count']:,}"]
        table.add_row(*row)
    stdout().print(table)
    if not any(w["metrics"]["processing"]["count"] for w in windows.values()):
        note(f"no attempt of {target.describe()} finished in the last hour")


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} ms" if value < 100 else span(value, compact=True)
