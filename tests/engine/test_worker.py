"""A worker running handlers in this process: outcomes, retries, timeouts, results."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import (
    Backoff,
    ConfigurationError,
    JobCancelled,
    JobContext,
    JobFailed,
    JobSpec,
    JobState,
    PermanentError,
    Queue,
    ResultTimeout,
    Worker,
)
from tests.conftest import eventually, running


def make_worker(prefix: str, **options: Any) -> Worker:
    options.setdefault("lease", 5.0)
    return Worker("q", prefix=prefix, **options)


async def test_completes_and_returns_the_result(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)

    @w.handler
    async def double(job: JobContext) -> dict[str, Any]:
        return {"twice": job.payload * 2, "attempt": job.attempt, "worker": job.worker_id}

    async with running(w, redis):
        job = await queue.add("double", 21)
        assert await job.result(timeout=10) == {"twice": 42, "attempt": 1, "worker": w.worker_id}
    record = await job.info()
    assert record.state is JobState.COMPLETED
    assert record.worker == w.worker_id
    assert record.started_ms is not None and record.finished_ms is not None
    # Clients stamp times; allow for a step whose "now" was taken just before the add.
    assert record.created_ms - 50 <= record.started_ms <= record.finished_ms
    counts = await queue.counts()
    assert (counts["completed"], counts["active"], counts["waiting"]) == (1, 0, 0)


async def test_result_of_an_already_finished_job(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)
    w.register("one", _returns_one)
    async with running(w, redis):
        job = await queue.add("one")
        await eventually(lambda: _state_is(job.queue, job.id, JobState.COMPLETED))
    # The worker is gone; the outcome is read from the record, no event needed.
    assert await job.result(timeout=1) == 1


async def _returns_one(job: JobContext) -> int:
    return 1


async def _state_is(queue: Queue, job_id: str, state: JobState) -> bool:
    return await queue.job_state(job_id) is state


async def test_large_results_are_fetched_from_the_record(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)

    @w.handler
    async def big(job: JobContext) -> str:
        return "x" * 100_000

    async with running(w, redis):
        assert await (await queue.add("big")).result(timeout=10) == "x" * 100_000


async def test_priorities_run_in_order(redis: Redis, prefix: str, queue: Queue) -> None:
    order: list[int] = []
    w = make_worker(prefix, concurrency=1)

    @w.handler
    async def note(job: JobContext) -> None:
        order.append(job.payload)

    prios = [9, 3, 0, 3, 9, 0, 1]
    jobs = await queue.add_bulk(JobSpec("note", i, priority=p) for i, p in enumerate(prios))
    async with running(w, redis):
        for j in jobs:
            await j.result(timeout=10)
    assert order == [i for _, i in sorted((p, i) for i, p in enumerate(prios))]


async def test_retries_with_backoff_then_succeeds(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)
    seen: list[tuple[int, float]] = []

    @w.handler
    async def flaky(job: JobContext) -> str:
        seen.append((job.attempt, time.monotonic()))
        if job.attempt < 3:
            raise RuntimeError(f"provider hiccup {job.attempt}")
        return "ok"

    async with running(w, redis):
        job = await queue.add("flaky", max_attempts=3, backoff=Backoff.fixed(0.2))
        assert await job.result(timeout=10) == "ok"
    assert [a for a, _ in seen] == [1, 2, 3]
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(seen)]
    assert all(g >= 0.19 for g in gaps), gaps
    record = await job.info()
    assert (record.attempt, record.failures, record.state) == (3, 2, JobState.COMPLETED)
    assert record.error is not None and "provider hiccup 2" in record.error
    counts = await queue.counts()
    assert (counts["failed"], counts["retried"], counts["completed"]) == (2, 2, 1)


async def test_exhausted_attempts_dead_letter(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)

    @w.handler
    async def broken(job: JobContext) -> None:
        raise ValueError("bad prompt template")

    async with running(w, redis):
        job = await queue.add("broken", max_attempts=2, backoff=Backoff.fixed(0.01))
        with pytest.raises(JobFailed, match="bad prompt template") as info:
            await job.result(timeout=10)
    assert "ValueError" in info.value.error and "Traceback" in info.value.error
    assert await queue.ids(JobState.DEAD) == [job.id]
    dead = await queue.dead_letters()
    assert [(d.id, d.attempt, d.failures) for d in dead] == [(job.id, 2, 2)]


async def test_permanent_error_skips_retries(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)
    calls = 0

    @w.handler
    async def refuse(job: JobContext) -> None:
        nonlocal calls
        calls += 1
        raise PermanentError("content policy: will never pass")

    async with running(w, redis):
        job = await queue.add("refuse", max_attempts=5)
        with pytest.raises(JobFailed, match="content policy"):
            await job.result(timeout=10)
    assert calls == 1


async def test_unserializable_result_is_a_permanent_failure(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)

    @w.handler
    async def weird(job: JobContext) -> object:
        return object()

    async with running(w, redis):
        with pytest.raises(JobFailed, match="result is not JSON-serializable"):
            await (await queue.add("weird", max_attempts=3)).result(timeout=10)


async def test_timeout_cancels_the_handler(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)
    cancelled = asyncio.Event()

    @w.handler
    async def slow(job: JobContext) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with running(w, redis):
        job = await queue.add("slow", timeout=0.2, max_attempts=1)
        with pytest.raises(JobFailed, match=r"AttemptTimeout: the attempt ran past its timeout of 0.2s"):
            await job.result(timeout=10)
    assert cancelled.is_set()


async def test_handler_raising_timeout_error_is_an_ordinary_failure(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    w = make_worker(prefix, timeout=30)

    @w.handler
    async def upstream(job: JobContext) -> None:
        raise TimeoutError("upstream read timed out")

    async with running(w, redis):
        with pytest.raises(JobFailed, match="upstream read timed out"):
            await (await queue.add("upstream", max_attempts=1)).result(timeout=10)


async def test_unknown_name_on_the_worker_dead_letters(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)
    w.register("one", _returns_one)
    async with running(w, redis):
        with pytest.raises(JobFailed, match=r"no handler named 'two'.*it serves: one"):
            await (await queue.add("two")).result(timeout=10)


async def test_result_timeout(queue: Queue) -> None:
    job = await queue.add("nobody-serves-this")
    with pytest.raises(ResultTimeout, match="it is waiting"):
        await job.result(timeout=0.2)


async def test_cancel_waiting_and_delayed(redis: Redis, prefix: str, queue: Queue) -> None:
    waiting = await queue.add("x")
    delayed = await queue.add("x", delay=30)
    assert await waiting.cancel() and await delayed.cancel()
    assert await waiting.state() is JobState.CANCELLED
    assert await delayed.state() is JobState.CANCELLED
    assert await queue.ids(JobState.WAITING) == [] and await queue.ids(JobState.DELAYED) == []
    with pytest.raises(JobCancelled):
        await waiting.result(timeout=1)
    assert not await waiting.cancel()  # already finished
    assert (await queue.counts())["cancelled"] == 2


async def test_cancel_a_running_job(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix, lease=0.3)
    started = asyncio.Event()
    stopped = asyncio.Event()

    @w.handler
    async def long(job: JobContext) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            stopped.set()

    async with running(w, redis):
        job = await queue.add("long")
        await asyncio.wait_for(started.wait(), 10)
        assert await job.cancel()
        with pytest.raises(JobCancelled):
            await job.result(timeout=10)
    assert stopped.is_set()
    assert (await job.info()).state is JobState.CANCELLED


async def test_delayed_job_runs_when_due(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)
    w.register("one", _returns_one)
    async with running(w, redis):
        await asyncio.sleep(0.1)  # the worker is idle and blocked
        t0 = time.monotonic()
        job = await queue.add("one", delay=0.3)
        await job.result(timeout=10)
        elapsed = time.monotonic() - t0
    record = await job.info()
    assert record.started_ms is not None and record.due_ms is not None
    assert record.started_ms >= record.due_ms
    assert elapsed >= 0.29


async def test_redrive_and_purge(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)
    fail = True

    @w.handler
    async def sometimes(job: JobContext) -> str:
        if fail:
            raise RuntimeError("down")
        return "up"

    async with running(w, redis):
        a = await queue.add("sometimes", max_attempts=1)
        b = await queue.add("sometimes", max_attempts=1)
        for j in (a, b):
            with pytest.raises(JobFailed):
                await j.result(timeout=10)
        fail = False
        assert await queue.redrive([a.id]) == 1
        assert await a.result(timeout=10) == "up"
        assert (await a.info()).attempt == 1
    assert await queue.ids(JobState.DEAD) == [b.id]
    assert await queue.purge_dead() == 1
    assert await queue.get_job(b.id) is None
    assert await queue.ids(JobState.DEAD) == []


async def test_events_follow_the_lifecycle(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix)
    w.register("one", _returns_one)
    seen: list[tuple[str, str]] = []

    async def follow() -> None:
        async for event in queue.events(since="0"):
            seen.append((event.name, event.job_id))
            if event.name == "completed":
                return

    async with running(w, redis):
        job = await queue.add("one")
        await asyncio.wait_for(follow(), 10)
    assert seen == [("added", job.id), ("active", job.id), ("completed", job.id)]


async def test_many_concurrent_result_waiters(redis: Redis, prefix: str, queue: Queue) -> None:
    w = make_worker(prefix, concurrency=20)

    @w.handler
    async def echo(job: JobContext) -> Any:
        await asyncio.sleep(0.01)
        return job.payload

    async with running(w, redis):
        jobs = await queue.add_bulk(JobSpec("echo", i) for i in range(300))
        results = await asyncio.gather(*(j.result(timeout=20) for j in jobs))
    assert results == list(range(300))


def test_worker_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="concurrency"):
        Worker("q", concurrency=0)
    with pytest.raises(ConfigurationError, match="queue name"):
        Worker("bad name with spaces")
    w = Worker("q")
    with pytest.raises(ConfigurationError, match="must be a function"):
        w.register("not a function", 42)  # type: ignore[arg-type]
    w.register("sync", lambda job: None)  # a plain function runs in a thread (tests/engine/test_timeouts.py)
    w.register("one", _returns_one)
    assert w.is_sync("sync") and not w.is_sync("one")
    with pytest.raises(ConfigurationError, match="already registered"):
        w.register("one", _returns_two)


async def _returns_two(job: JobContext) -> int:
    return 2


async def test_worker_without_handlers_refuses_to_run(redis: Redis) -> None:
    with pytest.raises(ConfigurationError, match="no handlers"):
        await Worker("q").run(redis, handle_signals=False)


async def test_worker_queue_checks_names(redis: Redis, prefix: str) -> None:
    w = make_worker(prefix)
    w.register("one", _returns_one)
    q = w.queue(redis)
    from sluice import UnknownJobName

    with pytest.raises(UnknownJobName):
        await q.add("two")


async def test_unreadable_records_are_dead_lettered_with_the_reason(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given two jobs whose records were damaged by another writer
    w = make_worker(prefix)
    w.register("one", _returns_one)
    bad_payload = await queue.add("one")
    bad_field = await queue.add("one")
    good = await queue.add("one")
    await redis.hset(queue.keys.job(bad_payload.id), "payload", "{not json")
    await redis.hset(queue.keys.job(bad_field.id), "max_attempts", "lots")
    # When a worker takes them
    async with running(w, redis):
        assert await good.result(timeout=10) == 1
        # Then each is dead-lettered, saying what is wrong, and the worker goes on
        with pytest.raises(JobFailed, match="payload is not JSON"):
            await bad_payload.result(timeout=10)
        with pytest.raises(JobFailed, match="unreadable fields at dispatch"):
            await bad_field.result(timeout=10)


async def test_damaged_counters_do_not_poison_a_batch(redis: Redis, prefix: str, queue: Queue) -> None:
    # Given jobs whose counters were overwritten with text by another writer
    w = make_worker(prefix)

    @w.handler
    async def fails_once(job: JobContext) -> int:
        if job.attempt == 1:
            raise RuntimeError("first try fails")
        return job.attempt

    jobs = await queue.add_bulk(JobSpec("fails_once", i, backoff=Backoff.fixed(0.01)) for i in range(3))
    for field in ("attempt", "token", "failures"):
        await redis.hset(queue.keys.job(jobs[0].id), field, "garbage")
    # When a worker runs the batch, then Every job completes on its second attempt
    async with running(w, redis):
        assert [await j.result(timeout=10) for j in jobs] == [2, 2, 2]
    assert (await jobs[0].info()).failures == 1
