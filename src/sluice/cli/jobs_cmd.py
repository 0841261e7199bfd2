"""Looking at a queue and its jobs: ``sluice info`` and ``sluice show``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.text import Text

from sluice.cli.errors import CliFailure, explain
from sluice.cli.options import JsonOpt, PrefixOpt, QueueOpt, RedisOpt, Target
from sluice.cli.output import (
    fields_table,
    json_text,
    note,
    plain_table,
    print_json,
    relative,
    span,
    stdout,
    utc,
)
from sluice.cli.runtime import with_queue
from sluice.engine import JobRecord, Queue, WorkerInfo
from sluice.engine.admin import COUNTERS
from sluice.engine.clock import now_ms, queue_now_ms
from sluice.engine.keys import is_job_id
from sluice.errors import JobNotFound
from sluice.settings import DEFAULT_PREFIX, DEFAULT_QUEUE

LIVE = ("waiting", "delayed", "parked", "active", "dead")


def job_id_check(value: str) -> str:
    """Typer callback: a job id (a positive decimal number)."""
    if not is_job_id(value):
        raise typer.BadParameter(f"{value!r} is not a job id (ids are numbers, e.g. 42)")
    return value


def job_ids(values: list[str] | None) -> list[str] | None:
    """Typer callback for a list of job ids."""
    return None if values is None else [job_id_check(v) for v in values]


JobIdArg = Annotated[
    str, typer.Argument(callback=job_id_check, help="Job id (a number).", show_default=False)
]


def info(
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Jobs of the queue per state, its counters, and the workers that serve it."""
    target = Target(queue, prefix, redis)

    async def fetch(q: Queue) -> tuple[dict[str, int], list[WorkerInfo], int]:
        # Heartbeats carry Redis's time, so "seen ago" is measured on it too.
        return await q.counts(), await q.workers(), await queue_now_ms(q)

    counts, workers, now = with_queue(target, fetch)
    if not any(counts.values()) and not workers:
        note(
            f"{target.describe()} has no jobs and no workers: it is new, or the queue you mean has "
            "another --queue or --prefix"
        )
    if as_json:
        print_json(
            {"queue": queue, "prefix": prefix, "counts": counts, "workers": [asdict(w) for w in workers]}
        )
        return
    console = stdout()
    console.print(_counts_table(counts, target))
    if workers:
        console.print(_workers_table(workers, now))
    else:
        console.print("no worker has served this queue yet; start one with `sluice worker module:worker`")


#: Counters whose name alone would mislead: they count attempts, or jobs as they died.
_COUNTER_LABELS = {
    "failed": "failed attempts",
    "retried": "retries",
    "stalled": "stalls",
    "dead_total": "dead (ever)",
    "unknown_outcome": "unknown outcomes",
    "overrun": "stopped hard (overran timeout)",
}


def _counts_table(counts: dict[str, int], target: Target) -> RenderableType:
    table = plain_table(target.describe())
    for col in ("jobs now", "", "since the queue began", ""):
        table.add_column(col, justify="right" if not col else "left")
    totals = [*COUNTERS, "dead_total"]
    for i, counter in enumerate(totals):
        live = LIVE[i] if i < len(LIVE) else ""
        table.add_row(
            live,
            f"{counts[live]:,}" if live else "",
            _COUNTER_LABELS.get(counter, counter.replace("_", " ")),
            f"{counts[counter]:,}",
        )
    return table


def _workers_table(workers: list[WorkerInfo], now: int) -> RenderableType:
    table = plain_table("workers")
    table.caption = "last seen: their heartbeat, every lease/3; a stopped worker lingers with an old one"
    for col in ("worker", "concurrency", "handlers", "last seen"):
        table.add_column(col, overflow="fold")
    for w in workers:
        table.add_row(
            escape(w.id),
            str(w.concurrency or "?"),
            escape(", ".join(w.names)),
            relative(w.seen_ms, now),
        )
    return table


