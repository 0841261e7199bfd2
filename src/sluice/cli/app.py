"""The ``sluice`` command line: the root group, its options and its commands."""

from __future__ import annotations

import signal
from typing import Annotated

import typer
from rich.markup import escape

import sluice
from sluice import logs
from sluice.cli import (
    budget_cmd,
    demo,
    dev_cmd,
    dlq_cmd,
    enqueue_cmd,
    failures_cmd,
    flow_cmd,
    jobs_cmd,
    redis_cmd,
    retention_cmd,
    serve_cmd,
    stats_cmd,
    worker_cmd,
)
from sluice.cli.parsing import SluiceCommand
from sluice.cli.plugins import RootGroup
from sluice.settings import ENV_DEBUG, ENV_HOME, ENV_REDIS_URL, ENVIRONMENT, Settings

#: Passed by :func:`main` as the root context's ``obj``: the CLI owns the process, so it routes
#: logging to stderr. Under ``CliRunner`` (tests) the host's logging is left alone.
STANDALONE = "sluice-standalone"


def _environment_help() -> str:
    rows = "\n\n".join(
        f"[bold]{v.name}[/bold]: {escape(v.meaning)} [dim]\\[default: {escape(v.default)}][/dim]"
        for v in ENVIRONMENT
    )
    return f"[bold]Environment variables[/bold]\n\n{rows}"


app = typer.Typer(
    name="sluice",
    # `sluice bench` (sluice-lab) and other distributions' groups: sluice.cli.plugins
    cls=RootGroup,
    help=(
        "Sluice: a budget-aware distributed job queue for LLM workloads, on Redis.\n\n"
        f"Every command talks to the Redis of --redis or {ENV_REDIS_URL}. With neither, it uses the "
        f"embedded Redis of {ENV_HOME} (./.sluice by default): started if none runs there, shared "
        "with the other commands that use it, stopped when the last one exits.\n\n"
        "Errors print one line saying what failed and how to fix it; --debug prints the traceback."
    ),
    epilog=_environment_help(),
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sluice {sluice.__version__}")
        raise typer.Exit


@app.callback()
def root(
    ctx: typer.Context,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help=f"Print an error's traceback, not one line (also after the command; or {ENV_DEBUG}=1).",
        ),
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Check the environment first: a bad SLUICE_* variable is one error line, like any other."""
    settings = Settings.from_env()
    if ctx.obj == STANDALONE:
        logs.configure(settings)


for name, fn in (
    ("info", jobs_cmd.info),
    ("show", jobs_cmd.show),
    ("enqueue", enqueue_cmd.enqueue),
    ("worker", worker_cmd.worker),
    ("demo", demo.demo),
    ("serve", serve_cmd.serve),
    ("dev", dev_cmd.dev),
    ("stats", stats_cmd.stats),
):
    app.command(name, cls=SluiceCommand)(fn)
app.add_typer(dlq_cmd.dlq_app, name="dlq")
app.add_typer(budget_cmd.budget_app, name="budget")
app.add_typer(flow_cmd.flow_app, name="flow")
app.add_typer(redis_cmd.redis_app, name="redis")
app.add_typer(retention_cmd.retention_app, name="retention")
app.add_typer(serve_cmd.keys_app, name="keys")
app.add_typer(failures_cmd.failures_app, name="failures")


def main() -> None:
    """The ``sluice`` console script.

    SIGTERM ends a command the way Ctrl-C does, by unwinding it, so that it
    leaves the folder's shared Redis (stopping it if it was the last user)
    rather than dying in place; ``sluice worker`` and ``sluice redis`` install
    handlers of their own for a graceful stop.
    """
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    app(prog_name="sluice", obj=STANDALONE)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
