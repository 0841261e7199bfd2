"""The root error handler: one line per failure, in the CLI's words, and exit code 1.

A failing command prints ``error: <what failed; how to fix it>`` on stderr,
not a traceback: an unreachable Redis used to give a screen of redis-py
internals. Library errors are worded as the commands and options that fix
them (``sluice budget credit``, ``--on-exhausted wait``), never as the
Python calls the library's own messages name. Any other exception is a bug
of ours and says so. ``--debug`` or ``SLUICE_DEBUG=1`` prints the traceback
instead. Usage errors stay click's (exit code 2).

The handler sits in :class:`SluiceGroup.invoke`, which every command of the
``sluice`` group runs inside, so it works the same under ``python -m sluice``
and under ``typer.testing.CliRunner``, and covers every subcommand.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from typer._click.exceptions import ClickException
from typer.core import TyperGroup

from sluice.cli.options import Target
from sluice.errors import (
    BudgetExists,
    BudgetNotFound,
    CorruptJobError,
    JobFailed,
    JobNotFound,
    JobRejected,
    OutcomeUnknown,
    ResultTimeout,
    SluiceError,
)
from sluice.settings import Settings

if TYPE_CHECKING:
    from typer._click.core import Context

#: The root option that turns tracebacks on (``sluice --debug``), by its parameter name.
DEBUG_PARAM = "debug"

_REFUSING_BUDGET = re.compile(r"^budget (\S+) cannot admit")


class CliFailure(Exception):
    """A command failed; the message is already in the CLI's words (one line, exit code 1)."""


def one_line(text: str) -> str:
    return " ".join(text.split())


def explain(exc: SluiceError, where: Target | None = None) -> str:
    """A library error worded for the command line: what failed and which command fixes it."""
    for kind, word in _WORDING:
        if isinstance(exc, kind):
            return word(exc, where or Target())
    return one_line(str(exc))


def _budget_exists(exc: BudgetExists, where: Target) -> str:
    name, flags = exc.name, where.flags()
    return (
        f"budget {name!r} exists already in {where.describe()}; change it with "
        f"`sluice budget adjust {name} N{flags}` (every window) or `sluice budget credit {name} N{flags}` "
        "(this window only)"
    )


def _budget_not_found(exc: BudgetNotFound, where: Target) -> str:
    name, flags = exc.name, where.flags()
    return (
        f"no budget named {name!r} in {where.describe()}; create it with "
        f"`sluice budget create {name} LIMIT{flags}` (`sluice budget list{flags}` shows the others)"
    )


def _job_not_found(exc: JobNotFound, where: Target) -> str:
    return (
        f"no job {exc.job_id} in {where.describe()}: it never existed or its record expired (finished "
        "jobs are kept for a day); check --queue and --prefix"
    )


def _outcome_unknown(exc: OutcomeUnknown, where: Target) -> str:
    return (
        f"Redis at {exc.url}: the connection broke after the change was sent ({exc.reason}), so it "
        f"may or may not have been applied; look before repeating it (`sluice info{where.flags()}`, "
        "`sluice show ID`); `sluice enqueue` is safe to repeat with --idempotency-key"
    )


def _job_failed(exc: JobFailed, where: Target) -> str:
    first = exc.error.splitlines()[0] if exc.error else "no error recorded"
    again = f"{exc.job_id}{where.flags()}"
    return (
        f"job {exc.job_id} failed and is in the dead-letter queue: {first}; see "
        f"`sluice dlq show {again}`, fix the cause, then `sluice dlq redrive {again}`"
    )


def _result_timeout(exc: ResultTimeout, where: Target) -> str:
    flags = where.flags()
    if exc.state == "parked":
        return (
            f"job {exc.job_id} has no result yet: it is parked, waiting for room in its budget, and "
            f"goes on; credit the budget (`sluice budget credit`) or wait for its window to turn "
            f"(`sluice budget list{flags}` shows when)"
        )
    return (
        f"job {exc.job_id} has no result yet (it is {exc.state or 'unknown'}) and goes on; wait longer "
        f"(--wait), follow it with `sluice show {exc.job_id}{flags}`, and check that a worker serves "
        f"{where.describe()} (`sluice info{flags}`)"
    )


