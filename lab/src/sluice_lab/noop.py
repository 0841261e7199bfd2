"""The benchmark worker: one handler, ``noop``, started as ``sluice worker sluice_lab.noop:worker``.

With ``SLUICE_BENCH_URL`` and ``SLUICE_BENCH_DONE_KEY`` set (the benchmarks
set them), the job does what the peer harness's job does: one
``HINCRBY <done key> <worker id> 1``. Completion is then counted by the job
itself, not by the engine being measured, so a lost or twice-run job shows,
the per-process split is visible, and the figures compare with the peers'.
Without them it does nothing at all (the engine's own cost alone).
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from sluice.engine.connection import connect
from sluice.engine.context import JobContext
from sluice.engine.worker import Worker
from sluice.settings import ENV_BENCH_DONE_KEY, ENV_BENCH_URL

if TYPE_CHECKING:
    from redis.asyncio import Redis

ENV_URL = ENV_BENCH_URL
ENV_DONE_KEY = ENV_BENCH_DONE_KEY

#: The benchmarks pass --queue; this name is only the default.
worker = Worker("bench", concurrency=10, shutdown_grace=5.0)

#: Read once: the benchmark sets it before the process starts, and the job is the hot path.
_DONE_KEY = os.environ.get(ENV_DONE_KEY)
_clients: dict[int, Redis] = {}


def _client() -> Redis:
    """One client per event loop: the worker process has one, tests may make more."""
    loop_id = id(asyncio.get_running_loop())
    client = _clients.get(loop_id)
    if client is None:
        client = _clients[loop_id] = connect(os.environ[ENV_URL])
    return client


@worker.handler
async def noop(job: JobContext) -> int:
    """Count this run (when asked to) and return 1, like the peers' job."""
    if _DONE_KEY:
        await _client().hincrby(_DONE_KEY, job.worker_id, 1)
    return 1
