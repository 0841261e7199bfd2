"""Retention: finished jobs are kept as long and as many as the queue's setting says.

The setting lives in Redis, so every client applies the same one. Records
expire with their kind's age; the trim script forgets the oldest past a count
(and the index entries of expired records) in bounded steps, with their
idempotency keys and reservations; a worker runs it with its reaper.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import ConfigurationError, JobContext, JobSpec, Queue, Worker
from sluice.engine.retention import KINDS, Retention
from sluice.testing import running_worker
from tests.conftest import eventually
from tests.harness.stepping import lease_pairs

#: The defaults as docs/using.md and sluice.engine.retention state them.
DOCUMENTED = {
    "completed": Retention(age=86_400.0, count=1_000_000),
    "dead": Retention(age=30 * 86_400.0, count=100_000),
    "cancelled": Retention(age=86_400.0, count=100_000),
    "rejected": Retention(age=86_400.0, count=100_000),
    "exhausted": Retention(age=30 * 86_400.0, count=100_000),
}
LEASE_MS = 60_000


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def finish(queue: Queue, specs: list[JobSpec], kind: bytes = b"c") -> list[str]:
    """Add ``specs``, lease them all and hand in ``kind`` for each (c completes, p dead-letters)."""
    ids = [job.id for job in await queue.add_bulk(specs)]
    leased: list[tuple[str, bytes]] = []
    while len(leased) < len(ids):
        reply = await queue.protocol.step(want=100, lease_ms=LEASE_MS, worker_id="w")
        leased += lease_pairs(reply.jobs)
    for i in range(0, len(leased), 16):
        outcomes = [(job_id, token, kind, b'"ok"', 0, -1) for job_id, token in leased[i : i + 16]]
        await queue.protocol.step(want=0, lease_ms=LEASE_MS, worker_id="w", outcomes=outcomes)
    return ids


async def test_the_defaults_are_the_documented_ones(queue: Queue) -> None:
    assert await queue.retention() == DOCUMENTED
    assert tuple(DOCUMENTED) == KINDS


async def test_a_setting_is_the_queues_and_every_client_sees_it(
    queue: Queue, redis: Redis, prefix: str
) -> None:
    assert await queue.set_retention("completed", age=60, count=10) == Retention(60.0, 10)
    other = Queue(queue.name, redis=redis, prefix=prefix)
    assert (await other.retention())["completed"] == Retention(60.0, 10)
    # a limit not given stays; None lifts one
    assert await other.set_retention("completed", count=None) == Retention(60.0, None)
    assert await other.set_retention("dead", age=None) == Retention(None, 100_000)
    assert (await queue.retention())["dead"] == Retention(None, 100_000)


@pytest.mark.parametrize(
    ("kind", "age", "count", "says"),
    [
        ("finished", 1, 1, "not a kind of finished job"),
        ("completed", -1, 1, "out of range"),
        ("completed", 0, 1, "out of range"),
        ("completed", 400 * 86_400, 1, "out of range"),
        ("completed", float("nan"), 1, "not a number"),
        ("completed", "1h", 1, "not a number"),
        ("completed", 1, 0, "count 0 is not usable"),
        ("completed", 1, 2.5, "not usable"),
        ("completed", 1, True, "not usable"),
    ],
)
async def test_bad_settings_say_what_is_wrong_and_change_nothing(
    queue: Queue, kind: str, age: object, count: object, says: str
) -> None:
    with pytest.raises(ConfigurationError, match=says):
        await queue.set_retention(kind, age=age, count=count)  # type: ignore[arg-type]
    assert await queue.retention() == DOCUMENTED


def test_keep_finished_is_refused_with_the_way_to_set_it(redis: Redis) -> None:
    with pytest.raises(ConfigurationError, match=r"set_retention\('completed', age=60\)"):
        Queue("q", redis=redis, keep_finished=60)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="sluice retention set completed --age 60"):
        Worker(keep_finished=60)  # type: ignore[arg-type]


async def test_a_finished_record_expires_with_its_kinds_age(queue: Queue, redis: Redis) -> None:
    await queue.set_retention("completed", age=50)
    await queue.set_retention("dead", age=500)
    [done] = await finish(queue, [JobSpec("a")])
    [dead] = await finish(queue, [JobSpec("a")], kind=b"p")
    assert 45_000 < await redis.pttl(queue.keys.job(done)) <= 50_000
    assert 495_000 < await redis.pttl(queue.keys.job(dead)) <= 500_000
    assert await redis.zrange(queue.keys.finished_prefix + "completed", 0, -1) == [done.encode()]
    assert await redis.zrange(queue.keys.dead, 0, -1) == [dead.encode()]
    # a redriven job lives again: its record no longer expires
    assert await queue.redrive([dead]) == 1
    assert await redis.pttl(queue.keys.job(dead)) == -1


async def test_a_cancelled_job_is_kept_as_cancelled(queue: Queue, redis: Redis) -> None:
    await queue.set_retention("cancelled", age=30)
    job = await queue.add("a", delay=60)
    assert await queue.cancel(job.id)
    assert 25_000 < await redis.pttl(queue.keys.job(job.id)) <= 30_000
    assert await redis.zrange(queue.keys.finished_prefix + "cancelled", 0, -1) == [job.id.encode()]


async def test_trim_forgets_the_oldest_past_the_count_with_their_reservations(
    queue: Queue, redis: Redis
) -> None:
    await queue.budgets.create("b", 1_000_000)
    await queue.set_retention("completed", count=3)
    ids = await finish(queue, [JobSpec("a", idempotency_key=f"k{i}", tokens=5, budget="b") for i in range(8)])
    records = [await redis.hgetall(queue.keys.job(i)) for i in ids]
    rids = [text(r[b"rid"]) for r in records]
    assert all([await redis.exists(queue.keys.reservation_prefix + rid) for rid in rids])

    assert await queue.protocol.trim(limit=100) == (5, False)
    kept = await redis.zrange(queue.keys.finished_prefix + "completed", 0, -1)
    assert [text(i) for i in kept] == ids[5:]
    for i, job_id in enumerate(ids):
        gone = i < 5
        assert (await redis.exists(queue.keys.job(job_id)) == 0) is gone
        assert (await redis.exists(queue.keys.reservation_prefix + rids[i]) == 0) is gone
    # the idempotency key outlives the record (to its own TTL): a retried add does not
    # start the work again, and says which job it was
    again = await queue.add("a", idempotency_key="k0")
    assert (again.id, again.created) == (ids[0], False)
    assert await redis.exists(queue.keys.idem("k0"))
    # and the budget still counts what the forgotten jobs were charged
    assert (await queue.budgets.get("b")).used == 8 * 5
    assert await queue.protocol.trim(limit=100) == (0, False)


async def test_trim_is_bounded_and_says_when_more_is_due(queue: Queue, redis: Redis) -> None:
    await queue.set_retention("completed", count=1)
    await finish(queue, [JobSpec("a") for _ in range(30)])
    assert await queue.protocol.trim(limit=10) == (10, True)
    assert await queue.protocol.trim(limit=10) == (10, True)
    assert await queue.protocol.trim(limit=10) == (9, False)
    assert await redis.zcard(queue.keys.finished_prefix + "completed") == 1


async def test_trim_forgets_by_age_and_drops_entries_of_expired_records(queue: Queue, redis: Redis) -> None:
    await queue.set_retention("completed", age=0.2)
    await queue.set_retention("dead", age=0.2)
    done = await finish(queue, [JobSpec("a") for _ in range(4)])
    dead = await finish(queue, [JobSpec("a") for _ in range(3)], kind=b"p")
    await asyncio.sleep(0.3)
    assert await queue.protocol.trim(limit=100) == (7, False)
    assert await redis.zcard(queue.keys.finished_prefix + "completed") == 0
    assert await redis.zcard(queue.keys.dead) == 0
    assert (await queue.counts())["dead"] == 0
    assert not any([await redis.exists(queue.keys.job(i)) for i in done + dead])


async def test_an_entry_for_a_job_that_lives_again_only_leaves_the_index(queue: Queue, redis: Redis) -> None:
    # An older Sluice left a dead-set entry for a job that was later redriven and waits now.
    job = await queue.add("a")
    await redis.zadd(queue.keys.dead, {job.id: 1})
    await queue.set_retention("dead", age=1)
    assert await queue.protocol.trim(limit=100) == (1, False)
    assert await queue.job_state(job.id) == "waiting"


@pytest.mark.slow
async def test_a_worker_applies_a_lower_count_to_jobs_kept_already(
    queue: Queue, redis_url: str, prefix: str
) -> None:
    await finish(queue, [JobSpec("a") for _ in range(50)])
    await queue.set_retention("completed", count=20)
    worker = Worker(queue=queue.name, prefix=prefix, reap_interval=0.1)

    @worker.handler
    async def a(ctx: JobContext) -> None:
        return None

    async with running_worker(worker, redis_url):

        async def trimmed() -> bool:
            return await queue.redis.zcard(queue.keys.finished_prefix + "completed") == 20

        await eventually(trimmed, timeout=10)
