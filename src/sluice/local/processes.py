"""Worker processes started as users start them: ``python -m sluice worker module:worker``.

The lab, the benchmarks, ``sluice demo`` and the tests that need real
processes (crash recovery, shutdown) start them with :func:`worker_process`.
The Redis URL goes in the child's environment, not on its command line,
where ``ps`` would show a password to every user of the machine.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from typing import IO, Any

from sluice.settings import ENV_REDIS_URL


def worker_argv(queue: str, concurrency: int, worker_id: str, target: str) -> list[str]:
    """argv of one single-process ``sluice worker`` serving ``queue`` (the URL is not in it)."""
    return [
        sys.executable,
        "-m",
        "sluice",
        "worker",
        target,
        "--queue",
        queue,
        "--concurrency",
        str(concurrency),
        "--worker-id",
        worker_id,
    ]


def worker_process(
    url: str,
    queue: str,
    concurrency: int,
    worker_id: str,
    target: str,
    *,
    env: Mapping[str, str],
    stderr: int | IO[Any] | None = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Start one worker process on ``url`` in a session of its own (a signal meant for the
    caller does not reach it), with ``env`` (pass the caller's) and the URL added."""
    return subprocess.Popen(
        worker_argv(queue, concurrency, worker_id, target),
        env={**env, ENV_REDIS_URL: url},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )
