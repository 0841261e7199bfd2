"""Which Redis a CLI command talks to: --redis, SLUICE_REDIS_URL, or an embedded one.

The embedded server keeps its data and socket in ``$SLUICE_HOME`` (default
``./.sluice``). A command that finds one already running there (started by
another sluice command) shares it; otherwise it starts one and stops it on exit.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from sluice.settings import Settings
from sluice.testing.embedded import EmbeddedRedis, find_binary

ENV_URL = "SLUICE_REDIS_URL"
ENV_HOME = "SLUICE_HOME"


def home() -> Path:
    return Path(os.environ.get(ENV_HOME, ".sluice")).resolve()


def _alive(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(str(sock))
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_url(explicit: str | None, console: Console | None = None) -> Iterator[str]:
    """Yield the URL to use, starting (and later stopping) an embedded Redis if needed."""
    url = explicit or os.environ.get(ENV_URL)
    if url:
        yield url
        return
    data = home() / "redis"
    server = EmbeddedRedis(data, binary=find_binary(Settings.from_env().redis_server))
    if server.socket_path is not None and _alive(server.socket_path):
        yield server.url
        return
    server.start()
    if console is not None:
        console.print(
            f"[dim]embedded Redis {server.binary.version} ({server.binary.origin}) at {server.url}, "
            f"data in {data}; set {ENV_URL} to use your own[/dim]"
        )
    try:
        yield server.url
    finally:
        server.stop()
