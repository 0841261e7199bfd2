"""What commands print: tables on stdout, notes on stderr, or JSON alone on stdout.

Consoles are made per call, not at import: rich reads the terminal width
(``COLUMNS``) when a console is built, and a command must fit the terminal
it runs in. With ``--json`` nothing but the JSON document goes to stdout, so
``sluice info --json | jq`` works; notes and warnings always go to stderr.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import orjson
import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def stdout() -> Console:
    return Console()


def stderr() -> Console:
    # Notes and errors: a URL or a command in one must never be cut in two by a line break.
    return Console(stderr=True, soft_wrap=True)


def note(text: str) -> None:
    """A remark for the person at the terminal (stderr, so JSON output stays clean)."""
    stderr().print(escape(text), style="dim", soft_wrap=True)


def warn(text: str) -> None:
    stderr().print(f"[yellow]warning:[/yellow] {escape(text)}", soft_wrap=True)


def print_json(data: Any) -> None:
    typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())


def json_text(value: Any) -> str:
    """A payload or result for a table cell: compact when short, indented when not."""
    compact = orjson.dumps(value).decode()
    if len(compact) <= 60 or not isinstance(value, dict | list):
        return compact
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()


def plain_table(title: str | None = None) -> Table:
    """A table without vertical rules: narrow enough for an 80-column terminal."""
    return Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")


def fields_table(title: str) -> Table:
    """Label / value rows, for one object (a job, a queue's flow controls)."""
    table = Table(title=title, box=None, show_header=False, pad_edge=False, title_justify="left")
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    return table


def utc(ms: int | None, *, seconds_only: bool = False) -> str:
    """Unix ms as '2025-06-01 12:00:03.123 UTC' ('-' for None)."""
    if ms is None:
        return "-"
    text = dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return (text[:-7] if seconds_only else text[:-3]) + " UTC"


#: Units of a duration of a minute or more: the largest that fits, and the next smaller one.
_SPANS = (("d", 86_400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1))


def span(ms: float, *, compact: bool = False) -> str:
    """A duration for people: '850 ms', '12.5 s', '3 min 4 s', '2 h 5 min', '3 d 4 h'
    (compact: '850ms', '12.5s', '3m 4s', '2h 5m', '3d 4h')."""
    gap = "" if compact else " "
    if ms < 1000:
        return f"{ms:.0f}{gap}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}{gap}s"
    big, size, small, small_size = next(u for u in _SPANS if s >= u[1])
    if compact:
        big, small = big[0], small[0]
    return f"{int(s // size)}{gap}{big} {int(s % size // small_size)}{gap}{small}"


def relative(ms: int | None, now: int) -> str:
    """'in 3 h 12 min' or '5 s ago' ('-' for None)."""
    if ms is None:
        return "-"
    return f"in {span(ms - now)}" if ms >= now else f"{span(now - ms)} ago"
