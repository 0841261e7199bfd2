"""``sluice redis``: the folder's embedded Redis, in the foreground; its status; stopping it.

Every sluice command without --redis or SLUICE_REDIS_URL already uses this
folder's shared server (starting it if none runs); ``sluice redis`` keeps it
up and prints its URL, which programs of your own need (they read
SLUICE_REDIS_URL; they do not start servers).
"""

from __future__ import annotations

import json
import shlex
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from sluice.cli.server import ENV_URL, command_label
from sluice.engine.connection import redact
from sluice.errors import RedisUnavailable
from sluice.local import shared
from sluice.local.shared import ServerRecord, ServerStatus, SharedRedis
from sluice.settings import ENV_HOME, ENV_REDIS_SERVER, Settings

console = Console(soft_wrap=True)  # a URL or a path must never be cut in two by a line break

redis_app = typer.Typer(
    help=(
        "The embedded Redis of this folder, shared by every sluice command.\n\n"
        f"A command run without --redis or {ENV_URL} uses the redis-server of the folder "
        f"{ENV_HOME} (default ./.sluice): it starts one if none runs, and the last command to "
        "leave stops it, so stopping one worker never strands the others. Its data (an "
        "append-only file) is kept across restarts.\n\n"
        "`sluice redis` keeps it running in the foreground and prints the "
        f"`export {ENV_URL}=...` line that your own programs need. "
        f"{ENV_REDIS_SERVER} picks the redis-server binary (default: the one on PATH, else "
        "the 6.2 binary of the 'embedded' extra)."
    ),
    rich_markup_mode="rich",
)

