"""Adding jobs, reading them back, and refusing bad input before anything is written."""

from __future__ import annotations

import asyncio
import math
import sys
import tracemalloc
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import (
    MAX_PRIORITY,
    Backoff,
    CorruptJobError,
    InvalidJobError,
    JobSpec,
    JobState,
    PayloadNotSerializable,
    PayloadTooLarge,
    Queue,
    UnknownJobName,
)
from sluice.engine.clock import now_ms
from sluice.engine.queue import BULK_CHUNK


async def keys_of(redis: Redis, prefix: str) -> list[bytes]:
    return sorted([k async for k in redis.scan_iter(match=f"{prefix}:*")])


async def test_add_stores_a_waiting_job(queue: Queue) -> None:
    job = await queue.add("summarize", {"text": "hi"}, priority=3, max_attempts=5, timeout=2.5)
    record = await job.info()
    assert job.created
    assert record.state is JobState.WAITING
    assert (record.name, record.payload, record.priority) == ("summarize", {"text": "hi"}, 3)
    assert (record.attempt, record.max_attempts, record.timeout) == (0, 5, 2.5)
    assert abs(record.created_ms - now_ms()) < 5000
    counts = await queue.counts()
    assert (counts["waiting"], counts["added"], counts["active"]) == (1, 1, 0)


async def test_delayed_job_waits_in_the_delayed_set(queue: Queue) -> None:
    job = await queue.add("later", delay=60)
    record = await job.info()
    assert record.state is JobState.DELAYED
    assert record.due_ms is not None and record.due_ms - record.created_ms == 60_000
    assert await queue.ids(JobState.DELAYED) == [job.id]
    assert await queue.ids(JobState.WAITING) == []


async def test_waiting_order_is_priority_then_fifo(queue: Queue) -> None:
    prios = [5, 0, 5, 1, 0, MAX_PRIORITY, 1]
    jobs = await queue.add_bulk(JobSpec("j", i, priority=p) for i, p in enumerate(prios))
    expected = [
        j.id for _, _, j in sorted((p, i, j) for i, (p, j) in enumerate(zip(prios, jobs, strict=True)))
    ]
    assert await queue.ids(JobState.WAITING) == expected


async def test_add_bulk_spans_many_script_calls(queue: Queue) -> None:
    done: list[int] = []
    n = 2 * BULK_CHUNK + BULK_CHUNK // 2
    jobs = await queue.add_bulk((JobSpec("j", i) for i in range(n)), progress=done.append)
    assert done == [BULK_CHUNK, 2 * BULK_CHUNK, n]  # one report per script call
    assert len({j.id for j in jobs}) == n
    assert (await queue.counts())["waiting"] == n
    records = await queue.get_jobs([jobs[0].id, jobs[-1].id])
    assert [r.payload for r in records if r] == [0, n - 1]


async def test_idempotency_key_returns_the_first_job(queue: Queue) -> None:
    first = await queue.add("charge", {"n": 1}, idempotency_key="order-7")
    again = await queue.add("charge", {"n": 2}, idempotency_key="order-7")
    assert first.created and not again.created
    assert again.id == first.id
    assert (await first.info()).payload == {"n": 1}
    assert (await first.info()).idempotency_key == "order-7"
    assert (await queue.counts())["added"] == 1


async def test_idempotency_key_twice_in_one_bulk(queue: Queue) -> None:
    jobs = await queue.add_bulk(
        [JobSpec("a", idempotency_key="k"), JobSpec("b"), JobSpec("c", idempotency_key="k")]
    )
    assert [j.created for j in jobs] == [True, True, False]
    assert jobs[2].id == jobs[0].id


async def test_idempotency_under_200_concurrent_adds(redis_url: str, prefix: str) -> None:
    # Given 200 adds with one key, each on its own connection, all released at once
    from sluice.engine.connection import connect

    clients = [connect(redis_url) for _ in range(20)]
    queues = [Queue("q", redis=c, prefix=prefix) for c in clients]
    gate = asyncio.Event()

    async def add(i: int) -> str:
        await gate.wait()
        return (await queues[i % 20].add("pay", {"i": i}, idempotency_key="same")).id

    tasks = [asyncio.create_task(add(i)) for i in range(200)]
    await asyncio.sleep(0.05)
    gate.set()
    ids = await asyncio.gather(*tasks)
    # Then exactly one job exists and every caller got its id
    assert len(set(ids)) == 1
    counts = await queues[0].counts()
    assert (counts["added"], counts["waiting"]) == (1, 1)
    for c in clients:
        await c.aclose()


