"""A Worker for tests that run it in a process of its own, and in-test copies of it.

In a process: ``python -m sluice worker tests.harness.proc_workers:worker --redis URL ...``
(cwd: the repository). The CLI has no options for the key prefix or the
timings, so the module builds that Worker from the environment:

* ``SLUICE_TEST_REDIS``: the Redis URL the handler writes its markers to;
* ``SLUICE_TEST_PREFIX``: the key prefix (one per test);
* ``SLUICE_TEST_LEASE``, ``SLUICE_TEST_GRACE``, ``SLUICE_TEST_REAP``: lease,
  shutdown grace and reap interval, in seconds.

The one handler, ``task``, first appends ``"<worker id>:<attempt>"`` to the list
:func:`runs_key` (so a test sees who started which attempt, in order), then,
as the payload asks:

* ``"gate": "<path>"``: waits until that file exists. It polls the file, not
  Redis, so that a cancellation always reaches it at an ``asyncio.sleep``;
* ``"hold": {"<worker id>": seconds}``: sleeps that long when run by that
  worker (use :data:`FOREVER` for a worker that should never finish);

and returns ``{"worker": <worker id>, "attempt": <attempt>}``.

When cancelled, the handler can misbehave as real ones do:

* ``"lose_cancels": n``: the first n cancellations have no effect (the handler
  carries on, as one does when a library swallows the CancelledError, which
  asyncio.wait_for can do on Python 3.11);
* ``"linger": seconds``: after that, it keeps running that long (ignoring
  further cancels, as a handler finishing uninterruptible work would) before
  it ends as cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from pathlib import Path
from typing import Any

from sluice import JobContext, Worker
from sluice.engine.connection import connect

QUEUE = "q"
FOREVER = 3600.0
GATE_POLL = 0.05


def runs_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:test:runs:{job_id}"


def make_worker(
    redis_url: str,
    prefix: str,
    *,
    lease: float = 1.0,
    shutdown_grace: float = 30.0,
    reap_interval: float = 0.2,
    concurrency: int = 1,
    worker_id: str | None = None,
) -> Worker:
    """A Worker of queue ``q`` under ``prefix`` whose ``task`` handler is described above."""
    worker = Worker(
        QUEUE,
        prefix=prefix,
        lease=lease,
        shutdown_grace=shutdown_grace,
        reap_interval=reap_interval,
        concurrency=concurrency,
        worker_id=worker_id,
    )

    @worker.handler
    async def task(job: JobContext) -> dict[str, Any]:
        payload: dict[str, Any] = job.payload or {}
        try:
            return await _run(job, payload)
        except asyncio.CancelledError:
            for _ in range(int(payload.get("lose_cancels", 0))):
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(FOREVER)
            await _linger(float(payload.get("linger", 0.0)))
            raise

    async def _run(job: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
        r = connect(redis_url)
        try:
            await r.rpush(runs_key(prefix, job.id), f"{job.worker_id}:{job.attempt}")
        finally:
            await r.aclose()
        if gate := payload.get("gate"):
            while True:
                if await asyncio.to_thread(Path(gate).exists):
                    break
                await asyncio.sleep(GATE_POLL)
        # No Redis round trip after this sleep: a zombie's handler must finish
        # as soon as its process runs again, before it can renew its lease.
        hold = float(payload.get("hold", {}).get(job.worker_id, 0.0))
        if hold > 0:
            await asyncio.sleep(hold)
        if payload.get("report_gc"):
            return {"worker": job.worker_id, "attempt": job.attempt, "frozen": gc.get_freeze_count()}
        return {"worker": job.worker_id, "attempt": job.attempt}

    return worker


async def _linger(seconds: float) -> None:
    """Keep running for ``seconds``, whatever cancels arrive meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(left)


def worker_from_env() -> Worker:
    env = os.environ
    return make_worker(
        env["SLUICE_TEST_REDIS"],
        env["SLUICE_TEST_PREFIX"],
        lease=float(env.get("SLUICE_TEST_LEASE", "1.0")),
        shutdown_grace=float(env.get("SLUICE_TEST_GRACE", "30.0")),
        reap_interval=float(env.get("SLUICE_TEST_REAP", "0.2")),
    )


def __getattr__(name: str) -> Worker:
    # Built on first use, so that tests can import this module without the environment.
    if name == "worker":
        return worker_from_env()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
