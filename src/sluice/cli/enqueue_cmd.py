"""``sluice enqueue``: add one job, or many from a JSON Lines file, and optionally wait for a result."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import orjson
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sluice import tracing
from sluice.cli.errors import CliFailure, rejection
from sluice.cli.jobfile import Line, read_jobs, who
from sluice.cli.options import JsonOpt, PrefixOpt, QueueOpt, RedisOpt, Target, at_least, budget_name
from sluice.cli.output import json_text, print_json, stderr, stdout, warn
from sluice.cli.runtime import with_queue
from sluice.engine import MAX_PRIORITY, Job, JobSpec, Queue
from sluice.engine.job import MAX_ATTEMPTS, MAX_TOKENS
from sluice.engine.queue import BULK_CHUNK
from sluice.errors import BudgetNotFound, InvalidJobError, JobRejected
from sluice.settings import DEFAULT_MAX_STALLS, DEFAULT_PREFIX, DEFAULT_QUEUE, Settings

#: Files of more jobs than this show a progress bar while they are added.
PROGRESS_FROM = 10 * BULK_CHUNK


class OnExhausted(enum.StrEnum):
    reject = "reject"
    wait = "wait"


def enqueue(
    name: Annotated[
        str | None, typer.Argument(help="Job name: the handler that runs it. Leave out with --file.")
    ] = None,
    payload: Annotated[
        str | None,
        typer.Argument(
            help='Payload as JSON, e.g. \'{"text": "hi"}\' (quote it for your shell) \\[default: null].'
        ),
    ] = None,
    as_json: JsonOpt = False,
    file: Annotated[
        typer.FileText | None,
        typer.Option(
            "--file",
            "-f",
            metavar="FILE",
            help="Add the jobs of a JSON Lines file (- reads stdin): one object per line with name and "
            "optionally payload, priority, tokens, budget, on_exhausted, idempotency_key, delay, "
            "max_attempts, timeout, max_stalls; the options below fill in what a line leaves out. "
            "Every line is checked before any job is added.",
            show_default=False,
        ),
    ] = None,
    priority: Annotated[
        int, typer.Option(min=0, max=MAX_PRIORITY, help="0 runs first; first in, first out within one.")
    ] = 0,
    delay: Annotated[float, typer.Option(min=0, help="Seconds before it may run.")] = 0.0,
    max_attempts: Annotated[
        int, typer.Option(min=1, max=MAX_ATTEMPTS, help="Tries before the dead-letter queue (1: no retry).")
    ] = 3,
    timeout: Annotated[
        float | None,
        typer.Option(
            callback=at_least(0.001, "the timeout must be more than 0 seconds"),
            help="Seconds one attempt may run \\[default: the worker's].",
            show_default=False,
        ),
    ] = None,
    max_stalls: Annotated[
        int,
        typer.Option(
            min=0, max=MAX_ATTEMPTS, help="Times its worker may die under it before it is dead-lettered."
        ),
    ] = DEFAULT_MAX_STALLS,
    tokens: Annotated[
        int,
        typer.Option(
            min=0,
            max=MAX_TOKENS,
            help="Token estimate (prompt + most output), reserved from --budget and the token-rate "
            "limit when it starts, corrected by the usage its handler reports.",
        ),
    ] = 0,
    budget: Annotated[
        str | None,
        typer.Option(callback=budget_name, help="The budget it spends from (`sluice budget list`)."),
    ] = None,
    on_exhausted: Annotated[
        OnExhausted,
        typer.Option(help="When its budget cannot admit --tokens: reject the job, or wait for room."),
    ] = OnExhausted.reject,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Adding a job with the same key again returns the first one.")
    ] = None,
    job_id: Annotated[
        str | None,
        typer.Option(
            "--id",
            help="The job's id (not all digits); adding it again returns the first job. "
            "Default: the queue's next number.",
            show_default=False,
        ),
    ] = None,
    wait: Annotated[
        float | None,
        typer.Option(
            min=0, help="Wait up to this many seconds for its result, and print it.", show_default=False
        ),
    ] = None,
    any_name: Annotated[
        bool, typer.Option("--any-name", help="Add it even if no worker of the queue serves that name.")
    ] = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Add a job (or a file of jobs) to the queue; with --wait, print its result."""
    target = Target(queue, prefix, redis)
    options: dict[str, Any] = {
        "priority": priority,
        "delay": delay,
        "max_attempts": max_attempts,
        "timeout": timeout,
        "max_stalls": max_stalls,
        "tokens": tokens,
        "budget": budget,
        "on_exhausted": on_exhausted.value,
    }
    if file is not None:
        if any(v is not None for v in (name, payload, idempotency_key, job_id, wait)):
            raise typer.BadParameter(
                "with --file, give no NAME, PAYLOAD, --idempotency-key, --id or --wait: each line is a job",
                param_hint="--file",
            )
        source = "stdin" if file.name == "<stdin>" else file.name
        jobs = read_jobs(file, source, options)
    else:
        source = "the command line"
        jobs = [Line(0, _one(name, payload, idempotency_key, options | {"job_id": job_id}))]
    tracing.configure(Settings.from_env())
    added, result = with_queue(target, lambda q: _add(q, target, jobs, source, any_name, wait, as_json))
    if as_json:
        new = sum(job.created for job in added)
        data: dict[str, Any] = {"ids": [j.id for j in added], "added": new, "existing": len(added) - new}
        print_json(data | ({"result": result} if wait is not None else {}))
    elif wait is None:
        _say_added(added, target)
    else:
        stdout().print(json_text(result), soft_wrap=True)