HomeOpt = Annotated[
    Path | None,
    typer.Option(
        "--home",
        help=f"The folder whose Redis this is (default ${ENV_HOME}, else .sluice).",
        show_default=False,
    ),
]
PortOpt = Annotated[
    int | None,
    typer.Option(
        "--port",
        min=0,
        max=65535,
        help=(
            "Listen on this loopback TCP port instead of a unix socket, for programs that "
            "cannot use the socket (0 picks a free one). Any local user can reach a port, so "
            "the server gets a random password, in the URL it prints. Only when it starts the server."
        ),
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON, one object per line.")]

#: Signals that end `sluice redis run` (Ctrl-C, kill, the terminal closing).
_LEAVE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


#: Where the group's options reach its subcommands (ctx.obj belongs to the root).
_GROUP = "sluice.redis"


class _Leave(Exception):
    """Raised by the signal handler to end the foreground wait."""


@redis_app.callback(invoke_without_command=True)
def main(ctx: typer.Context, home: HomeOpt = None, port: PortOpt = None, as_json: JsonOpt = False) -> None:
    """With no command: the same as `sluice redis run`."""
    if ctx.invoked_subcommand is None:
        _run(home, port, as_json)
    else:  # `sluice redis --home X status` means `sluice redis status --home X`
        ctx.meta[_GROUP] = {"home": home, "port": port, "as_json": as_json}


@redis_app.command("run")
def run_cmd(ctx: typer.Context, home: HomeOpt = None, port: PortOpt = None, as_json: JsonOpt = False) -> None:
    """Keep the folder's Redis running (start it if none runs) until Ctrl-C, and print its URL.

    On exit it stops only if no other sluice command still uses it.
    """
    group = ctx.meta.get(_GROUP, {})
    _run(
        home or group.get("home"),
        port if port is not None else group.get("port"),
        as_json or group.get("as_json"),
    )


@redis_app.command()
def status(ctx: typer.Context, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Is the folder's Redis running? Its URL, pid, version and users. Exit code 0 if it runs, 1 if not."""
    group = ctx.meta.get(_GROUP, {})
    folder = _home(home or group.get("home"))
    found = shared.status(folder)
    if as_json or group.get("as_json"):
        out: dict[str, Any] = {"running": found is not None, "home": str(folder.resolve())}
        if found is not None:
            out |= _describe(found.record, found.folder) | {"users": [asdict(u) for u in found.users]}
        print(json.dumps(out), flush=True)
    elif found is None:
        console.print(f"no Redis runs for {escape(str(folder.resolve()))}; `sluice redis` starts one")
    else:
        _print_server(found.record, found.folder, "running")
        users = ", ".join(f"pid {u.pid} ({u.label})" for u in found.users) or "none"
        console.print(f"  users   {len(found.users)}: {escape(users)}")
    raise typer.Exit(0 if found is not None else 1)


@redis_app.command()
def stop(
    ctx: typer.Context,
    home: HomeOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask, even if commands use it.")] = False,
) -> None:
    """Stop the folder's Redis now, even if other commands still use it (they lose their Redis).

    Its data is kept; the next command starts it again, and the commands it
    stranded reconnect to that one (same socket).
    """
    folder = _home(home or ctx.meta.get(_GROUP, {}).get("home"))
    found = shared.status(folder)
    if found is None:
        console.print(f"no Redis runs for {escape(str(folder.resolve()))}; nothing to stop")
        return
    if found.users and not yes:
        users = ", ".join(f"pid {u.pid} ({u.label})" for u in found.users)
        typer.confirm(
            f"{len(found.users)} command(s) still use it ({users}); they lose their Redis until a "
            "command starts it again. Stop it anyway?",
            abort=True,
        )
    stopped = shared.stop(folder)
    if stopped is None:
        console.print("it had stopped already")
        return
    _report_stop(stopped)


def _run(home: Path | None, port: int | None, as_json: bool) -> None:
    server = SharedRedis(
        _home(home), binary=Settings.from_env().redis_server, port=port, label=command_label()
    )
    url = server.attach()
    try:
        record = server.record
        assert record is not None
        others = len(server.users())
        if as_json:
            described = _describe(record, server.folder.path) | {"started": server.started, "users": others}
            print(json.dumps(described), flush=True)
        else:
            _announce(record, server, others)
        ended_by = _wait(server)
    finally:
        for sig in _LEAVE_SIGNALS:  # a second Ctrl-C must not interrupt leaving
            signal.signal(sig, signal.SIG_IGN)
        left = server.detach()
    if as_json:
        left_json: dict[str, Any] = {"left": True, "others": left, "stopped": left == 0 and not ended_by}
        print(json.dumps(left_json | ({"error": ended_by} if ended_by else {})), flush=True)
    elif left:
        console.print(
            f"{left} other command(s) still use it; it stops when the last one exits ({redact(url)})"
        )
    elif ended_by is None:
        console.print(f"stopped the Redis; its data stays in {escape(str(server.folder.path))}")
    if ended_by is not None:
        raise RedisUnavailable(
            redact(url), ended_by, f"See {server.folder.log_path}; `sluice redis` starts it again"
        )


def _announce(record: ServerRecord, server: SharedRedis, others: int) -> None:
    how = "started" if server.started else f"already running; {others} other command(s) use it"
    _print_server(record, server.folder.path, how)
    console.print()
    console.print("Point your own programs and other terminals at it:")
    console.print()
    print(f"export {ENV_URL}={shlex.quote(record.url)}", flush=True)
    console.print()
    console.print(
        "sluice commands run with the same home folder find it without the export. "
        "Ctrl-C leaves; the server stops then unless other commands still use it."
    )


def _print_server(record: ServerRecord, folder: Path, how: str) -> None:
    console.print(f"[bold]Redis {record.version}[/bold] ({how}, pid {record.pid})")
    console.print(f"  url     [bold]{escape(redact(record.url))}[/bold]")
    console.print(f"  binary  {escape(record.binary)} ({record.origin})")
    console.print(f"  data    {escape(str(folder))} (append-only file, kept across restarts)")


def _describe(record: ServerRecord, folder: Path) -> dict[str, Any]:
    return {
        "url": redact(record.url),
        "export": f"export {ENV_URL}={shlex.quote(record.url)}",
        "pid": record.pid,
        "version": record.version,
        "binary": record.binary,
        "origin": record.origin,
        "port": record.port if record.socket is None else None,
        "data": str(folder),
    }


def _report_stop(stopped: ServerStatus) -> None:
    note = f"; stranded {len(stopped.users)} command(s) using it" if stopped.users else ""
    console.print(
        f"stopped the Redis of {escape(str(stopped.folder))} (pid {stopped.record.pid}){note}; "
        "its data is kept"
    )


def _wait(server: SharedRedis) -> str | None:
    """Wait for a signal (None) or for the server to stop under us (what to tell the user)."""

    def leave(signum: int, _frame: object) -> None:
        raise _Leave(signum)

    for sig in _LEAVE_SIGNALS:
        signal.signal(sig, leave)
    try:
        while server.running():
            time.sleep(1.0)
    except _Leave:
        return None
    return "it stopped while `sluice redis` used it (`sluice redis stop` stopped it, or it crashed)"


def _home(home: Path | None) -> Path:
    return home if home is not None else Settings.from_env().home
