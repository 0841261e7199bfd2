"""The dead-letter queue: ``sluice dlq list | show | redrive | purge``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from sluice.cli.jobs_cmd import fetch_record, job_id_check, job_ids, print_record, record_json
from sluice.cli.options import JsonOpt, PrefixOpt, QueueOpt, RedisOpt, Target
from sluice.cli.output import note, plain_table, print_json, stdout, utc
from sluice.cli.parsing import SluiceCommand
from sluice.cli.runtime import with_queue
from sluice.engine import JobRecord, JobState, Queue
from sluice.settings import DEFAULT_PREFIX, DEFAULT_QUEUE

dlq_app = typer.Typer(
    help="The dead-letter queue: jobs that failed for good, to inspect, run again or delete.",
    no_args_is_help=True,
)

DeadIdArg = Annotated[
    str, typer.Argument(callback=job_id_check, help="Id of the dead job.", show_default=False)
]
IdsArg = Annotated[
    list[str] | None,
    typer.Argument(callback=job_ids, help="Job ids (default: every dead job).", show_default=False),
]


@dlq_app.command("list", cls=SluiceCommand)
def dlq_list(
    as_json: JsonOpt = False,
    limit: Annotated[int, typer.Option(min=1, help="Show at most this many.")] = 50,
    offset: Annotated[int, typer.Option(min=0, help="Skip this many of the oldest first.")] = 0,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Dead jobs, oldest first, with the first line of their last error."""
    target = Target(queue, prefix, redis)

    async def fetch(q: Queue) -> tuple[list[JobRecord], int]:
        return await q.dead_letters(offset=offset, limit=limit), (await q.counts())["dead"]

    records, total = with_queue(target, fetch)
    if as_json:
        print_json([record_json(r) for r in records])
        return
    table = plain_table(f"dead-letter queue of {target.describe()}: {total:,} job(s)")
    for col in ("id", "name", "attempts", "died", "error"):
        table.add_column(col, overflow="fold")
    for r in records:
        first = r.error.splitlines()[0] if r.error else ""
        table.add_row(
            r.id, escape(r.name), str(r.attempt), utc(r.finished_ms, seconds_only=True), escape(first)
        )
    stdout().print(table)
    if offset + len(records) < total:
        note(f"showing {len(records)} of {total:,}; see more with --offset {offset + len(records)}")


@dlq_app.command("show", cls=SluiceCommand)
def dlq_show(
    job_id: DeadIdArg,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """One dead job, with its full error and traceback."""
    record = fetch_record(job_id, Target(queue, prefix, redis))
    if record.state is not JobState.DEAD:
        note(f"job {job_id} is {record.state.value}, not dead")
    print_record(record, as_json)


@dlq_app.command("redrive", cls=SluiceCommand)
def dlq_redrive(
    job_ids: IdsArg = None,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Move dead jobs back to waiting, with their attempts reset."""

    async def redrive(q: Queue) -> int:
        return await q.redrive(job_ids or None)

    stdout().print(f"redrove {with_queue(Target(queue, prefix, redis), redrive)} job(s)")


@dlq_app.command("purge", cls=SluiceCommand)
def dlq_purge(
    job_ids: IdsArg = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before deleting them all.")] = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Delete dead jobs for good."""
    target = Target(queue, prefix, redis)
    if not job_ids and not yes:
        typer.confirm(f"Delete every dead job of {target.describe()}?", abort=True)

    async def purge(q: Queue) -> int:
        return await q.purge_dead(job_ids or None)

    stdout().print(f"purged {with_queue(target, purge)} job(s)")
