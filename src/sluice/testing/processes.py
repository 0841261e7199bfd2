"""Worker processes started as users start them: ``python -m sluice worker module:worker``.

The lab, the benchmarks, ``sluice demo`` and the tests that need real
processes (crash recovery, shutdown) build their command lines here.
"""

from __future__ import annotations

import sys


def worker_argv(url: str, queue: str, concurrency: int, worker_id: str, target: str) -> list[str]:
    """argv of one single-process `sluice worker` serving ``queue`` (the demo uses it too)."""
    return [
        sys.executable,
        "-m",
        "sluice",
        "worker",
        target,
        "--redis",
        url,
        "--queue",
        queue,
        "--concurrency",
        str(concurrency),
        "--worker-id",
        worker_id,
    ]
