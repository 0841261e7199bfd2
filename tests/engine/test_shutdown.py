"""Graceful shutdown of real ``sluice worker`` processes, driven by real signals.

SIGTERM (or SIGINT) stops taking jobs and gives in-flight ones the worker's
shutdown grace; jobs still running after it are released back to waiting
without counting the attempt; a second signal releases them at once. With
``--processes N`` the supervisor forwards one signal to every child.

Jobs here wait for a "gate" file that the test creates when they may finish.
Handlers that lose or ignore a cancellation (tests/harness/proc_workers.py) check that
a stop still ends them; the last tests stop workers in the test's own loop at
moments when redis-py is known to lose a cancellation (Python 3.11).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sluice import Job, JobState, Queue
from tests.conftest import eventually
from tests.harness.proc_harness import (
    HELPER_TASKS,
    WorkerProcs,
    open_gate,
    runs,
    serving,
    start_in_loop,
    stop_in_loop,
)
from tests.harness.proc_workers import FOREVER, make_worker

pytestmark = pytest.mark.slow


@pytest.fixture
def procs(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[WorkerProcs]:
    with WorkerProcs(redis_url, prefix, tmp_path) as p:
        yield p


@pytest.fixture
def gate(tmp_path: Path) -> Path:
    """Gated jobs finish once this file exists."""
    return tmp_path / "gate"


async def all_started(redis: Redis, prefix: str, jobs: list[Job], expected: list[str]) -> None:
    """Wait until the jobs' runs, together and sorted, are ``expected``."""

    async def check() -> bool:
        seen = [await runs(redis, prefix, j.id) for j in jobs]
        return sorted(r for job_runs in seen for r in job_runs) == sorted(expected)

    await eventually(check, timeout=15)


async def test_sigterm_finishes_in_flight_jobs_and_takes_no_new_ones(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue, gate: Path
) -> None:
    # Given a worker process with a free slot (concurrency 3), running 2 gated jobs
    jobs = [await queue.add("task", {"gate": str(gate)}) for _ in range(2)]
    w = procs.start("w", concurrency=3, grace=30.0)
    await all_started(redis, prefix, jobs, ["w:1", "w:1"])

    # When it gets SIGTERM, and then a new job arrives
    w.send(signal.SIGTERM)
    await w.wait_log("worker stopping")
    late = await queue.add("task")

    # Then it does not take the new job, although a slot is free
    await asyncio.sleep(1.0)
    assert w.popen.poll() is None
    assert await late.state() is JobState.WAITING
    assert (await queue.counts())["active"] == 2

    # When the in-flight jobs may finish
    await open_gate(gate)

    # Then they complete on it, and it exits with 0
    assert await w.wait_exit() == 0
    for job in jobs:
        assert await job.result(timeout=5) == {"worker": "w", "attempt": 1}
    record = await late.info()
    assert (record.state, record.attempt) == (JobState.WAITING, 0)
    assert await runs(redis, prefix, late.id) == []
    counts = await queue.counts()
    assert (counts["completed"], counts["released"], counts["stalled"]) == (2, 0, 0)
    assert (counts["waiting"], counts["active"]) == (1, 0)


async def test_jobs_unfinished_after_the_grace_are_released_uncounted(
    procs: WorkerProcs, redis: Redis, redis_url: str, prefix: str, queue: Queue, gate: Path
) -> None:
    # Given a worker process with a 1 s grace, running 2 gated jobs
    jobs = [await queue.add("task", {"gate": str(gate)}) for _ in range(2)]
    w = procs.start("w", concurrency=2, grace=1.0)
    await all_started(redis, prefix, jobs, ["w:1", "w:1"])

    # When it gets SIGTERM and the gate stays shut
    w.send(signal.SIGTERM)

    # Then after the grace it releases both back to waiting, and exits with 0
    assert await w.wait_exit() == 0
    for job in jobs:
        record = await job.info()
        assert (record.state, record.attempt, record.stalls, record.failures) == (JobState.WAITING, 0, 0, 0)
    counts = await queue.counts()
    assert (counts["released"], counts["waiting"], counts["active"]) == (2, 2, 0)
    assert (counts["stalled"], counts["failed"], counts["completed"]) == (0, 0, 0)

    # When the gate opens and another worker comes along
    await open_gate(gate)
    later = make_worker(redis_url, prefix, concurrency=2, shutdown_grace=2.0, worker_id="later")
    async with serving(later, redis_url):
        results = [await job.result(timeout=15) for job in jobs]

    # Then it completes them, on what counts as their first attempt
    assert results == [{"worker": "later", "attempt": 1}] * 2
    for job in jobs:
        assert await runs(redis, prefix, job.id) == ["w:1", "later:1"]
    counts = await queue.counts()
    assert (counts["completed"], counts["released"], counts["stalled"]) == (2, 2, 0)


async def test_second_signal_releases_at_once(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue, gate: Path
) -> None:
    # Given a worker process with a grace far longer than this test, running 2 gated jobs
    jobs = [await queue.add("task", {"gate": str(gate)}) for _ in range(2)]
    w = procs.start("w", concurrency=2, grace=300.0)
    await all_started(redis, prefix, jobs, ["w:1", "w:1"])

    # When it gets SIGTERM, and once it is stopping, SIGINT
    w.send(signal.SIGTERM)
    await w.wait_log("worker stopping")
    assert w.popen.poll() is None
    w.send(signal.SIGINT)

    # Then it releases both jobs without waiting out the grace, and exits with 0
    assert await w.wait_exit(timeout=15) == 0
    for job in jobs:
        record = await job.info()
        assert (record.state, record.attempt) == (JobState.WAITING, 0)
    counts = await queue.counts()
    assert (counts["released"], counts["waiting"], counts["completed"]) == (2, 2, 0)