def show(
    job_id: JobIdArg,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Everything stored about one job: its state, times, payload, result and full error."""
    print_record(fetch_record(job_id, Target(queue, prefix, redis)), as_json)


def fetch_record(job_id: str, target: Target) -> JobRecord:
    async def fetch(q: Queue) -> JobRecord | None:
        return await q.get_job(job_id)

    record = with_queue(target, fetch)
    if record is None:
        raise CliFailure(explain(JobNotFound(job_id), target))
    return record


def print_record(record: JobRecord, as_json: bool) -> None:
    """The record as JSON (``*_ms`` epoch fields, for programs) or as a readable page."""
    if as_json:
        print_json(record_json(record))
    else:
        stdout().print(record_view(record, now_ms()))


def record_json(r: JobRecord) -> dict[str, Any]:
    """The library's JSON view of a record, with the settings it leaves out."""
    extra = {"timeout": r.timeout, "max_stalls": r.max_stalls, "cancel_requested": r.cancel_requested}
    return r.to_dict() | extra


def record_view(r: JobRecord, now: int) -> RenderableType:
    table = fields_table(f"job {r.id} ({escape(r.name)})")
    state = r.state.value + (" (cancel requested)" if r.cancel_requested else "")
    if r.started_ms is None and not r.state.finished:
        state += f", for {span(now - r.created_ms)}"
    table.add_row("state", state)
    table.add_row("priority", str(r.priority))
    stalls = f"{r.stalls} stalled of at most {r.max_stalls}"
    table.add_row("attempts", f"{r.attempt} of {r.max_attempts} ({r.failures} failed, {stalls})")
    table.add_row("timeout", f"{r.timeout:g} s per attempt" if r.timeout else "the worker's")
    for label, value in _times(r, now):
        table.add_row(label, value)
    if r.worker:
        table.add_row("worker", escape(r.worker))
    for label, value in _ledger(r):
        table.add_row(label, value)
    if r.idempotency_key is not None:
        table.add_row("idempotency key", escape(r.idempotency_key))
    table.add_row("payload", escape(json_text(r.payload)))
    if r.result is not None or r.state == "completed":
        table.add_row("result", escape(json_text(r.result)))
    if not r.error:
        return table
    return Group(table, Text("\nerror:", style="bold red"), Text(r.error.rstrip()))


def _times(r: JobRecord, now: int) -> list[tuple[str, str]]:
    rows = [("created", utc(r.created_ms))]
    if r.due_ms is not None:
        rows.append(("due", f"{utc(r.due_ms)} ({relative(r.due_ms, now)})"))
    if r.started_ms is not None:
        ready = (
            r.due_ms if r.due_ms is not None and r.created_ms <= r.due_ms <= r.started_ms else r.created_ms
        )
        rows.append(("started", f"{utc(r.started_ms)} (waited {span(r.started_ms - ready)})"))
        if r.finished_ms is None and r.state == "active":
            rows.append(("running", f"for {span(now - r.started_ms)}"))
    if r.finished_ms is not None:
        ran = f" (ran {span(r.finished_ms - r.started_ms)})" if r.started_ms is not None else ""
        rows.append(("finished", utc(r.finished_ms) + ran))
    return rows


def _ledger(r: JobRecord) -> list[tuple[str, str]]:
    if not r.tokens and r.budget is None:
        return []
    used = f", {r.usage:,} reported used" if r.usage is not None else ""
    rows = [("tokens", f"{r.tokens:,} estimated{used}")]
    if r.budget is not None:
        rows.append(("budget", f"{r.budget} (when it is full: {r.on_exhausted})"))
    if r.parked_on is not None:
        rows.append(("parked on", f"budget {r.parked_on}, until it has room"))
    if r.reservation is not None:
        rows.append(("reservation", r.reservation))
    if r.attempts_spend or r.spent:
        rows.append(("spent", f"{r.spent:,} tokens charged over its attempts"))
    for a in r.attempts_spend:
        reported = "not reported" if a.reported is None else f"{a.reported:,} reported"
        rows.append(
            (
                f"  {a.reservation}",
                f"{a.charged:,} charged: {a.estimate:,} reserved, {reported} ({a.outcome})",
            )
        )
    return rows
