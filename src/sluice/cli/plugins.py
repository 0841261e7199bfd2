"""Command groups of other distributions, found through the ``sluice.commands`` entry points.

A distribution adds ``sluice NAME ...`` by naming a :class:`typer.Typer` in
its metadata, as sluice-lab (``lab/`` in this repository) adds ``sluice bench``::

    [project.entry-points."sluice.commands"]
    bench = "sluice_lab.cli:bench_app"

The root group looks the entry points up only for a name that is none of
its own commands, and to list the commands (``sluice --help``), so the
built-in commands never pay for the scan; a built-in name is never replaced.
A group runs inside the root group's error handler like any other command.
Without sluice-lab, ``sluice bench`` is one error line saying how to install
it; a group that fails to load is one error line naming it and the error.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

import typer
from typer.core import MarkupMode, TyperCommand

from sluice.cli.errors import CliFailure, SluiceGroup, one_line

if TYPE_CHECKING:
    from typer._click.core import Command, Context

#: The entry point group that holds other distributions' command groups.
GROUP = "sluice.commands"

#: Commands of this repository that ship in a distribution of their own:
#: name -> (distribution, what it is, how to install it from a checkout).
ELSEWHERE = {"bench": ("sluice-lab", "the lab and the benchmarks", "pip install -e ./lab")}


def unavailable(name: str, summary: str, problem: str) -> Command:
    """``sluice NAME ...`` that takes any arguments and fails with one line saying why."""

    def fail() -> None:
        raise CliFailure(problem)

    return TyperCommand(
        name,
        callback=fail,
        help=f"{summary} ({problem.split(': ', 1)[0]}).",
        short_help=f"{summary[:1].upper()}{summary[1:]} (not available: see `sluice {name}`).",
        add_help_option=False,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )


def missing(name: str) -> Command:
    distribution, summary, from_checkout = ELSEWHERE[name]
    return unavailable(
        name,
        summary,
        f"`sluice {name}` ({summary}) is in the {distribution} distribution, which is not installed: "
        f"pip install {distribution} (in a checkout of Sluice: {from_checkout})",
    )


def load(entry: EntryPoint, rich_markup_mode: MarkupMode) -> Command:
    """The entry point's Typer as a command group named after the entry point, as add_typer makes it."""
    distribution = entry.dist.name if entry.dist is not None else entry.value
    try:
        plugin = entry.load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin is one error line, not a dead CLI
        text = one_line(f"{type(exc).__name__}: {exc}")
        return unavailable(
            entry.name,
            f"from {distribution}",
            f"`sluice {entry.name}` comes from {distribution}, which failed to load ({text}); reinstall it",
        )
    if not isinstance(plugin, typer.Typer):
        return unavailable(
            entry.name,
            f"from {distribution}",
            f"`sluice {entry.name}` comes from {distribution}, whose entry point {entry.value} is not a "
            "typer.Typer; report it to that distribution",
        )
    holder = typer.Typer(rich_markup_mode=rich_markup_mode)
    holder.add_typer(plugin, name=entry.name)
    group = typer.main.get_group(holder)
    return group.commands[entry.name]


class RootGroup(SluiceGroup):
    """The ``sluice`` group: its own commands, then the other distributions' groups."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._entries: dict[str, EntryPoint] | None = None
        self._loaded: dict[str, Command] = {}

    def _plugins(self) -> dict[str, EntryPoint]:
        if self._entries is None:
            self._entries = {}
            for entry in entry_points(group=GROUP):
                if entry.name not in self.commands:
                    self._entries.setdefault(entry.name, entry)
        return self._entries

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        if cmd_name not in self._loaded:
            entry = self._plugins().get(cmd_name)
            if entry is not None:
                self._loaded[cmd_name] = load(entry, self.rich_markup_mode)
            elif cmd_name in ELSEWHERE:
                self._loaded[cmd_name] = missing(cmd_name)
            else:
                return None
        return self._loaded[cmd_name]

    def list_commands(self, ctx: Context) -> list[str]:
        own = super().list_commands(ctx)
        others = [name for name in [*self._plugins(), *ELSEWHERE] if name not in own]
        return [*own, *dict.fromkeys(others)]