def _corrupt_job(exc: CorruptJobError, where: Target) -> str:
    return (
        f"job {exc.job_id} in {where.describe()} cannot be read ({exc.problem}): another program or an "
        "incompatible Sluice version wrote it; if another application shares this Redis, give each its "
        "own --prefix"
    )


def rejection(exc: JobRejected, where: Target, budget: str | None = None) -> str:
    """Why a budget refused a job, and which command gets it through next time."""
    flags = where.flags()
    if exc.reason.startswith("no budget named"):
        advice = f"create it with `sluice budget create NAME LIMIT{flags}` and enqueue the job again"
    elif exc.reason.startswith("token estimate"):
        advice = f"lower --tokens, or raise the limit with `sluice flow set --tokens N/SECONDS{flags}`"
    else:
        found = _REFUSING_BUDGET.match(exc.reason)
        name = found.group(1) if found else budget or "BUDGET"
        advice = (
            f"credit it with `sluice budget credit {name} N{flags}` or wait for its window to turn "
            f"(`sluice budget list{flags}`), then enqueue again; with --on-exhausted wait a job waits "
            "for room instead"
        )
    return f"job {exc.job_id} was rejected: {exc.reason}; {advice}"


#: Library errors worded for the CLI, most specific first; any other keeps its own message.
_WORDING: tuple[tuple[type[SluiceError], Callable[[Any, Target], str]], ...] = (
    (BudgetExists, _budget_exists),
    (BudgetNotFound, _budget_not_found),
    (JobNotFound, _job_not_found),
    (OutcomeUnknown, _outcome_unknown),
    (JobRejected, rejection),
    (JobFailed, _job_failed),
    (ResultTimeout, _result_timeout),
    (CorruptJobError, _corrupt_job),
)


def debug_flag(ctx: Context) -> bool:
    """--debug was on the command line (anywhere: see :meth:`SluiceGroup.parse_args`)."""
    root = ctx.find_root()
    return bool(root.params.get(DEBUG_PARAM) or root.meta.get(DEBUG_PARAM))


def debug_enabled(ctx: Context) -> bool:
    """--debug on the command line, or SLUICE_DEBUG=1 (a bad value of it counts as off)."""
    if debug_flag(ctx):
        return True
    try:
        return Settings.from_env().debug
    except SluiceError:
        return False


def _framework(exc: Exception) -> bool:
    """Exceptions that click handles itself: usage errors (exit 2), Exit, Abort, a closed pipe."""
    return isinstance(exc, ClickException | typer.Exit | typer.Abort | BrokenPipeError)


def _message(exc: Exception) -> str:
    if isinstance(exc, CliFailure):
        return one_line(str(exc))
    if isinstance(exc, SluiceError):
        return explain(exc)
    text = one_line(f"{type(exc).__name__}: {exc}")
    return f"internal error: {text}; run again with --debug and report it"


class SluiceGroup(TyperGroup):
    """The ``sluice`` group: runs every command inside the one error handler."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        """Take --debug anywhere before a ``--``: "run again with --debug" reads as "add it at
        the end" as much as "put it after sluice", and both should work."""
        end = args.index("--") if "--" in args else len(args)
        if "--debug" in args[:end]:
            ctx.meta[DEBUG_PARAM] = True
            args = [arg for i, arg in enumerate(args) if i >= end or arg != "--debug"]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            if _framework(exc):
                raise
            if debug_enabled(ctx):
                traceback.print_exc(file=sys.stderr)
            else:
                typer.echo(f"{typer.style('error:', fg='red', bold=True)} {_message(exc)}", err=True)
            raise typer.Exit(1) from None