IDEM_SCRIPT = """
import asyncio, sys
from sluice import Queue
from sluice.engine.connection import connect

async def main(url, prefix, n):
    client = connect(url)
    q = Queue("q", redis=client, prefix=prefix)
    while not await client.exists(prefix + ":go"):
        await asyncio.sleep(0.001)
    jobs = await asyncio.gather(*(q.add("pay", i, idempotency_key="one") for i in range(n)))
    print(",".join(sorted({j.id for j in jobs})))
    await client.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def test_idempotency_across_processes(redis: Redis, redis_url: str, prefix: str, queue: Queue) -> None:
    # Given 4 processes, each about to add 50 jobs with the same key
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", IDEM_SCRIPT, redis_url, prefix, "50", stdout=asyncio.subprocess.PIPE
        )
        for _ in range(4)
    ]
    try:
        await asyncio.sleep(0.5)
        # When they are released together
        await redis.set(prefix + ":go", 1)
        outs = [(await asyncio.wait_for(p.communicate(), 30))[0].decode().strip() for p in procs]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
    # Then all 200 adds name one job, and only one was added
    assert set(outs) == {outs[0]} and outs[0] and "," not in outs[0]
    assert (await queue.counts())["added"] == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"priority": -1}, InvalidJobError, "priority"),
        ({"priority": MAX_PRIORITY + 1}, InvalidJobError, "priority"),
        ({"priority": 1.5}, InvalidJobError, "priority"),
        ({"priority": True}, InvalidJobError, "priority"),
        ({"delay": -1}, InvalidJobError, "delay"),
        ({"delay": math.inf}, InvalidJobError, "delay"),
        ({"delay": math.nan}, InvalidJobError, "delay"),
        ({"max_attempts": 0}, InvalidJobError, "max_attempts"),
        ({"timeout": 0}, InvalidJobError, "timeout"),
        ({"idempotency_key": ""}, InvalidJobError, "idempotency_key"),
        ({"max_stalls": -1}, InvalidJobError, "max_stalls"),
        ({"payload": {1, 2}}, PayloadNotSerializable, "JSON"),
        ({"payload": object()}, PayloadNotSerializable, "never pickles"),
    ],
)
async def test_bad_input_is_refused_before_writing(
    queue: Queue, redis: Redis, prefix: str, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    args: dict[str, Any] = {"payload": None, **kwargs}
    payload = args.pop("payload")
    with pytest.raises(error, match=fragment):
        await queue.add("ok", payload, **args)
    assert await keys_of(redis, prefix) == []


@pytest.mark.parametrize("name", ["", None, "x" * 201, 7])
async def test_bad_job_names(queue: Queue, name: Any) -> None:
    with pytest.raises(InvalidJobError, match="job name"):
        await queue.add(name)


async def test_oversized_payload(redis: Redis, prefix: str) -> None:
    q = Queue("q", redis=redis, prefix=prefix, max_payload_bytes=100)
    with pytest.raises(PayloadTooLarge, match="over this queue's limit of 100"):
        await q.add("big", "x" * 200)
    assert await keys_of(redis, prefix) == []


async def test_unknown_job_name_is_refused(redis: Redis, prefix: str) -> None:
    q = Queue("q", redis=redis, prefix=prefix, known_names={"summarize", "embed"})
    with pytest.raises(UnknownJobName, match="known: embed, summarize"):
        await q.add("sumarize")
    assert await keys_of(redis, prefix) == []


async def test_one_bad_spec_in_a_bulk_writes_nothing(queue: Queue, redis: Redis, prefix: str) -> None:
    specs = [JobSpec("ok", 1), JobSpec("ok", 2)]
    with pytest.raises(InvalidJobError, match="item 2"):
        await queue.add_bulk([*specs, "not a spec"])  # type: ignore[list-item]
    assert await keys_of(redis, prefix) == []


def test_backoff_validation() -> None:
    with pytest.raises(InvalidJobError, match="jitter"):
        Backoff(jitter=2)
    with pytest.raises(InvalidJobError, match="kind"):
        Backoff(kind="linear")  # type: ignore[arg-type]


def test_backoff_delays() -> None:
    exp = Backoff.exponential(delay=1, max_delay=10, jitter=0)
    assert [exp.seconds(a) for a in (1, 2, 3, 4, 5)] == [1, 2, 4, 8, 10]
    jittered = Backoff.exponential(delay=4, jitter=0.5)
    assert jittered.seconds(1, rand=lambda: 0.0) == 4
    assert jittered.seconds(1, rand=lambda: 1.0) == 2
    assert Backoff.fixed(3).seconds(9) == 3


async def test_corrupt_record_is_reported(queue: Queue, redis: Redis) -> None:
    job = await queue.add("x")
    await redis.hset(queue.keys.job(job.id), "attempt", "many")
    with pytest.raises(CorruptJobError, match="'attempt' is 'many'"):
        await queue.get_job(job.id)
    await redis.hset(queue.keys.job(job.id), mapping={"attempt": 0, "v": 9})
    with pytest.raises(CorruptJobError, match="version '9'"):
        await queue.get_job(job.id)
    await redis.hset(queue.keys.job(job.id), mapping={"v": 1, "payload": "{nope"})
    with pytest.raises(CorruptJobError, match="not JSON"):
        await queue.get_job(job.id)


async def test_bad_job_ids_are_refused(queue: Queue) -> None:
    for bad in ("", "0", "007", "1 OR 1", "../x", "-x", "a" * 129, "é"):
        with pytest.raises(InvalidJobError, match="not a job id"):
            await queue.get_job(bad)
    assert await queue.get_job("999") is None
    assert await queue.get_job("abc") is None


async def test_a_callers_id_is_the_jobs_id_and_adding_it_again_returns_the_job(queue: Queue) -> None:
    # Given jobs added under ids of their callers', between jobs added without one
    first = await queue.add("a", {"n": 1})
    given = await queue.add("a", {"n": 2}, job_id="0192f0c4-6a1e-7b3c-8d9e-aabbccddeeff", priority=0)
    again = await queue.add("a", {"n": 3}, job_id="0192f0c4-6a1e-7b3c-8d9e-aabbccddeeff")
    bulk = await queue.add_bulk(
        [JobSpec("a", {"n": 4}, job_id="order:7"), JobSpec("a", {"n": 5}, job_id="order:7")]
    )
    last = await queue.add("a", {"n": 6})
    # Then the ids are theirs; an id added twice is one job, created once, as first added
    assert given.id == again.id == "0192f0c4-6a1e-7b3c-8d9e-aabbccddeeff"
    assert (given.created, again.created) == (True, False)
    assert [(j.id, j.created) for j in bulk] == [("order:7", True), ("order:7", False)]
    assert (await again.info()).payload == {"n": 2}
    assert ((await queue.get_job("order:7")) or pytest.fail("no job")).payload == {"n": 4}
    # and the engine's own ids, and the FIFO order, go on as before (every add takes a number)
    assert first.id.isdigit() and last.id.isdigit() and int(last.id) > int(first.id)
    assert (await queue.counts())["added"] == 4
    waiting: list[bytes] = await queue.redis.zrange(queue.keys.waiting, 0, -1)  # type: ignore[assignment]
    assert [j.decode() for j in waiting] == [
        first.id,
        given.id,
        "order:7",
        last.id,
    ]


@pytest.mark.parametrize("bad", ["", "42", "a b", "../x", "-x", "a" * 129, 7])
def test_a_callers_id_that_is_not_usable_is_refused_saying_why(bad: Any) -> None:
    with pytest.raises(InvalidJobError, match="not all digits"):
        JobSpec("a", job_id=bad)


async def test_a_job_cancelled_ahead_of_its_add_is_never_added(queue: Queue) -> None:
    # Given an id no job has yet, cancelled ahead (a caller's add may still be on its way)
    assert await queue.cancel("req-1", ahead=True)
    record = await queue.get_job("req-1")
    assert record is not None and record.state is JobState.CANCELLED
    # When the add arrives, it adds nothing: the job stays cancelled and nothing waits
    job = await queue.add("a", {}, job_id="req-1")
    assert (job.id, job.created) == ("req-1", False)
    assert (await queue.counts())["waiting"] == 0
    # and without ahead, an id that names no job is not found; the engine's numbers are never
    # cancelled ahead
    from sluice import JobNotFound

    with pytest.raises(JobNotFound):
        await queue.cancel("req-2")
    with pytest.raises(InvalidJobError):
        await queue.cancel("12", ahead=True)


def test_small_encoded_payloads_hold_their_own_size_only() -> None:
    # orjson keeps a ~4 KiB buffer behind each output; a batch of a million small jobs held 9 GB
    from sluice.engine.codec import encode

    tracemalloc.start()
    try:
        kept = [encode({"doc": i}) for i in range(1000)]
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(kept) == 1000
    assert held < 1000 * 200, f"{held / 1000:.0f} bytes per 10-byte payload"


async def test_adding_a_jobspec_with_add_says_to_use_add_bulk(queue: Queue) -> None:
    with pytest.raises(InvalidJobError, match=r"add_bulk\(\[spec\]\)"):
        await queue.add(JobSpec("a", {}))  # type: ignore[arg-type]
