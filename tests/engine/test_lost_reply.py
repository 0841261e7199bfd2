"""A dispatch call whose reply is lost is answered again, not run twice.

The worker sends each dispatch call with a request id and, when the reply
does not arrive (the connection broke after the script ran), sends the same
call again. The script recognises the id of the worker's last call and
answers from the record it kept: the same outcome codes, and the jobs that
call leased that are still leased to the worker. Before, those leases
belonged to nobody until they expired, and the outcomes were refused as stale.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice import JobContext, JobState, Queue, Worker
from sluice.engine import pump as pump_module
from tests.conftest import running
from tests.harness.stepping import leased

LEASE_MS = 60_000


async def test_the_same_call_sent_again_is_answered_from_what_it_did(queue: Queue) -> None:
    jobs = [await queue.add("a", i) for i in range(3)]
    step = queue.protocol.step
    first = await step(want=2, lease_ms=LEASE_MS, worker_id="w", request_id="x-1")
    assert [i for i, _ in leased(first)] == [jobs[0].id, jobs[1].id]

    # Sent again: the same jobs with the same tokens, and nothing more leased
    again = await step(want=2, lease_ms=LEASE_MS, worker_id="w", request_id="x-1")
    assert (again.codes, again.jobs) == (first.codes, first.jobs)
    counts = await queue.counts()
    assert (counts["active"], counts["waiting"]) == (2, 1)

    # Outcomes: the codes of the first run come back, and nothing is counted twice
    done = [(job_id, token, b"c", b"1", 0, -1) for job_id, token in leased(first)]
    reply = await step(want=0, lease_ms=LEASE_MS, worker_id="w", outcomes=done, request_id="x-2")
    assert reply.codes == [1, 1]
    again = await step(want=0, lease_ms=LEASE_MS, worker_id="w", outcomes=done, request_id="x-2")
    assert again.codes == [1, 1]
    assert (await queue.counts())["completed"] == 2

    # A new request id is a new call; another worker's record is its own
    other = await step(want=1, lease_ms=LEASE_MS, worker_id="v", request_id="x-2")
    assert [i for i, _ in leased(other)] == [jobs[2].id]


async def test_a_replayed_lease_that_was_lost_meanwhile_is_not_handed_out(queue: Queue) -> None:
    job = await queue.add("a")
    step = queue.protocol.step
    reply = await step(now=1_000, want=1, lease_ms=100, worker_id="w", request_id="y-1")
    assert [i for i, _ in leased(reply)] == [job.id]
    # the lease expires and another worker takes the job
    assert await queue.protocol.reap(now=2_000) == (1, 0)
    taken = await step(now=2_000, want=1, lease_ms=LEASE_MS, worker_id="v", request_id="z-1")
    assert [i for i, _ in leased(taken)] == [job.id]
    # the first worker's call, sent again, no longer hands it out
    again = await step(now=2_001, want=1, lease_ms=100, worker_id="w", request_id="y-1")
    assert again.jobs == []


async def test_a_worker_whose_dispatch_reply_is_lost_runs_the_jobs_it_leased(
    redis: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker whose connection breaks right after each of its first two
    # dispatch calls ran in Redis (the script's work is done, the reply is lost)
    real_call = pump_module.Wire.call
    lost = 0

    async def call_then_lose_reply(self: Any, keys: list[str], args: list[Any]) -> Any:
        nonlocal lost
        reply = await real_call(self, keys, args)
        if lost < 2 and args[1] > 0:  # a call that asked for jobs
            lost += 1
            await self._conn.disconnect()
            raise RedisConnectionError("connection lost before the reply was read")
        return reply

    monkeypatch.setattr(pump_module.Wire, "call", call_then_lose_reply)
    queue = Queue("q", redis=redis, prefix=prefix)
    jobs = [await queue.add("work", i) for i in range(4)]
    w = Worker("q", prefix=prefix, concurrency=4, lease=30.0)
    runs: list[str] = []

    @w.handler
    async def work(job: JobContext) -> int:
        runs.append(job.id)
        return int(job.payload)

    # When it runs: the jobs its lost calls leased run at once (not after a 30 s lease)
    async with running(w, redis):
        results = await asyncio.wait_for(asyncio.gather(*(j.result(timeout=10) for j in jobs)), 10)
    assert results == [0, 1, 2, 3]
    assert lost == 2
    # Then each ran once, on its first attempt, with no stall
    assert sorted(runs) == sorted(j.id for j in jobs)
    records = [r for r in await queue.get_jobs([j.id for j in jobs]) if r is not None]
    assert [(r.state, r.attempt, r.stalls) for r in records] == [(JobState.COMPLETED, 1, 0)] * 4
    await queue.close()
