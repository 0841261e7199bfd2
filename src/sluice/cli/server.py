"""Which Redis a CLI command talks to: --redis, SLUICE_REDIS_URL, or the folder's shared one.

With neither, a command uses the shared embedded server of ``$SLUICE_HOME``
(default ``./.sluice``; see :mod:`sluice.local.shared`): it starts one if
none runs, and on exit stops it only if no other command still uses it, so
stopping one worker never strands the others. ``sluice redis`` keeps one
running in the foreground and prints its URL for programs outside the CLI.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape

from sluice.engine.connection import redact
from sluice.local.shared import SharedRedis
from sluice.settings import ENV_REDIS_URL, Settings

ENV_URL = ENV_REDIS_URL


def command_label() -> str:
    """``sluice worker``, ``sluice info``...: how ``sluice redis status`` names a user.

    The first word of the command line that is not an option: the command's
    name, never its arguments (a payload may be private).
    """
    words = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    return f"sluice {words[0]}" if words else "sluice"


@contextmanager
def redis_url(explicit: str | None, console: Console | None = None) -> Iterator[str]:
    """Yield the URL to use; with no --redis and no SLUICE_REDIS_URL, the folder's shared Redis.

    Attaches to it for the block (starting it if none runs) and detaches
    after: the server stops only when no other command uses it.
    """
    settings = Settings.from_env()
    url = explicit or settings.redis_url
    if url:
        # Given the URL of this folder's shared Redis (the line `sluice redis` prints), use it
        # as a user all the same, so that it is not stopped under this command.
        with SharedRedis(settings.home, label=command_label(), join=url):
            yield url
        return
    shared = SharedRedis(settings.home, binary=settings.redis_server, label=command_label())
    with shared as url:
        record = shared.record
        if shared.started and console is not None and record is not None:
            console.print(
                escape(
                    f"started the embedded Redis {record.version} at {redact(url)}; it stops when the last "
                    "command using it exits (`sluice redis` keeps it up)"
                ),
                style="dim",
            )
        yield url
