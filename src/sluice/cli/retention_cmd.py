"""How long and how many finished jobs a queue keeps: ``sluice retention show | set``."""

from __future__ import annotations

import re
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.table import Table

from sluice.cli.options import JsonOpt, PrefixOpt, QueueOpt, RedisOpt, Target
from sluice.cli.output import print_json, stdout
from sluice.cli.parsing import SluiceCommand
from sluice.cli.runtime import with_queue
from sluice.engine import Queue
from sluice.engine.retention import KINDS, MAX_AGE_S, MAX_COUNT, UNCHANGED, Retention
from sluice.settings import DEFAULT_PREFIX, DEFAULT_QUEUE

retention_app = typer.Typer(
    help=(
        "How long and how many finished jobs a queue keeps (completed, dead, cancelled, rejected, "
        "exhausted). "
        "A setting of the queue, stored in Redis: every client and worker applies the same."
    ),
    no_args_is_help=True,
)

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")


def parse_age(value: str) -> float | None:
    """'90', '90s', '15m', '1h', '7d' -> seconds; 'none' -> None (no age limit)."""
    if value == "none":
        return None
    match = _DURATION.match(value.strip().lower())
    seconds = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    if not 0 < seconds <= MAX_AGE_S:
        raise typer.BadParameter(
            f'use a duration such as 90s, 15m, 1h or 7d (at most 366d), or "none" for no age limit; '
            f"got {value!r}",
            param_hint="--age",
        )
    return seconds


def parse_count(value: str) -> int | None:
    """'10000' or '10_000' -> 10000; 'none' -> None (no count limit)."""
    if value == "none":
        return None
    digits = value.replace("_", "").replace(",", "")
    if not digits.isdigit() or not 0 < int(digits) < MAX_COUNT:
        raise typer.BadParameter(
            f'use a whole number of jobs from 1 to {MAX_COUNT - 1:,}, or "none" for no count limit; '
            f"got {value!r}",
            param_hint="--count",
        )
    return int(digits)


def _age_text(age: float | None) -> str:
    if age is None:
        return "no limit"
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if age >= size and age % size == 0:
            return f"{age / size:g}{unit}"
    return f"{age:g}s"


def retention_table(settings: dict[str, Retention], target: Target) -> RenderableType:
    table = Table(title=f"retention of {target.describe()}", title_justify="left")
    table.add_column("finished as")
    table.add_column("kept for", justify="right")
    table.add_column("at most", justify="right")
    for kind, r in settings.items():
        table.add_row(kind, _age_text(r.age), "no limit" if r.count is None else f"{r.count:,} jobs")
    return table


def _show(settings: dict[str, Retention], target: Target, as_json: bool) -> None:
    if as_json:
        print_json({kind: r.as_dict() for kind, r in settings.items()})
    else:
        stdout().print(retention_table(settings, target))


@retention_app.command("show", cls=SluiceCommand)
def retention_show(
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """How long and how many finished jobs of each kind the queue keeps (defaults filled in)."""
    target = Target(queue, prefix, redis)
    _show(with_queue(target, Queue.retention), target, as_json)


@retention_app.command("set", cls=SluiceCommand)
def retention_set(
    kind: Annotated[str, typer.Argument(help=f"How the jobs finished: {', '.join(KINDS)}.")],
    age: Annotated[
        str | None,
        typer.Option(help='Keep each for this long: 90s, 15m, 1h, 7d; or "none" for no age limit.'),
    ] = None,
    count: Annotated[
        str | None, typer.Option(help='Keep at most this many (the newest); or "none" for no count limit.')
    ] = None,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Change a kind's limits; only those given change.

    Records expire with the age in force when their job finished; running
    workers apply a lower limit to the records kept already within seconds.
    """
    if kind not in KINDS:
        raise typer.BadParameter(f"use one of {', '.join(KINDS)}; got {kind!r}", param_hint="KIND")
    if age is None and count is None:
        raise typer.BadParameter("give --age or --count (or both)")
    new_age = UNCHANGED if age is None else parse_age(age)
    new_count = UNCHANGED if count is None else parse_count(count)

    async def change(q: Queue) -> dict[str, Retention]:
        await q.set_retention(kind, age=new_age, count=new_count)
        return await q.retention()

    target = Target(queue, prefix, redis)
    _show(with_queue(target, change), target, as_json)
