"""Hosts whose clocks disagree still agree on time: the scripts read Redis's.

Two worker processes run with wall clocks 30 s ahead of and 30 s behind this
host (tests/harness/skewed_workers.py). Before the scripts read ``TIME``, the one
ahead reaped the other's live jobs (their lease deadlines looked 30 s past)
and the request-rate window was judged on two clocks a minute apart.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from sluice import JobSpec, JobState, Queue
from sluice.engine.clock import queue_now_ms
from tests.conftest import eventually
from tests.engine.test_flow import both_idle
from tests.harness.flow_workers import spans_key
from tests.harness.proc_harness import WorkerProc, WorkerProcs

pytestmark = pytest.mark.slow

SKEWS_MS = {"ahead": 30_000, "behind": -30_000}


@pytest.fixture
def procs(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[WorkerProcs]:
    with WorkerProcs(redis_url, prefix, tmp_path) as p:
        yield p


def start_skewed(
    procs: WorkerProcs, worker_id: str, skew_ms: int, *, lease: float, concurrency: int
) -> WorkerProc:
    """A flow-test worker process whose wall clock is ``skew_ms`` off."""
    env = {"SLUICE_TEST_CLOCK_SKEW_MS": str(skew_ms), "SLUICE_TEST_LEASE": str(lease)}
    return procs.launch(
        worker_id, "tests.harness.skewed_workers:worker", "--concurrency", str(concurrency), env=env
    )


async def test_the_workers_clocks_really_are_apart(procs: WorkerProcs, redis: Redis, queue: Queue) -> None:
    """The premise of the tests below: each worker's own clock is off by its skew."""
    for wid, skew in SKEWS_MS.items():
        start_skewed(procs, wid, skew, lease=5.0, concurrency=1)
    await both_idle(redis, queue)
    jobs = await queue.add_bulk(JobSpec("probe") for _ in range(6))
    await asyncio.gather(*(j.result(timeout=15) for j in jobs))
    redis_now = await queue_now_ms(queue)
    recorded = await redis.hgetall(spans_key(procs.prefix))
    offsets: dict[str, list[int]] = {}
    for raw in recorded.values():
        span = orjson.loads(raw)
        offsets.setdefault(span["worker"], []).append(span["start"] - redis_now)
    # each ran a job, stamping it with its own clock: 30 s ahead or behind (give or take the run)
    assert set(offsets) == {"ahead", "behind"}, offsets
    assert all(25_000 < o < 31_000 for o in offsets["ahead"]), offsets
    assert all(-35_000 < o < -29_000 for o in offsets["behind"]), offsets


async def test_no_live_job_is_reaped_when_clocks_are_30s_apart(
    procs: WorkerProcs, redis: Redis, queue: Queue
) -> None:
    # Given two workers 60 s apart, leases of 2 s, and jobs that run 3 s (renewed twice)
    for wid, skew in SKEWS_MS.items():
        start_skewed(procs, wid, skew, lease=2.0, concurrency=3)
    await both_idle(redis, queue)

    # When six such jobs run, both workers reaping every second or so
    jobs = await queue.add_bulk(JobSpec("probe", {"sleep": 3.0}, max_stalls=5) for _ in range(6))
    await asyncio.gather(*(j.result(timeout=30) for j in jobs))

    # Then every job ran once: no lease was judged expired early, none ran twice
    records = [r for r in await queue.get_jobs([j.id for j in jobs]) if r is not None]
    assert [(r.state, r.attempt, r.stalls) for r in records] == [(JobState.COMPLETED, 1, 0)] * 6
    counts = await queue.counts()
    assert (counts["stalled"], counts["completed"]) == (0, 6)
    # and both workers ran some of them
    assert {r.worker for r in records} == {"ahead", "behind"}


async def test_a_rate_limit_is_exact_when_clocks_are_30s_apart(
    procs: WorkerProcs, redis: Redis, queue: Queue
) -> None:
    # Given at most 4 starts per second (the log alone: no pacer), and two workers 60 s apart
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_rate_limit(4, per=1)
    for wid, skew in SKEWS_MS.items():
        start_skewed(procs, wid, skew, lease=5.0, concurrency=2)
    await both_idle(redis, queue)

    # When 12 short jobs are added
    t0 = time.monotonic()
    jobs = await queue.add_bulk(JobSpec("probe") for _ in range(12))
    await asyncio.gather(*(j.result(timeout=20) for j in jobs))
    took = time.monotonic() - t0

    # Then, on Redis's clock (which stamps the dispatch times), every 5 consecutive
    # starts span at least a second, and the limit is not stricter than asked
    records = [r for r in await queue.get_jobs([j.id for j in jobs]) if r is not None]
    starts = sorted(r.started_ms for r in records if r.started_ms is not None)
    assert len(starts) == 12
    assert min(b - a for a, b in zip(starts, starts[4:], strict=False)) >= 1000, starts
    assert starts[3] - starts[0] < 500, starts
    assert took < 6, took
    assert {r.worker for r in records} == {"ahead", "behind"}
    assert max(b - a for a, b in itertools.pairwise(starts)) < 1500, starts


async def test_a_killed_worker_leaves_the_workers_list(
    procs: WorkerProcs, redis: Redis, queue: Queue
) -> None:
    # Given two workers with 0.5 s leases, heartbeating every third of a lease
    doomed = start_skewed(procs, "doomed", 0, lease=0.5, concurrency=1)
    start_skewed(procs, "survivor", 0, lease=0.5, concurrency=1)
    await both_idle(redis, queue)
    assert [w.id for w in await queue.workers()] == ["doomed", "survivor"]

    # When one is killed without a word (no goodbye heartbeat)
    doomed.send(signal.SIGKILL)
    await doomed.wait_exit()

    # Then within two leases it is no longer listed, and the survivor's next
    # heartbeat removes it from Redis too: the hash does not grow with crashes
    async def forgotten() -> bool:
        listed = [w.id for w in await queue.workers()]
        keys: Any = await redis.hkeys(queue.keys.workers)
        members: Any = await redis.zrange(queue.keys.alive, 0, -1)
        stored = sorted(k.decode() for k in keys)
        alive = sorted(m.decode() for m in members)
        return listed == stored == alive == ["survivor"]

    await eventually(forgotten, timeout=5)
