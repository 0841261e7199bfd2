"""Other distributions' command groups (``sluice.commands`` entry points): ``sluice bench`` of sluice-lab."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import pytest
import typer

from sluice.cli import plugins
from tests.cli.test_cli import cli

#: A command group of a made-up distribution, loaded by the entry points below.
extra_app = typer.Typer(help="A group from elsewhere.", no_args_is_help=True)


@extra_app.command("hello")
def hello(name: str = "world") -> None:
    """Say hello."""
    typer.echo(f"hello {name}")


def only(monkeypatch: pytest.MonkeyPatch, *entries: EntryPoint) -> None:
    monkeypatch.setattr(plugins, "entry_points", lambda group: list(entries))


def test_sluice_lab_brings_sluice_bench() -> None:
    # Given sluice-lab installed (scripts/bootstrap installs it), its entry point names bench_app
    (entry,) = (e for e in entry_points(group=plugins.GROUP) if e.name == "bench")
    assert entry.value == "sluice_lab.cli:bench_app"
    # Then `sluice bench` lists its commands as it did when they were built in
    result = cli("bench", "--help")
    assert result.exit_code == 0, result.output
    for command in ("throughput", "latency", "chaos", "scale", "ingest", "burst", "cache", "goodput", "lab"):
        assert command in result.output


@pytest.mark.parametrize("args", [["bench", "lab", "--redis", "redis://127.0.0.1:1/0"], ["bench", "--help"]])
def test_without_sluice_lab_sluice_bench_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    only(monkeypatch)
    result = cli(*args)
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: `sluice bench`") and "pip install sluice-lab" in line
    assert "pip install -e ./lab" in line
    # And `sluice --help` still lists it
    assert "bench" in cli("--help").output


def test_a_group_of_another_distribution_runs_like_a_built_in_one(monkeypatch: pytest.MonkeyPatch) -> None:
    only(monkeypatch, EntryPoint("extra", f"{__name__}:extra_app", plugins.GROUP))
    assert "extra" in cli("--help").output
    result = cli("extra", "hello", "--name", "sluice")
    assert (result.exit_code, result.output) == (0, "hello sluice\n")


def test_a_built_in_name_is_never_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    only(monkeypatch, EntryPoint("info", f"{__name__}:extra_app", plugins.GROUP))
    result = cli("info", "--help")
    assert result.exit_code == 0 and "hello" not in result.output


@pytest.mark.parametrize(
    ("value", "said"),
    [("no_such_module_here:app", "ModuleNotFoundError"), (f"{__name__}:hello", "typer.Typer")],
)
def test_a_group_that_fails_to_load_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, value: str, said: str
) -> None:
    only(monkeypatch, EntryPoint("broken", value, plugins.GROUP))
    result = cli("broken", "anything", "--at-all")
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: `sluice broken` comes from") and said in line
