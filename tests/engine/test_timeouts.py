"""Timeouts that hold: sync handlers, handlers that block the loop or swallow their cancellation.

A handler past its timeout is cancelled; one that cannot be (a ``def`` in
its thread, an ``async def`` that blocks the event loop or swallows the
CancelledError) is stopped hard ``hard_grace`` seconds later by the worker's
watchdog: the attempt is recorded as failed, the process's other jobs are
released, and the process exits with code 75, for ``sluice worker
--processes N`` to start a new one (engine/watchdog.py).

The tests in a process run ``tests.engine.test_timeouts:worker``, a Worker built
from the environment (``SLUICE_TEST_REDIS``, ``SLUICE_TEST_PREFIX``) whose
handlers record each run as ``"<worker id>:<attempt>:<token>"`` (see
:func:`runs`), then misbehave as their payload asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import Backoff, JobContext, JobFailed, JobState, Queue, Worker
from sluice.engine.connection import connect
from sluice.engine.watchdog import EXIT_HARD_STOPPED
from tests.conftest import eventually, running
from tests.harness.proc_harness import WorkerProc, WorkerProcs

TARGET = "tests.engine.test_timeouts:worker"
WATCHDOG = "sluice.worker"

pytestmark = pytest.mark.slow


# ---- in the test's own loop ----------------------------------------------------------------


async def test_a_sync_handler_past_its_timeout_leaves_the_loop_free(
    redis: Redis, prefix: str, queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=WATCHDOG)
    w = Worker("q", prefix=prefix, concurrency=2, lease=5, hard_grace=5, loop_block_warning=0.3)
    ended: list[float] = []

    @w.handler
    def slow(job: JobContext) -> int:  # a plain def: runs in a thread, and cannot be cancelled
        if job.attempt == 1:
            time.sleep(1.2)
            ended.append(time.monotonic())
        return job.attempt

    @w.handler
    async def ticks(job: JobContext) -> str:  # needs the event loop twenty times
        for _ in range(20):
            await asyncio.sleep(0.01)
        return "ok"

    async with running(w, redis):
        # Given a sync handler sleeping 1.2 s on its first attempt, with a timeout of 0.3 s
        sleeper = await queue.add("slow", timeout=0.3, max_attempts=2, backoff=Backoff.fixed(0.05))
        await eventually(lambda: _in_state(queue, sleeper.id, JobState.ACTIVE))
        # When another job of the same process needs the loop meanwhile
        started = time.monotonic()
        other = await queue.add("ticks")
        # Then it completes on time, while the sleeper's thread is still asleep
        assert await other.result(timeout=5) == "ok"
        assert time.monotonic() - started < 0.8 and not ended
        # And the sleeper's first attempt is a timeout (reported once its thread returned), retried
        assert await sleeper.result(timeout=10) == 2
    record = await sleeper.info()
    assert (record.attempt, record.failures) == (2, 1)
    assert "AttemptTimeout: the attempt ran past its timeout of 0.3s" in (record.error or "")
    assert "returned a value, which was discarded" in (record.error or "")
    assert not [r for r in caplog.records if "event loop" in r.getMessage()]


async def test_a_sync_handler_sees_stop_requested_at_its_timeout(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    w = Worker("q", prefix=prefix, lease=5, hard_grace=5)
    seen: list[float] = []

    @w.handler
    def polite(job: JobContext) -> str:
        begun = time.monotonic()
        while not job.stop_requested:
            time.sleep(0.01)
        seen.append(time.monotonic() - begun)
        return "stopped early"

    async with running(w, redis):
        job = await queue.add("polite", timeout=0.2, max_attempts=1)
        with pytest.raises(JobFailed, match=r"AttemptTimeout: the attempt ran past its timeout of 0\.2s"):
            await job.result(timeout=5)
    assert len(seen) == 1 and 0.19 <= seen[0] < 1.0


async def test_a_handler_that_swallows_its_cancellation_is_not_a_success(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    w = Worker("q", prefix=prefix, concurrency=3, lease=5, hard_grace=5)

    @w.handler
    async def returns_anyway(job: JobContext) -> str:
        # Swallows every cancellation (the runner cancels again every 0.1 s) for 0.4 s, then returns.
        until = time.monotonic() + 0.4
        while time.monotonic() < until:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(until - time.monotonic())
        return "done anyway"

    @w.handler
    async def raises_instead(job: JobContext) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    @w.handler
    async def yields(job: JobContext) -> None:
        await asyncio.sleep(30)

    async with running(w, redis):
        swallowed = await queue.add("returns_anyway", timeout=0.2, max_attempts=1)
        raised = await queue.add("raises_instead", timeout=0.2, max_attempts=1)
        plain = await queue.add("yields", timeout=0.2, max_attempts=1)
        for job in (swallowed, raised, plain):
            with pytest.raises(JobFailed, match=r"AttemptTimeout: the attempt ran past its timeout of 0\.2s"):
                await job.result(timeout=5)
    errors = [(await job.info()).error or "" for job in (swallowed, raised, plain)]
    assert "went on after it was cancelled at its timeout" in errors[0]
    assert "returned a value, which was discarded" in errors[0]
    assert "raised RuntimeError: cleanup failed" in errors[1]
    assert "went on after" not in errors[2]
    counts = await queue.counts()
    assert (counts["completed"], counts["dead_total"]) == (0, 3)


async def test_a_blocked_event_loop_is_logged_once_with_its_length_and_where(
    redis: Redis, prefix: str, queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=WATCHDOG)
    w = Worker("q", prefix=prefix, lease=5, loop_block_warning=0.3)

    @w.handler
    async def blocker(job: JobContext) -> str:
        time.sleep(0.8)  # noqa: ASYNC251 - the very mistake the watchdog is there to see
        return "slept"

    async with running(w, redis):
        job = await queue.add("blocker")
        assert await job.result(timeout=5) == "slept"
        await asyncio.sleep(0.3)  # the watchdog logs the stall once the loop runs again
    stalls = [r for r in caplog.records if "event loop was blocked" in r.getMessage()]
    assert len(stalls) == 1, [r.getMessage() for r in caplog.records]
    stall = stalls[0]
    assert f"job {job.id} (blocker) held it" in stall.getMessage()
    assert 0.7 <= stall.blocked_s <= 1.5  # type: ignore[attr-defined]
    assert "test_timeouts.py" in stall.where and "in blocker" in stall.where  # type: ignore[attr-defined]


def test_hard_grace_and_loop_block_warning_are_checked() -> None:
    with pytest.raises(Exception, match="hard_grace must be > 0 seconds or None"):
        Worker("q", hard_grace=0)
    with pytest.raises(Exception, match="loop_block_warning must be > 0 seconds or None"):
        Worker("q").configure(loop_block_warning=-1)
    w = Worker("q", hard_grace=None, loop_block_warning=None)
    assert (w.hard_grace, w.loop_block_warning) == (None, None)
    assert w.configure(hard_grace=2).hard_grace == 2


# ---- in real processes -----------------------------------------------------------------------


@pytest.fixture
def procs(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[_Procs]:
    started = _Procs(redis_url, prefix, tmp_path)
    try:
        yield started
    finally:
        started.close()


async def test_an_async_handler_that_blocks_the_loop_is_stopped_hard_and_retried(
    redis: Redis, prefix: str, queue: Queue, procs: _Procs
) -> None:
    # Given worker A (hard grace 0.5 s) running two jobs: one whose first attempt calls
    # time.sleep(8) in an async handler with a timeout of 1 s, and one that behaves
    # (both added before A starts: A's first call leases both, before the blocker can block
    # its loop; added after, the bystander could find the loop already blocked; and the
    # blocker blocks only once the bystander has started, which it could otherwise not do)
    bystander = await queue.add("hold", {"hold": {"A": 30}})
    blocker = await queue.add(
        "block",
        {"block_on": [1], "seconds": 8, "after": [bystander.id]},
        timeout=1,
        max_attempts=2,
        backoff=Backoff.fixed(0.1),
    )
    a = procs.start("A", "--concurrency", "2", "--hard-grace", "0.5")
    await eventually(lambda: _runs_are(redis, prefix, [blocker.id, bystander.id], 1), timeout=15)
    started = time.monotonic()
    # When the loop stays blocked past the timeout and the grace
    # Then A ends itself with exit code 75, long before the 8 s sleep would end
    assert await a.wait_exit(timeout=10) == EXIT_HARD_STOPPED, a.log()
    assert time.monotonic() - started < 6, a.log()
    log = a.log()
    assert f"job {blocker.id} (block) attempt 1 of 2 ran" in log and "it blocked the event loop" in log, log
    assert "the event loop has been blocked for" in log, log
    # And the blocker's attempt was recorded as an overrun, the bystander released uncounted
    record = await queue.get_job(blocker.id)
    assert record is not None and record.state in (JobState.DELAYED, JobState.WAITING), record
    assert record.failures == 1 and "past its timeout of 1s" in (record.error or "")
    assert "stopped it hard by ending its process" in (record.error or "")
    held = await queue.get_job(bystander.id)
    assert held is not None and (held.state, held.attempt, held.failures) == (JobState.WAITING, 0, 0)
    counts = await queue.counts()
    assert (counts["released"], counts["stalled"], counts["overrun"], counts["failed"]) == (1, 0, 1, 1)
    # When another worker comes
    procs.start("B", "--concurrency", "2")
    # Then it runs both: the blocker's second attempt under a new token, and it succeeds
    assert await blocker.result(timeout=15) == {"worker": "B", "attempt": 2}
    assert await bystander.result(timeout=15) == {"worker": "B", "attempt": 1}
    block_runs = await runs(redis, prefix, blocker.id)
    assert [r.rsplit(":", 1)[0] for r in block_runs] == ["A:1", "B:2"]
    assert block_runs[0].rsplit(":", 1)[1] != block_runs[1].rsplit(":", 1)[1]


async def test_the_supervisor_replaces_a_child_stopped_hard_and_the_queue_drains(
    redis: Redis, prefix: str, queue: Queue, procs: _Procs
) -> None:
    # Given `sluice worker --processes 2`, and a job whose first attempt swallows every
    # cancellation and goes on for ever, among ten ordinary ones
    sup = procs.start("S", "--processes", "2", "--concurrency", "2", "--hard-grace", "0.5")
    await eventually(lambda: _children(sup, 2), timeout=15)
    first = {c.pid for c in sup.children()}
    stubborn = await queue.add(
        "swallow", {"swallow_on": [1]}, timeout=0.5, max_attempts=2, backoff=Backoff.fixed(0.1)
    )
    others = [await queue.add("hold", {}) for _ in range(10)]
    # When its timeout and the hard grace have passed
    # Then its process is ended, the supervisor starts another, and every job completes
    result: Any = await stubborn.result(timeout=20)
    assert result["attempt"] == 2
    for job in others:
        done: Any = await job.result(timeout=10)
        assert done["attempt"] == 1
    await sup.wait_log("was ended by its watchdog", timeout=10)
    assert "it went on after it was cancelled" in sup.log()
    now = {c.pid for c in sup.children()}
    assert len(now) == 2 and len(now & first) == 1, (first, now)
    record = await queue.get_job(stubborn.id)
    assert record is not None and record.failures == 1 and "stopped it hard" in (record.error or "")
    counts = await queue.counts()
    assert (counts["waiting"], counts["delayed"], counts["active"], counts["completed"]) == (0, 0, 0, 11)
    # And a SIGTERM still stops the supervisor and both children cleanly
    sup.send(signal.SIGTERM)
    assert await sup.wait_exit(timeout=15) == 0, sup.log()


async def test_a_sync_handler_that_never_returns_is_stopped_hard(
    redis: Redis, prefix: str, queue: Queue, procs: _Procs
) -> None:
    # Given a sync handler stuck for ever, with a timeout of 0.3 s and one attempt allowed
    a = procs.start("A", "--hard-grace", "0.3")
    stuck = await queue.add("stuck", timeout=0.3, max_attempts=1)
    # Then its process ends with code 75, and the job is dead-lettered with the overrun
    assert await a.wait_exit(timeout=10) == EXIT_HARD_STOPPED, a.log()
    overrun = r"ran \d+\.\ds past its timeout of 0\.3s and its thread did not return"
    with pytest.raises(JobFailed, match=overrun):
        await stuck.result(timeout=5)


async def test_a_paused_process_is_not_mistaken_for_a_blocked_loop(
    redis: Redis, prefix: str, queue: Queue, procs: _Procs
) -> None:
    # Given a worker running a job that yields, with a timeout of 0.5 s and a hard grace of 0.3 s
    a = procs.start("A", "--hard-grace", "0.3")
    job = await queue.add("hold", {"hold": {"A": 0.3}}, timeout=0.5, max_attempts=1)
    await eventually(lambda: _runs_are(redis, prefix, [job.id], 1), timeout=15)
    # When the whole process is stopped for longer than both (its watchdog thread too)
    a.send(signal.SIGSTOP)
    await asyncio.sleep(1.5)
    a.send(signal.SIGCONT)
    # Then the job ends as its loop decides (done, or cancelled at its timeout), and the
    # process is not stopped hard: its loop was never blocked by a handler
    await eventually(lambda: _finished(queue, job.id), timeout=10)
    await asyncio.sleep(1.0)
    assert a.popen.poll() is None, a.log()
    record = await queue.get_job(job.id)
    assert record is not None and "stopped it hard" not in (record.error or ""), record


# ---- the worker the processes run, and helpers ------------------------------------------------


def runs_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:test:runs:{job_id}"


async def runs(redis: Redis, prefix: str, job_id: str) -> list[str]:
    """Who started which attempt of a job, under which token ("<worker>:<attempt>:<token>")."""
    raw = await redis.lrange(runs_key(prefix, job_id), 0, -1)
    return [r.decode() if isinstance(r, bytes) else r for r in raw]


async def _started(redis_url: str, prefix: str, job_ids: list[str]) -> None:
    """Wait (up to 5 s) until each of these jobs has recorded a run."""
    client = connect(redis_url)
    try:
        for _ in range(500):
            if all([await client.llen(runs_key(prefix, i)) for i in job_ids]):
                return
            await asyncio.sleep(0.01)
    finally:
        await client.aclose()


def make_worker(redis_url: str, prefix: str) -> Worker:
    """The Worker of queue ``q`` that the processes run. Handlers, as the payload asks:

    * ``block``: ``time.sleep(seconds)`` on the attempts in ``block_on`` (blocks the loop);
    * ``swallow``: on the attempts in ``swallow_on``, swallows every cancellation for ever;
    * ``hold``: sleeps (yielding) ``hold[<worker id>]`` seconds;
    * ``stuck``: a sync handler that never returns.
    """
    w = Worker("q", prefix=prefix, lease=5, loop_block_warning=0.3)

    async def record(job: JobContext) -> dict[str, Any]:
        token = job.token.decode() if isinstance(job.token, bytes) else str(job.token)
        client = connect(redis_url)
        try:
            await client.rpush(runs_key(prefix, job.id), f"{job.worker_id}:{job.attempt}:{token}")
        finally:
            await client.aclose()
        return job.payload or {}

    def done(job: JobContext) -> dict[str, Any]:
        return {"worker": job.worker_id, "attempt": job.attempt}

    @w.handler
    async def block(job: JobContext) -> dict[str, Any]:
        payload = await record(job)
        if job.attempt in payload.get("block_on", []):
            await _started(redis_url, prefix, payload.get("after", []))
            time.sleep(payload["seconds"])  # noqa: ASYNC251 - the mistake under test
        return done(job)

    @w.handler
    async def swallow(job: JobContext) -> dict[str, Any]:
        payload = await record(job)
        if job.attempt in payload.get("swallow_on", []):
            while True:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600)
        return done(job)

    @w.handler
    async def hold(job: JobContext) -> dict[str, Any]:
        payload = await record(job)
        await asyncio.sleep(float(payload.get("hold", {}).get(job.worker_id, 0)))
        return done(job)

    @w.handler
    def stuck(job: JobContext) -> None:
        threading.Event().wait()  # never set

    return w


def __getattr__(name: str) -> Worker:
    # Built on first use (by `sluice worker tests.engine.test_timeouts:worker`), from the environment.
    if name == "worker":
        return make_worker(os.environ["SLUICE_TEST_REDIS"], os.environ["SLUICE_TEST_PREFIX"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Procs(WorkerProcs):
    """``sluice worker tests.engine.test_timeouts:worker`` processes of one test."""

    def start(self, worker_id: str, *options: str) -> WorkerProc:  # type: ignore[override]
        return self.launch(worker_id, TARGET, *options)


async def _in_state(queue: Queue, job_id: str, *states: JobState) -> bool:
    return await queue.job_state(job_id) in states


async def _runs_are(redis: Redis, prefix: str, job_ids: list[str], n: int) -> bool:
    counts = [len(await runs(redis, prefix, job_id)) for job_id in job_ids]
    return counts == [n] * len(job_ids)


async def _finished(queue: Queue, job_id: str) -> bool:
    return await queue.job_state(job_id) in (JobState.COMPLETED, JobState.DEAD)


async def _children(proc: WorkerProc, n: int) -> bool:
    return len(proc.children()) == n


async def test_running_worker_leaves_the_test_process_alive_past_the_hard_grace(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # In a worker process, this attempt would be stopped hard: the process exits 75. Inside a
    # test (running_worker), that would end the test run: the hard stop is off there.
    w = Worker("q", prefix=prefix, lease=5, hard_grace=0.1)

    @w.handler
    async def stuck(job: JobContext) -> str:
        time.sleep(0.8)  # noqa: ASYNC251 - blocks its own cancellation past timeout + hard_grace
        return "done"

    async with running(w, redis):
        job = await queue.add("stuck", timeout=0.2, max_attempts=1)
        # it ends (the loop was blocked when its timeout came, so it may count as done)
        await eventually(lambda: _in_state(queue, job.id, JobState.COMPLETED, JobState.DEAD), timeout=5)
    assert w.hard_grace == 0.1  # given back when the block ends
