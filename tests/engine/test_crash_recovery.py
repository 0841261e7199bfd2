"""Workers that die or freeze, in real processes: their jobs run again elsewhere.

Each test starts ``sluice worker`` processes (tests/harness/proc_workers.py) with a 1 s
lease, kills or freezes them with real signals, and lets another worker
(in this test's event loop) pick up the pieces. Assertions are on the job
records and the queue's counters, never on durations.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sluice import JobFailed, JobState, Queue, Worker
from tests.conftest import eventually
from tests.harness.proc_harness import WorkerProcs, runs, serving
from tests.harness.proc_workers import FOREVER, make_worker

pytestmark = pytest.mark.slow

LEASE = 1.0


@pytest.fixture
def procs(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[WorkerProcs]:
    with WorkerProcs(redis_url, prefix, tmp_path) as p:
        yield p


def rescuer(redis_url: str, prefix: str, worker_id: str, concurrency: int = 1) -> Worker:
    """An in-test worker with the same lease, reaping often."""
    return make_worker(
        redis_url,
        prefix,
        lease=LEASE,
        reap_interval=0.1,
        shutdown_grace=2.0,
        concurrency=concurrency,
        worker_id=worker_id,
    )


async def completed_events(redis: Redis, queue: Queue, job_id: str) -> int:
    """How many "completed" events the queue's stream holds for the job."""
    entries = await redis.xrange(queue.keys.events, "-", "+") or []
    wanted = {b"ev": b"completed", b"id": job_id.encode()}
    return len([f for _, f in entries if f and all(f.get(k) == v for k, v in wanted.items())])


async def test_sigkilled_workers_jobs_are_completed_by_another_worker(
    procs: WorkerProcs, redis: Redis, redis_url: str, prefix: str, queue: Queue
) -> None:
    # Given 5 jobs, and a worker process (concurrency 3) on which they never finish
    jobs = [await queue.add("task", {"hold": {"doomed": FOREVER}}) for _ in range(5)]
    doomed = procs.start("doomed", lease=LEASE, concurrency=3)

    async def three_started() -> bool:
        return sum([await runs(redis, prefix, j.id) == ["doomed:1"] for j in jobs]) == 3

    await eventually(three_started, timeout=15)
    counts = await queue.counts()
    assert (counts["active"], counts["waiting"]) == (3, 2)
    crashed = {j.id for j in jobs if await runs(redis, prefix, j.id) == ["doomed:1"]}

    # When the process is killed outright (no chance to release anything)
    doomed.send(signal.SIGKILL)
    assert await doomed.wait_exit() == -signal.SIGKILL

    # and another worker starts
    async with serving(rescuer(redis_url, prefix, "rescuer", concurrency=5), redis_url):
        results = [await j.result(timeout=15) for j in jobs]

    # Then every job completed, on the rescuer; the three that were running
    # stalled once and completed on their second attempt; nothing was lost
    for job, result in zip(jobs, results, strict=True):
        record = await job.info()
        assert record.state is JobState.COMPLETED
        if job.id in crashed:
            assert result == {"worker": "rescuer", "attempt": 2}
            assert (record.stalls, record.attempt) == (1, 2)
            assert await runs(redis, prefix, job.id) == ["doomed:1", "rescuer:2"]
        else:
            assert result == {"worker": "rescuer", "attempt": 1}
            assert (record.stalls, record.attempt) == (0, 1)
            assert await runs(redis, prefix, job.id) == ["rescuer:1"]
        assert await completed_events(redis, queue, job.id) == 1
    counts = await queue.counts()
    assert counts["completed"] == 5
    assert counts["stalled"] == 3
    assert counts["stale_refused"] == 0
    assert (counts["waiting"], counts["active"], counts["delayed"], counts["dead"]) == (0, 0, 0, 0)


async def test_single_crashed_job_counts_one_stall(
    procs: WorkerProcs, redis: Redis, redis_url: str, prefix: str, queue: Queue
) -> None:
    # Given a worker process that has started a job it will never finish
    job = await queue.add("task", {"hold": {"doomed": FOREVER}})
    doomed = procs.start("doomed", lease=LEASE)

    async def started() -> bool:
        return await runs(redis, prefix, job.id) == ["doomed:1"]

    await eventually(started, timeout=15)

    # When it is SIGKILLed and a second worker process starts
    doomed.send(signal.SIGKILL)
    await doomed.wait_exit()
    procs.start("second", lease=LEASE)

    # Then the second process completes the job after the lease expires
    assert await job.result(timeout=15) == {"worker": "second", "attempt": 2}
    record = await job.info()
    assert (record.state, record.stalls, record.attempt, record.worker) == (
        JobState.COMPLETED,
        1,
        2,
        "second",
    )
    counts = await queue.counts()
    assert (counts["stalled"], counts["completed"], counts["stale_refused"]) == (1, 1, 0)


