"""What a running PostgreSQL server shows of itself: its ``postmaster.pid``, and its processes.

:func:`ready` reads whether a server accepts connections from its data folder, before any
client could connect; :func:`group_alive` whether a process of a server's process group still
runs (after a SIGKILL, until the last backend is gone).
"""

from __future__ import annotations

import os
from pathlib import Path


def ready(pgdata: Path, pid: int) -> bool:
    """True once ``postmaster.pid`` in ``pgdata`` names ``pid`` and says it accepts connections.

    The file, not a connection: it is there before any client could connect,
    and the pid in it tells our server apart from another on a reused port.
    """
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group ``pgid`` remains."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False
