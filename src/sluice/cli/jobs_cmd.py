"""Looking at and changing jobs: ``info``, ``enqueue``, ``show`` and ``dlq``."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console
from rich.table import Table

from sluice.cli.runtime import run
from sluice.cli.server import ENV_URL, redis_url
from sluice.engine import JobRecord, JobSpec, Queue
from sluice.engine.clock import now_ms
from sluice.engine.connection import connect
from sluice.errors import SluiceError

console = Console()
err = Console(stderr=True)

QueueOpt = Annotated[str, typer.Option("--queue", "-q", help="Queue name.")]
RedisOpt = Annotated[str | None, typer.Option(help=f"Redis URL (default ${ENV_URL}, else embedded).")]


def _with_queue(redis: str | None, name: str, fn: Any) -> Any:
    async def go(url: str) -> Any:
        client = connect(url)
        try:
            return await fn(Queue(name, redis=client))
        finally:
            await client.aclose()

    try:
        with redis_url(redis, err) as url:
            return run(go(url))
    except SluiceError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None


def info(queue: QueueOpt = "default", redis: RedisOpt = None) -> None:
    """Counts of the queue's jobs per state, and its live workers."""

    async def go(q: Queue) -> None:
        counts = await q.counts()
        workers: Any = await q.redis.hgetall(q.keys.workers)
        table = Table(title=f"queue {q.name}")
        table.add_column("count")
        table.add_column("value", justify="right")
        for key, value in counts.items():
            table.add_row(key, f"{value:,}")
        console.print(table)
        if workers:
            table = Table(title="workers (heartbeat every lease/3; crashed ones linger until cleared)")
            for col in ("worker", "concurrency", "handlers", "last seen"):
                table.add_column(col)
            now = now_ms()
            for wid, beat in sorted(workers.items()):
                data = orjson.loads(beat)
                age = (now - int(data.get("seen_ms", 0))) / 1000
                table.add_row(
                    wid.decode(),
                    str(data.get("concurrency")),
                    ", ".join(data.get("names", [])),
                    f"{age:.0f} s ago",
                )
            console.print(table)

    _with_queue(redis, queue, go)


def enqueue(
    name: Annotated[str, typer.Argument(help="Job (handler) name.")],
    payload: Annotated[str, typer.Argument(help='Payload as JSON, e.g. \'{"text": "hi"}\'.')] = "null",
    queue: QueueOpt = "default",
    priority: Annotated[int, typer.Option(help="0 runs first.")] = 0,
    delay: Annotated[float, typer.Option(help="Seconds before it may run.")] = 0.0,
    max_attempts: Annotated[int, typer.Option(help="Tries before the dead-letter queue.")] = 3,
    idempotency_key: Annotated[str | None, typer.Option(help="Adding the same key twice adds once.")] = None,
    wait: Annotated[float | None, typer.Option(help="Wait this many seconds for the result.")] = None,
    redis: RedisOpt = None,
) -> None:
    """Add one job (and optionally wait for its result)."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        err.print(f"[red]error:[/red] payload is not valid JSON ({exc}); quote it for your shell")
        raise typer.Exit(2) from None

    async def go(q: Queue) -> None:
        spec = JobSpec(
            name,
            data,
            priority=priority,
            delay=delay,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
        )
        job = (await q.add_bulk([spec]))[0]
        console.print(f"job {job.id} {'added' if job.created else 'already existed (idempotency key)'}")
        if wait is not None:
            console.print_json(orjson.dumps(await job.result(timeout=wait)).decode())

    _with_queue(redis, queue, go)


def _time(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _record_table(record: JobRecord) -> Table:
    table = Table(title=f"job {record.id}", show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")
    for key, value in record.to_dict().items():
        text = (
            _time(value)
            if key.endswith("_ms")
            else (orjson.dumps(value).decode() if key in ("payload", "result") else str(value))
        )
        table.add_row(key, text)
    return table


def show(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    queue: QueueOpt = "default",
    redis: RedisOpt = None,
) -> None:
    """Everything stored about one job."""

    async def go(q: Queue) -> None:
        record = await q.get_job(job_id)
        if record is None:
            err.print(f"no job {job_id} in queue {q.name} (never existed, or expired)")
            raise typer.Exit(1)
        console.print(_record_table(record))

    _with_queue(redis, queue, go)


dlq_app = typer.Typer(help="The dead-letter queue: jobs that failed for good.", no_args_is_help=True)


@dlq_app.command("list")
def dlq_list(queue: QueueOpt = "default", limit: int = 50, redis: RedisOpt = None) -> None:
    """Dead jobs, oldest first, with their last error."""

    async def go(q: Queue) -> None:
        table = Table(title=f"dead-letter queue of {q.name}")
        for col in ("id", "name", "attempts", "died", "error"):
            table.add_column(col, overflow="fold")
        for r in await q.dead_letters(limit=limit):
            table.add_row(
                r.id,
                r.name,
                str(r.attempt),
                _time(r.finished_ms),
                (r.error or "").splitlines()[0] if r.error else "",
            )
        console.print(table)

    _with_queue(redis, queue, go)


@dlq_app.command("show")
def dlq_show(job_id: str, queue: QueueOpt = "default", redis: RedisOpt = None) -> None:
    """One dead job, with its full error and traceback."""
    show(job_id, queue, redis)


@dlq_app.command("redrive")
def dlq_redrive(
    job_ids: Annotated[list[str] | None, typer.Argument(help="Ids to redrive (default: all).")] = None,
    queue: QueueOpt = "default",
    redis: RedisOpt = None,
) -> None:
    """Move dead jobs back to waiting with fresh attempts."""

    async def go(q: Queue) -> None:
        console.print(f"redrove {await q.redrive(job_ids or None)} job(s)")

    _with_queue(redis, queue, go)


@dlq_app.command("purge")
def dlq_purge(
    job_ids: Annotated[list[str] | None, typer.Argument(help="Ids to delete (default: all).")] = None,
    queue: QueueOpt = "default",
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask before deleting all.")] = False,
    redis: RedisOpt = None,
) -> None:
    """Delete dead jobs for good."""
    if not job_ids and not yes:
        typer.confirm(f"Delete every dead job of queue {queue}?", abort=True)

    async def go(q: Queue) -> None:
        console.print(f"purged {await q.purge_dead(job_ids or None)} job(s)")

    _with_queue(redis, queue, go)
