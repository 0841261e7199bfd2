"""Failure analysis from the terminal: ``sluice failures patterns | show | analyze``.

What ``/v1/failures`` answers over HTTP, read from the service's database
(``--database`` / ``SLUICE_DATABASE_URL``, as ``sluice keys``): the patterns
of a tenant's jobs that ended badly, each with its category and what to do,
and the LLM analysis, which ``analyze`` asks for as a job on the service's
queue under the analysis budget. The service's modules are imported inside
the commands: the rest of the command line works without the ``service``
extra.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.markup import escape

from sluice.cli.errors import CliFailure
from sluice.cli.options import JsonOpt, PrefixOpt, QueueOpt, RedisOpt, Target, at_least, budget_name
from sluice.cli.output import fields_table, note, plain_table, print_json, stdout, utc
from sluice.cli.parsing import SluiceCommand
from sluice.cli.runtime import with_queue
from sluice.cli.serve_cmd import DatabaseOpt, _database, _database_url, _db_failure, _service_modules
from sluice.settings import DEFAULT_PREFIX

if TYPE_CHECKING:
    from datetime import datetime

    from sluice.engine import Queue
    from sluice.llm.analysis import AnalysisRequest
    from sluice.store.database import Database
    from sluice.store.job import StoredJob
    from sluice.store.patterns import Pattern

T = TypeVar("T")

#: The tenant of the service's own jobs without authentication (``sluice dev``).
DEFAULT_TENANT = "default"
#: The variables the service reads for the analysis (read here for the same meaning).
ENV_PROVIDERS = ("SLUICE_LLM_PROVIDER", "AI_PROVIDER")
ENV_MODELS = ("SLUICE_LLM_MODEL", "AI_MODEL")
ENV_BUDGET = "SLUICE_ANALYSIS_BUDGET"
ENV_BUDGET_TOKENS = "SLUICE_ANALYSIS_BUDGET_TOKENS"

failures_app = typer.Typer(
    help=(
        "Failure analysis: the service's jobs that ended badly, grouped into patterns, classified "
        "by rules (with what to do), and explained by an LLM on request."
    ),
    no_args_is_help=True,
)

TenantOpt = Annotated[str, typer.Option("--tenant", "-t", help="The tenant whose patterns to read.")]
PatternArg = Annotated[
    str, typer.Argument(help="The pattern's id (sluice failures patterns).", show_default=False)
]


def _first(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def _pattern_json(p: Pattern) -> dict[str, Any]:
    from sluice.service.routes_failures import pattern_out

    out: dict[str, Any] = pattern_out(p).model_dump(mode="json")
    return out


def _run_db(url: str, work: Callable[[Database], Awaitable[T]]) -> T:
    """``work(db)`` on the migrated database, closed after; failures as one line."""

    async def run() -> T:
        db = await _database(url)
        try:
            return await work(db)
        finally:
            await db.close()

    try:
        return asyncio.run(run())
    except CliFailure:
        raise
    except Exception as exc:
        raise _db_failure(url, exc) from exc


@failures_app.command("patterns", cls=SluiceCommand)
def failures_patterns(
    tenant: TenantOpt = DEFAULT_TENANT,
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="Only this queue's patterns.")] = None,
    category: Annotated[
        str | None,
        typer.Option(
            help="Only this category: throttle, budget, configuration, transient, permanent, unknown."
        ),
    ] = None,
    sort: Annotated[
        str, typer.Option(help="count (most frequent first) or last_seen (most recent).")
    ] = "count",
    limit: Annotated[
        int,
        typer.Option(
            callback=at_least(1, "--limit must be from 1 to 500", 500), help="Show at most this many."
        ),
    ] = 50,
    collect: Annotated[
        bool,
        typer.Option(
            "--collect", help="Count the latest failures first (a pass of the collector the service runs)."
        ),
    ] = False,
    database: DatabaseOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A tenant's failure patterns, with counts, first and last seen, category and analysis."""
    _service_modules()
    from sluice.store.categories import Category
    from sluice.store.collector import PatternCollector
    from sluice.store.patterns import SORTS, PatternStore

    if sort not in SORTS:
        raise typer.BadParameter(f"use one of {', '.join(SORTS)}, got {sort!r}", param_hint="--sort")
    if category is not None and category not in {c.value for c in Category}:
        raise typer.BadParameter(
            f"use one of {', '.join(c.value for c in Category)}, got {category!r}", param_hint="--category"
        )
    url = _database_url(database)

    async def work(db: Database) -> list[Pattern]:
        if collect:
            collector = PatternCollector(db, settle=0.0, pages=1_000)
            await collector.collect()
        return await PatternStore(db).list_patterns(
            tenant, queue=queue, category=category, sort=sort, limit=limit
        )

    found = _run_db(url, work)
    if as_json:
        print_json([_pattern_json(p) for p in found])
        return
    table = plain_table(f"failure patterns of tenant {escape(tenant)}: {len(found)}")
    for col in ("id", "category", "count", "last seen", "job type", "error", "message", "analysis"):
        table.add_column(col, overflow="fold")
    for p in found:
        table.add_row(
            p.id,
            p.category,
            f"{p.count:,}",
            utc(int(p.last_seen.timestamp() * 1000), seconds_only=True),
            escape(p.job_type),
            escape(p.error_type),
            escape(p.message),
            p.analysis_state,
        )
    stdout().print(table)
    if not found:
        note("no patterns yet: the service counts failures every 30 s (or pass --collect)")


