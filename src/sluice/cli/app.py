"""The ``sluice`` command line."""

from __future__ import annotations

import typer

from sluice.cli import bench_cmd, budget_cmd, demo, goodput_cmd, jobs_cmd, lab_cmd, logs, worker_cmd
from sluice.settings import Settings

app = typer.Typer(
    name="sluice",
    help=(
        "Sluice: a budget-aware distributed job queue for LLM workloads, on Redis.\n\n"
        "Every command talks to the Redis in --redis or SLUICE_REDIS_URL; when neither is "
        "set, it starts an embedded redis-server with its data in ./.sluice (SLUICE_HOME)."
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)
app.command("worker")(worker_cmd.worker)
app.command("demo")(demo.demo)
app.command("info")(jobs_cmd.info)
app.command("enqueue")(jobs_cmd.enqueue)
app.command("show")(jobs_cmd.show)
app.add_typer(jobs_cmd.dlq_app, name="dlq")
app.add_typer(budget_cmd.budget_app, name="budget")
app.add_typer(budget_cmd.flow_app, name="flow")
app.add_typer(bench_cmd.bench_app, name="bench")  # with `lab` and `goodput`, registered by their modules
_ = lab_cmd, goodput_cmd


def main() -> None:
    logs.configure(Settings.from_env())
    app()