async def test_release_reaches_a_handler_that_lost_the_first_cancel(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a worker process running a job whose handler carries on through the
    # first cancellation (as one does when a library swallows it), with a lease
    # long enough that it does not expire during this test
    job = await queue.add("task", {"hold": {"w": FOREVER}, "lose_cancels": 1})
    w = procs.start("w", lease=5.0, grace=300.0)
    await all_started(redis, prefix, [job], ["w:1"])

    # When it gets SIGTERM and, once stopping, SIGINT (release now)
    w.send(signal.SIGTERM)
    await w.wait_log("worker stopping")
    w.send(signal.SIGINT)

    # Then the worker does not wait for ever on the handler: it releases the
    # job uncounted and exits with 0
    assert await w.wait_exit(timeout=15) == 0
    record = await job.info()
    assert (record.state, record.attempt, record.stalls) == (JobState.WAITING, 0, 0)
    counts = await queue.counts()
    assert (counts["released"], counts["stalled"]) == (1, 0), counts


async def test_a_handler_slow_to_wind_down_is_released_not_stalled(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a worker process (1 s lease) running a job whose handler, once
    # cancelled, needs 3 s to wind down
    job = await queue.add("task", {"hold": {"w": FOREVER}, "linger": 3.0})
    w = procs.start("w", lease=1.0, grace=300.0)
    await all_started(redis, prefix, [job], ["w:1"])

    # When it gets SIGTERM and, once stopping, SIGINT (release now)
    w.send(signal.SIGTERM)
    await w.wait_log("worker stopping")
    w.send(signal.SIGINT)

    # Then the worker keeps the job leased while the handler winds down, and
    # releases it uncounted: the job never looks abandoned
    assert await w.wait_exit(timeout=15) == 0
    record = await job.info()
    assert (record.state, record.attempt, record.stalls) == (JobState.WAITING, 0, 0)
    counts = await queue.counts()
    assert (counts["released"], counts["stalled"], counts["stale_refused"]) == (1, 0, 0), counts


async def test_stop_right_after_jobs_finish_ends_the_waker(redis_url: str, prefix: str, queue: Queue) -> None:
    # A stop that arrives just as the worker goes idle (its waker is sending
    # BZPOPMIN) once hung run() for good: redis-py lost the waker's cancellation.
    for round_ in range(5):
        # Given a worker in this loop that has just finished 2 jobs added before it started
        jobs = [await queue.add("task") for _ in range(2)]
        w = make_worker(redis_url, prefix, concurrency=2, shutdown_grace=2.0, worker_id=f"w{round_}")
        task, client = start_in_loop(w, redis_url)
        for job in jobs:
            assert await job.result(timeout=10) == {"worker": f"w{round_}", "attempt": 1}

        # When it is stopped at once
        # Then run() returns, and its waker does not outlive it
        await stop_in_loop(w, task, client, strict=frozenset({"sluice-waker"}))


async def test_stop_ends_a_reaper_that_is_busy_with_redis(redis_url: str, prefix: str) -> None:
    # A helper cancelled while redis-py sends its command can lose the cancel
    # (asyncio.wait_for on Python 3.11); the helpers must still end with run().
    for round_ in range(6):
        # Given a worker in this loop whose reaper sends a command every millisecond
        w = make_worker(redis_url, prefix, reap_interval=0.001, worker_id=f"w{round_}")
        task, client = start_in_loop(w, redis_url)
        await asyncio.sleep(0.1)

        # When it is stopped
        # Then run() returns, and none of its helpers outlives it
        await stop_in_loop(w, task, client, strict=HELPER_TASKS)


async def test_processes_share_the_queue_and_stop_on_one_sigterm(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue, gate: Path
) -> None:
    # Given `sluice worker --processes 2` (one job at a time each) and 2 gated jobs
    jobs = [await queue.add("task", {"gate": str(gate)}) for _ in range(2)]
    parent = procs.start("multi", processes=2, concurrency=1, grace=30.0)

    # Then each process takes one job
    await all_started(redis, prefix, jobs, ["multi-1:1", "multi-2:1"])
    children = parent.children()
    assert len(children) == 2

    # When the parent alone gets one SIGTERM
    parent.send(signal.SIGTERM)

    # Then both children stop taking jobs (a new one stays waiting), finish
    # their in-flight jobs, and exit, and so does the parent, with 0
    await parent.wait_log("worker stopping", count=2)
    late = await queue.add("task")
    await open_gate(gate)
    assert await parent.wait_exit() == 0
    assert not any(child.is_running() for child in children)
    results = [await job.result(timeout=5) for job in jobs]
    assert sorted(r["worker"] for r in results if isinstance(r, dict)) == ["multi-1", "multi-2"]
    assert await late.state() is JobState.WAITING
    counts = await queue.counts()
    assert (counts["completed"], counts["released"], counts["waiting"], counts["active"]) == (2, 0, 1, 0)
