"""Running a real worker inside a test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    from sluice.engine.worker import Worker


@contextlib.asynccontextmanager
async def running_worker(
    worker: Worker, redis: Redis | RedisCluster | str, *, stop_timeout: float = 30.0
) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``worker`` on ``redis`` (a client or a URL) for the duration of the block.

    On leaving, the worker stops taking jobs and finishes the running ones
    (its ``shutdown_grace`` applies); an error of the worker itself is raised
    here rather than lost::

        async with running_worker(worker, url):
            job = await queue.add("summarize", {"text": "..."})
            assert await job.result(timeout=10) == {...}

    The watchdog's hard stop is off inside the block: it ends the whole
    process (exit code 75, for a supervisor to restart), which here would be
    the test run. A handler that overruns its timeout is still cancelled and
    flagged (``job.stop_requested``), and a blocked event loop still logged.
    """
    hard_grace, worker.hard_grace = worker.hard_grace, None
    task = asyncio.create_task(worker.run(redis, handle_signals=False))
    await asyncio.sleep(0)
    try:
        yield task
    finally:
        worker.stop()
        try:
            async with asyncio.timeout(stop_timeout):
                await task
        finally:
            worker.hard_grace = hard_grace