@failures_app.command("show", cls=SluiceCommand)
def failures_show(
    pattern_id: PatternArg,
    tenant: TenantOpt = DEFAULT_TENANT,
    jobs: Annotated[
        int,
        typer.Option(callback=at_least(0, "--jobs must be from 0 to 500", 500), help="Latest jobs to list."),
    ] = 5,
    database: DatabaseOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One pattern: its category and what to do, its counts, a sample error, the LLM analysis,
    and its latest jobs."""
    _service_modules()
    from sluice.store.patterns import PatternStore

    url = _database_url(database)

    async def work(db: Database) -> tuple[Pattern | None, list[tuple[StoredJob, datetime]]]:
        store = PatternStore(db)
        found = await store.get(tenant, pattern_id)
        if found is None or jobs == 0:
            return found, []
        return found, (await store.jobs(tenant, found.queue, pattern_id, limit=jobs)).jobs

    found, latest = _run_db(url, work)
    if found is None:
        raise CliFailure(
            f"no failure pattern {pattern_id!r} of tenant {tenant}; `sluice failures patterns` lists them"
        )
    if as_json:
        print_json(
            _pattern_json(found)
            | {"jobs": [{"id": str(j.id), "status": j.status, "dead_at": at.isoformat()} for j, at in latest]}
        )
        return
    table = fields_table(f"failure pattern {found.id}")
    rows = [
        ("category", found.category),
        ("advice", found.advice),
        ("queue", found.queue),
        ("job type", found.job_type),
        ("error type", found.error_type),
        ("message", found.message),
        ("count", f"{found.count:,}"),
        ("first seen", utc(int(found.first_seen.timestamp() * 1000))),
        ("last seen", utc(int(found.last_seen.timestamp() * 1000))),
        ("sample job", str(found.sample_job) if found.sample_job else "-"),
        ("analysis", found.analysis_state + (f" (job {found.analysis_job})" if found.analysis_job else "")),
    ]
    if found.analysis is not None:
        rows += [
            ("root cause", str(found.analysis.get("root_cause", ""))),
            ("fix", str(found.analysis.get("fix", ""))),
            ("model", str(found.analysis.get("model") or "-")),
        ]
    if found.analysis_error:
        rows.append(("analysis error", found.analysis_error))
    for label, value in rows:
        table.add_row(label, escape(value))
    table.add_row("sample error", escape(found.sample_error or "-"))
    for job, at in latest:
        table.add_row("job", f"{job.id} {job.status} {utc(int(at.timestamp() * 1000), seconds_only=True)}")
    stdout().print(table)


@failures_app.command("analyze", cls=SluiceCommand)
def failures_analyze(
    pattern_id: PatternArg,
    tenant: TenantOpt = DEFAULT_TENANT,
    refresh: Annotated[
        bool, typer.Option("--refresh", help="Ask again though an analysis is cached (once per day).")
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            help="The model the worker asks (default $SLUICE_LLM_MODEL or $AI_MODEL).", show_default=False
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option(
            callback=budget_name,
            help=f"The budget it spends from (default ${ENV_BUDGET}, else failure-analysis).",
            show_default=False,
        ),
    ] = None,
    budget_tokens: Annotated[
        int | None,
        typer.Option(
            callback=at_least(1, "--budget-tokens must be 1 or more"),
            help=f"Daily limit of that budget if it is made (default ${ENV_BUDGET_TOKENS}, else 200000).",
            show_default=False,
        ),
    ] = None,
    database: DatabaseOpt = None,
    queue: QueueOpt = "jobs",
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Ask an LLM to explain a pattern: a failure-analysis job on the service's queue, under the
    analysis budget (made with a daily window if missing). Run workers with the handler
    (sluice.llm.analysis.register_analysis) and an AI provider configured."""
    _service_modules()
    from sluice.llm.analysis import DEFAULT_BUDGET, DEFAULT_BUDGET_TOKENS, request_analysis
    from sluice.service.config import EVENTS_MAXLEN
    from sluice.service.submit import Intake
    from sluice.store.jobs import JobStore
    from sluice.store.ledger import BudgetLedger
    from sluice.store.patterns import PatternStore

    if _first(ENV_PROVIDERS) is None:
        raise CliFailure(
            "no AI provider is configured: set SLUICE_LLM_PROVIDER (or AI_PROVIDER), here as on the workers "
            "that run the analysis; the rule-based analysis (sluice failures show) needs none"
        )
    url = _database_url(database)
    name = budget or os.environ.get(ENV_BUDGET) or DEFAULT_BUDGET
    try:
        tokens = budget_tokens or int(os.environ.get(ENV_BUDGET_TOKENS) or DEFAULT_BUDGET_TOKENS)
    except ValueError:
        raise CliFailure(f"{ENV_BUDGET_TOKENS} must be a whole number of tokens") from None
    target = Target(queue, prefix, redis)

    async def ask(q: Queue) -> AnalysisRequest | None:
        from sluice.engine import Queue as EngineQueue

        # The service's stream length: adding with the engine's default would trim events the
        # service's sink has not read yet.
        service_queue = EngineQueue(q.name, redis=q.redis, prefix=prefix, events_maxlen=EVENTS_MAXLEN)
        try:
            db = await _database(url)
        except Exception as exc:
            raise _db_failure(url, exc) from exc
        try:
            patterns = PatternStore(db)
            found = await patterns.get(tenant, pattern_id)
            if found is None:
                return None
            intake = Intake(
                service_queue, JobStore(db), BudgetLedger(service_queue, db), analysis_budget=name
            )
            try:
                return await request_analysis(
                    patterns,
                    service_queue,
                    found,
                    intake.submit_analysis,
                    budget=name,
                    budget_tokens=tokens,
                    provider=_first(ENV_PROVIDERS),
                    model=model or _first(ENV_MODELS),
                    refresh=refresh,
                )
            finally:
                await intake.close()
        finally:
            await db.close()

    asked = with_queue(target, ask)
    if asked is None:
        raise CliFailure(
            f"no failure pattern {pattern_id!r} of tenant {tenant}; `sluice failures patterns` lists them"
        )
    if as_json:
        print_json(
            {
                "pattern_id": pattern_id,
                "state": asked.state,
                "job_id": str(asked.job_id) if asked.job_id else None,
                "analysis": asked.analysis,
            }
        )
        return
    if asked.state == "done" and asked.analysis is not None:
        stdout().print(f"root cause: {escape(str(asked.analysis.get('root_cause', '')))}")
        stdout().print(f"fix: {escape(str(asked.analysis.get('fix', '')))}")
        return
    made = "enqueued" if asked.created else "already pending"
    stdout().print(f"analysis job {asked.job_id} {made} under budget {escape(name)}")
    note(f"see it with: sluice failures show {pattern_id} --tenant {tenant}")