async def test_frozen_workers_late_completion_is_refused(
    procs: WorkerProcs, redis: Redis, redis_url: str, prefix: str, queue: Queue
) -> None:
    # Given a worker process running a job that takes it `hold` seconds
    # (any other worker finishes it at once)
    hold = 3.0
    job = await queue.add("task", {"hold": {"zombie": hold}})
    zombie = procs.start("zombie", lease=LEASE)

    async def started() -> bool:
        return await runs(redis, prefix, job.id) == ["zombie:1"]

    await eventually(started, timeout=15)
    loop = asyncio.get_running_loop()
    handler_done_by = loop.time() + hold
    # The handler logs its start, then starts its sleep: on a loaded machine a SIGSTOP sent at
    # once can land in between, and the sleep would start only when thawed. Well within the lease:
    await asyncio.sleep(0.2)

    # When the process is frozen (SIGSTOP) past its lease, and another worker takes over
    zombie.send(signal.SIGSTOP)
    record = await job.info()
    assert (record.state, record.worker) == (JobState.ACTIVE, "zombie"), "frozen too late"
    async with serving(rescuer(redis_url, prefix, "rescuer"), redis_url):
        assert await job.result(timeout=15) == {"worker": "rescuer", "attempt": 2}
    assert (await queue.counts())["stale_refused"] == 0

    # and the zombie is thawed (SIGCONT) once its handler's sleep has run out,
    # so the handler finishes before the zombie can notice its lease is gone
    await asyncio.sleep(max(0.0, handler_done_by + 0.3 - loop.time()))
    zombie.send(signal.SIGCONT)

    # Then the zombie reports its completion, which is refused
    async def refused() -> bool:
        return (await queue.counts())["stale_refused"] == 1

    await eventually(refused, timeout=10)
    await zombie.wait_log("outcome refused")

    # and the job completed exactly once, with the second worker's result
    record = await job.info()
    assert record.state is JobState.COMPLETED
    assert record.result == {"worker": "rescuer", "attempt": 2}
    assert (record.attempt, record.stalls, record.worker) == (2, 1, "rescuer")
    assert await runs(redis, prefix, job.id) == ["zombie:1", "rescuer:2"]
    assert await completed_events(redis, queue, job.id) == 1
    counts = await queue.counts()
    assert (counts["completed"], counts["stalled"], counts["stale_refused"]) == (1, 1, 1)
    assert (counts["waiting"], counts["active"], counts["dead"]) == (0, 0, 0)

    # and the zombie, idle again, still shuts down cleanly
    zombie.send(signal.SIGTERM)
    assert await zombie.wait_exit() == 0


async def test_job_whose_workers_keep_dying_is_dead_lettered(
    procs: WorkerProcs, redis: Redis, redis_url: str, prefix: str, queue: Queue
) -> None:
    # Given a job allowed one stall, which never finishes on "doomed-1" or "doomed-2"
    job = await queue.add("task", {"hold": {"doomed-1": FOREVER, "doomed-2": FOREVER}}, max_stalls=1)

    async def started_on(*expected: str) -> bool:
        return await runs(redis, prefix, job.id) == list(expected)

    # When doomed-1 starts it and is SIGKILLed
    first = procs.start("doomed-1", lease=LEASE)
    await eventually(lambda: started_on("doomed-1:1"), timeout=15)
    first.send(signal.SIGKILL)
    await first.wait_exit()

    # and doomed-2 takes it over after the lease expires, and is SIGKILLed too
    second = procs.start("doomed-2", lease=LEASE)
    await eventually(lambda: started_on("doomed-1:1", "doomed-2:2"), timeout=15)
    record = await job.info()
    assert (record.state, record.stalls) == (JobState.ACTIVE, 1)
    second.send(signal.SIGKILL)
    await second.wait_exit()

    # and a healthy worker comes along
    async with serving(rescuer(redis_url, prefix, "survivor"), redis_url):
        # Then the job is dead-lettered when its lease expires a second time
        with pytest.raises(JobFailed, match="lease expired 2 times") as failed:
            await job.result(timeout=15)

    # with an error naming the lease expiry and the last worker, and nobody ran it again
    assert "doomed-2" in failed.value.error
    record = await job.info()
    assert record.state is JobState.DEAD
    assert record.error is not None
    assert record.error.startswith("lease expired 2 times (worker lost or hung)")
    assert (record.stalls, record.attempt, record.failures) == (2, 2, 0)
    assert await runs(redis, prefix, job.id) == ["doomed-1:1", "doomed-2:2"]
    assert await queue.ids(JobState.DEAD) == [job.id]
    counts = await queue.counts()
    assert (counts["stalled"], counts["dead"], counts["dead_total"]) == (2, 1, 1)
    assert (counts["completed"], counts["failed"], counts["waiting"], counts["active"]) == (0, 0, 0, 0)
