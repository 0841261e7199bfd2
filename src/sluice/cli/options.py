"""Options shared by the commands, and checks that turn bad input into the CLI's own messages.

Every command that opens a queue takes ``--queue/-q``, ``--prefix`` and
``--redis`` (see :data:`QueueOpt`, :data:`PrefixOpt`, :data:`RedisOpt`) and
names that queue as a :class:`Target`. Values are checked here, before any
Redis call, so a mistake comes back as a usage error that names the option,
never as a Python exception from the library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

import typer

from sluice.engine.budget_state import MAX_ROLLING_SECONDS, check_budget_name
from sluice.engine.keys import check_name
from sluice.errors import BudgetError, ConfigurationError
from sluice.settings import DEFAULT_PREFIX, DEFAULT_QUEUE, ENV_REDIS_URL

N = TypeVar("N", int, float)

#: Where the connection options are listed in each command's --help.
CONNECTION = "Connection"


def checked_name(what: str) -> Callable[[str | None], str | None]:
    """Typer callback: a queue name or key prefix that the library accepts."""

    def check(value: str | None) -> str | None:
        try:
            return None if value is None else check_name(what, value)
        except ConfigurationError as exc:
            raise typer.BadParameter(str(exc)) from None

    return check


def budget_name(value: str | None) -> str | None:
    """Typer callback: a usable budget name (or None when the option was not given)."""
    try:
        return None if value is None else check_budget_name(value)
    except BudgetError as exc:
        raise typer.BadParameter(str(exc)) from None


def at_least(low: N, message: str, high: N | None = None, advice: str = "") -> Callable[[N | None], N | None]:
    """Typer callback for a number from ``low`` (to ``high``) with the CLI's own message.

    Typer's ``min=`` would say "-5 is not in the range x>=1"; a number that
    reaches the command (negative ones too, see parsing.py) is better told
    what to do instead.
    """

    def check(value: N | None) -> N | None:
        if value is not None and (value < low or (high is not None and value > high)):
            raise typer.BadParameter(f"{message}, got {value:g}" + (f"; {advice}" if advice else ""))
        return value

    return check


def parse_window(value: str | None) -> str | float | None:
    """--window: "day", "month" or a rolling number of seconds (as a float)."""
    if value is None or value in ("day", "month"):
        return value
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 1 <= seconds <= MAX_ROLLING_SECONDS:
        raise typer.BadParameter(
            f'use "day" or "month" (UTC calendar) or a rolling window of 1 to {MAX_ROLLING_SECONDS} '
            f"seconds, got {value!r}",
            param_hint="--window",
        )
    return seconds


QueueOpt = Annotated[
    str,
    typer.Option(
        "--queue", "-q", callback=checked_name("queue name"), help="Queue name.", rich_help_panel=CONNECTION
    ),
]
PrefixOpt = Annotated[
    str,
    typer.Option(
        callback=checked_name("key prefix"),
        help="Key prefix of the queue (the namespace its application chose).",
        rich_help_panel=CONNECTION,
    ),
]
RedisOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Redis URL \\[default: ${ENV_REDIS_URL}, else the embedded Redis of $SLUICE_HOME].",
        rich_help_panel=CONNECTION,
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print JSON on stdout (notes go to stderr), for programs."),
]


@dataclass(frozen=True, slots=True)
class Target:
    """The queue a command works on: its name, key prefix and Redis (None: the default)."""

    queue: str = DEFAULT_QUEUE
    prefix: str = DEFAULT_PREFIX
    redis: str | None = None

    def describe(self) -> str:
        """'queue q', with the prefix when it is not the default one."""
        return f"queue {self.queue}" + ("" if self.prefix == DEFAULT_PREFIX else f" (prefix {self.prefix})")

    def flags(self) -> str:
        """The options that name this queue again in a suggested command ('' for the defaults)."""
        parts = [] if self.queue == DEFAULT_QUEUE else [f"--queue {self.queue}"]
        if self.prefix != DEFAULT_PREFIX:
            parts.append(f"--prefix {self.prefix}")
        return "".join(" " + p for p in parts)
