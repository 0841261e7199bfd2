"""prometheus-client's multiprocess mode, as ``sluice serve -p N`` and ``sluice worker -p N``
use it: every process writes its values to files in one directory, and the process that
answers a scrape adds them up.

Light on purpose (prometheus-client and the standard library only): a worker's supervisor
imports it without the rest of the service.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

#: prometheus-client's variable: the directory of the processes' value files.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LIVE_FILE = re.compile(r"gauge_live\w*?_(\d+)\.db$")


def prune_dead(path: str) -> list[int]:
    """Drop the live gauges of processes that are gone (uvicorn restarts a killed worker
    under a new pid and has no hook for its end). Their counters and histograms stay: the
    totals must not go back."""
    dead: set[int] = set()
    for name in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        found = _LIVE_FILE.search(os.path.basename(name))
        if found is None:
            continue
        pid = int(found.group(1))
        if not _alive(pid):
            dead.add(pid)
    for pid in dead:
        with contextlib.suppress(OSError):
            mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    return sorted(dead)


def _alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux), or it ended meanwhile
        return True


def merged(path: str) -> Iterator[Metric]:
    """Every process's values in ``path``, added up, after the dead ones' live gauges are
    dropped."""
    prune_dead(path)
    registry = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    yield from registry.collect()


class Merged(Collector):
    """A collector of :func:`merged`: what a supervisor's port serves."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        yield from merged(self.path)
