"""A Worker for the flow-control tests that run it in processes of their own.

In a process: ``python -m sluice worker tests.harness.flow_workers:worker --redis URL
--queue q --worker-id ID --concurrency N`` (cwd: the repository). The module
builds the Worker from the environment: ``SLUICE_TEST_REDIS`` (where the
handler writes what it saw) and ``SLUICE_TEST_PREFIX`` (the test's key prefix).

Its one handler, ``probe``, counts itself in and out of a Redis counter shared
by every process (:func:`running_key`), appends the count it saw on entry to
:func:`peaks_key`, and stores when it started and ended, on which worker, in
:func:`spans_key` (a hash: job id -> JSON). It sleeps ``payload["sleep"]``
seconds in between. The counter is raised after the job was leased and
lowered before its outcome is sent, so it never exceeds the number of jobs
the queue has leased at once. ``sends`` waits, then says its call is leaving
(:meth:`JobContext.note_sent`): the measured headroom's tests.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import orjson

from sluice import JobContext, Worker
from sluice.engine.connection import connect

QUEUE = "q"


def running_key(prefix: str) -> str:
    return f"{prefix}:test:running"


def peaks_key(prefix: str) -> str:
    return f"{prefix}:test:peaks"


def spans_key(prefix: str) -> str:
    return f"{prefix}:test:spans"


def make_worker(redis_url: str, prefix: str, *, lease: float = 5.0) -> Worker:
    worker = Worker(QUEUE, prefix=prefix, lease=lease, shutdown_grace=5.0)

    @worker.handler
    async def probe(job: JobContext) -> str:
        payload: dict[str, Any] = job.payload or {}
        client = connect(redis_url)
        try:
            started = time.time_ns() // 1_000_000
            seen = await client.incr(running_key(prefix))
            await client.rpush(peaks_key(prefix), seen)
            await asyncio.sleep(float(payload.get("sleep", 0.0)))
            ended = time.time_ns() // 1_000_000
            await client.decr(running_key(prefix))
            span = {"worker": job.worker_id, "start": started, "end": ended}
            await client.hset(spans_key(prefix), job.id, orjson.dumps(span))
        finally:
            await client.aclose()
        return job.worker_id

    @worker.handler
    async def says_limits(job: JobContext) -> None:
        """Passes on ``payload`` as what a provider's answer said of its limits."""
        job.note_provider_limits(**(job.payload or {}))

    @worker.handler
    async def sends(job: JobContext) -> None:
        """Waits ``payload["before"]`` seconds, then says its call is leaving (note_sent)."""
        await asyncio.sleep(float((job.payload or {}).get("before", 0.0)))
        job.note_sent()

    return worker


def __getattr__(name: str) -> Worker:
    # Built on first use, so that tests can import this module without the environment.
    if name == "worker":
        return make_worker(os.environ["SLUICE_TEST_REDIS"], os.environ["SLUICE_TEST_PREFIX"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
