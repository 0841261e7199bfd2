"""Sluice in the peer harness (/work/shared/bench-peers), measured like every peer.

Run with the harness's driver, Sluice's venv as the adapter's interpreter::

    ~/.cache/bench-peers/venv/bin/python /work/shared/bench-peers/run.py \\
        --redis redis://127.0.0.1:6390/0 --adapter-path benchmarks \\
        --adapter sluice=sluice_adapter:SluiceAdapter@.venv/bin/python \\
        --adapter sluice-c50=sluice_adapter:SluiceAdapterC50@.venv/bin/python \\
        --libs sluice,sluice-c50,saq,huey,bullmq-node,bullmq-node-c50

The job is the harness's: ``benchcore.mark_done_async()`` (one HINCRBY), so
completion is counted outside Sluice. Workers are ``sluice worker`` processes,
as users run them (uvloop, structlog at WARNING); enqueue is ``add_bulk``;
latency is ``job.result()``, which waits on the events stream without polling.
This module is imported by the driver child and by every worker process, so
module level only builds objects from the environment and never connects.
"""

from __future__ import annotations

from typing import Any

import benchcore
from benchcore import Adapter

from sluice import JobContext, JobSpec, Queue, Worker
from sluice.engine.connection import connect

worker = Worker("bench", concurrency=benchcore.concurrency(10), shutdown_grace=5.0)


@worker.handler
async def noop(job: JobContext) -> int:
    await benchcore.mark_done_async()
    return int(benchcore.JOB_RESULT)


class SluiceAdapter(Adapter):
    dists = ("sluice-queue", "redis", "hiredis", "uvloop")
    default_concurrency = 10
    worker_config = "1 `sluice worker` process (uvloop), concurrency={c}; idle wait: BZPOPMIN on a wake key"
    result_config = "records kept 1 day; latency: job.result() (events stream, XREAD BLOCK, no polling)"

    async def setup(self) -> None:
        self.redis = connect(benchcore.redis_url())
        self.queue = Queue("bench", redis=self.redis)

    async def teardown(self) -> None:
        await self.queue.close()
        await self.redis.aclose()

    async def enqueue_many(self, n: int) -> dict[str, Any]:
        await self.queue.add_bulk(JobSpec("noop") for _ in range(n))
        return {"bulk": True, "method": "Queue.add_bulk (one add script call per 1000 jobs)"}

    def worker_argv(self, wid: str) -> list[str]:
        return [
            benchcore.bin_path("sluice"),
            "worker",
            "sluice_adapter:worker",
            "--redis",
            benchcore.redis_url(),
            "--concurrency",
            str(self.concurrency),
            "--worker-id",
            wid,
        ]

    def worker_env(self) -> dict[str, str]:
        return {"SLUICE_LOG_LEVEL": "warning"}

    async def latency_one(self, timeout: float) -> None:
        job = await self.queue.add("noop")
        await job.result(timeout=timeout)


class SluiceAdapterC50(SluiceAdapter):
    """The same with 50 jobs at once per process (the peers' ``-c50`` variants)."""

    default_concurrency = 50