def _one(name: str | None, payload: str | None, key: str | None, options: dict[str, Any]) -> JobSpec:
    if name is None:
        raise typer.BadParameter("give the job's NAME (or --file with one job per line)", param_hint="NAME")
    try:
        data = orjson.loads(payload) if payload is not None else None
    except orjson.JSONDecodeError as exc:
        raise typer.BadParameter(
            f'not valid JSON ({exc}); quote it for your shell, e.g. \'{{"text": "hi"}}\'',
            param_hint="PAYLOAD",
        ) from None
    try:
        return JobSpec(name, data, idempotency_key=key, **options)
    except InvalidJobError as exc:
        raise CliFailure(str(exc)) from exc


async def _add(
    q: Queue, target: Target, jobs: list[Line], source: str, any_name: bool, wait: float | None, as_json: bool
) -> tuple[list[Job], Any]:
    await _check_names(q, target, jobs, source, any_name)
    specs = [j.spec for j in jobs]
    try:
        added = await _add_all(q, specs)
    except BudgetNotFound as exc:
        missing = exc.name
        raise CliFailure(
            f"{who(jobs, source, lambda s: s.budget == missing)} names budget {missing!r}, which does not "
            f"exist in {target.describe()}; nothing was added. Create it with `sluice budget create "
            f"{missing} LIMIT{target.flags()}`, or enqueue without that budget"
        ) from exc
    if wait is None:
        return added, None
    if not as_json:
        _say_added(added, target, waiting=True)
    try:
        return added, await added[0].result(timeout=wait)
    except JobRejected as exc:
        raise CliFailure(rejection(exc, target, specs[0].budget)) from exc


async def _check_names(q: Queue, target: Target, jobs: list[Line], source: str, any_name: bool) -> None:
    """Refuse names no worker of the queue serves: such a job would only be dead-lettered later."""
    if any_name:
        return
    workers = await q.workers()
    if not workers:
        warn(
            f"no worker has served {target.describe()} yet, so the job name could not be checked "
            "against its handlers"
        )
        return
    served = set().union(*(w.names for w in workers))
    unknown = sorted({j.spec.name for j in jobs} - served)
    if unknown:
        first = unknown[0]
        more = f" (and {len(unknown) - 1} more unknown name(s))" if len(unknown) > 1 else ""
        place = who(jobs, source, lambda s: s.name == first, default="")
        raise CliFailure(
            f"{place + ': ' if place else ''}no worker of {target.describe()} serves jobs named {first!r}"
            f"{more}; they serve {', '.join(sorted(served)) or 'nothing'}. Check the name, or add it anyway "
            "with --any-name (a worker without that handler dead-letters it)"
        )


async def _add_all(q: Queue, specs: list[JobSpec]) -> list[Job]:
    """One add_bulk call (all or nothing), with a progress bar for a large file."""
    if len(specs) <= PROGRESS_FROM:
        return await q.add_bulk(specs)
    console = stderr()
    columns = (TextColumn("adding jobs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("add", total=len(specs))
        return await q.add_bulk(specs, progress=lambda done: bar.update(task, completed=done))


def _say_added(added: list[Job], target: Target, waiting: bool = False) -> None:
    new = sum(job.created for job in added)
    if len(added) == 1:
        job = added[0]
        state = "added to" if job.created else "already existed (same id or idempotency key) in"
        text = f"job {job.id} {state} {target.describe()}" + ("; waiting for its result" if waiting else "")
    else:
        existing = (
            f"; {len(added) - new:,} already existed (same id or idempotency key)" if new < len(added) else ""
        )
        text = f"added {new:,} job(s) to {target.describe()}{existing}"
    # With --wait the result is the output, on stdout alone; the note goes to stderr.
    (stderr() if waiting else stdout()).print(text, soft_wrap=True)
