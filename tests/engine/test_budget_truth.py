"""A budget is the money spent: the three cases where the ledger used to say less.

Each runs jobs through a real worker whose handlers report usage as a provider
would bill it, and compares the budget with the sum of what was reported.
Before, each of them failed: usage beyond what fitted was dropped (a 200-token
budget showing 200 after 400 were spent), a job without an estimate was
admitted by a full budget, and a billed call that was then throttled was
refunded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import (
    Backoff,
    InvalidJobError,
    JobContext,
    JobExhausted,
    JobRejected,
    JobState,
    Queue,
    Throttled,
    Worker,
)
from sluice.engine.events import Event
from tests.conftest import eventually, running
from tests.harness.stepping import leased, step

T = 1_800_000_000_000


def spender(prefix: str) -> Worker:
    """Handlers that report what the payload says the provider billed."""
    w = Worker("q", prefix=prefix, concurrency=2)

    @w.handler
    async def llm(job: JobContext) -> str:
        job.record_usage(job.payload["used"])
        return "ok"

    throttled: set[str] = set()

    @w.handler
    async def billed_then_throttled(job: JobContext) -> str:
        # (a throttled attempt is not counted: the next one has the same number)
        if job.id not in throttled:
            throttled.add(job.id)
            job.record_usage(job.payload["used"])
            raise Throttled(retry_after=0.05)
        job.record_usage(0)  # the retry never called the provider
        return "ok"

    return w


async def test_usage_beyond_the_estimate_is_charged_in_full_and_shown(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a 200-token budget and two jobs estimating 100 each that really use 300 and 100,
    # both admitted before either reports (the worker takes both in its first call)
    await queue.budgets.create("b", 200)
    first = await queue.add("llm", {"used": 300}, tokens=100, budget="b")
    second = await queue.add("llm", {"used": 100}, tokens=100, budget="b")
    async with running(spender(prefix), redis):
        assert await first.result(timeout=10) == await second.result(timeout=10) == "ok"
        # When a third job comes, the budget is past its limit
        third = await queue.add("llm", {"used": 1}, tokens=1, budget="b")
        await eventually(lambda: _in(queue, third.id, JobState.REJECTED))
    # Then the ledger is what was spent: 400, 200 past the limit, 200 beyond estimates
    state = await queue.budgets.get("b")
    assert (state.used, state.remaining, state.overspent, state.beyond_estimates) == (400, 0, 200, 200)
    # and the third job was refused: an overspent budget admits nothing
    assert "cannot admit 1 tokens" in ((await third.info()).error or "")


async def test_no_job_spends_from_a_budget_without_an_estimate(queue: Queue, redis: Redis) -> None:
    await queue.budgets.create("b", 100)
    with pytest.raises(InvalidJobError, match="needs tokens=, its token estimate"):
        await queue.add("llm", budget="b")
    # A record an older Sluice wrote (a budget, no estimate) is not admitted by a full budget.
    job = await queue.add("llm", tokens=1, budget="b", on_exhausted="reject")
    await redis.hset(queue.keys.job(job.id), "tokens", 0)
    assert (await queue.budgets.reserve("b", 100, "fill")).accepted
    reply = await step(queue, T, want=1)
    assert leased(reply) == []
    assert await queue.job_state(job.id) is JobState.REJECTED
    assert (await queue.budgets.get("b")).used == 100


async def test_a_billed_call_that_was_then_throttled_is_charged(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given two jobs whose first attempts are served (300 tokens each) and then throttled
    await queue.budgets.create("b", 10_000)
    jobs = [await queue.add("billed_then_throttled", {"used": 300}, tokens=50, budget="b") for _ in range(2)]
    async with running(spender(prefix), redis):
        for job in jobs:
            assert await job.result(timeout=10) == "ok"
    # Then the 600 tokens billed are charged (the retries used none), not refunded
    state = await queue.budgets.get("b")
    assert (state.used, state.beyond_estimates) == (600, 500)
    assert (await queue.counts())["throttled"] == 2


async def _in(queue: Queue, job_id: str, state: JobState) -> bool:
    return await queue.job_state(job_id) is state


# ---- what a job's record says about its spend ------------------------------------------------------------
async def test_a_job_that_spent_and_is_then_refused_ends_exhausted(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a budget of 150 and a job estimating 100 whose first attempt is billed 120 and fails
    await queue.budgets.create("b", 150)
    w = Worker("q", prefix=prefix, concurrency=1)
    seen: list[tuple[int, str | None]] = []

    @w.handler(name="llm")
    async def llm(job: JobContext) -> str:
        seen.append((job.tokens, job.budget))
        job.record_usage(120)
        raise RuntimeError("the provider's answer did not parse")

    job = await queue.add("llm", tokens=100, budget="b", max_attempts=3, backoff=Backoff.fixed(0.01))
    never = await queue.add("llm", tokens=200, budget="b")
    async with running(w, redis):
        # When its retry finds only 30 tokens left
        with pytest.raises(JobExhausted, match="spent tokens in earlier attempts") as ended:
            await job.result(timeout=10)
        with pytest.raises(JobRejected) as rejected:
            await never.result(timeout=10)
    # Then it ends exhausted, not rejected (a state for jobs that never started), and
    # is still a JobRejected for code that handles refusals
    assert isinstance(ended.value, JobRejected) and not isinstance(rejected.value, JobExhausted)
    record = await job.info()
    assert record.state is JobState.EXHAUSTED and JobState.EXHAUSTED.finished
    assert (await never.state()) is JobState.REJECTED
    # and its record lists what each attempt reserved, reported, was charged and how it ended
    assert record.spent == 120
    assert [(a.reservation, a.estimate, a.reported, a.charged, a.outcome) for a in record.attempts_spend] == [
        (f"{job.id}:1", 100, 120, 120, "failed")
    ]
    # the handler saw its estimate and budget
    assert seen == [(100, "b")]
    counts = await queue.counts()
    assert (counts["exhausted"], counts["rejected"]) == (1, 1)
    events = [e async for e in _events(queue)]
    assert ("exhausted", job.id, "120") in [(e.name, e.job_id, e.fields.get("spent")) for e in events]
    assert (await queue.budgets.get("b")).used == 120


async def test_each_attempt_is_listed_with_its_outcome(redis: Redis, prefix: str, queue: Queue) -> None:
    # Given a job that is throttled (billed 10), then fails without a report, then completes (reports 40)
    await queue.budgets.create("b", 10_000)
    w = Worker("q", prefix=prefix, concurrency=1)
    calls: list[int] = []

    @w.handler(name="llm")
    async def llm(job: JobContext) -> str:
        calls.append(job.attempt)
        if len(calls) == 1:
            job.record_usage(10)
            raise Throttled(retry_after=0.01)
        if len(calls) == 2:
            raise RuntimeError("timeout reading the answer")
        job.record_usage(40)
        return "ok"

    job = await queue.add("llm", tokens=50, budget="b", max_attempts=3, backoff=Backoff.fixed(0.01))
    async with running(w, redis):
        assert await job.result(timeout=10) == "ok"
    record = await job.info()
    assert [(a.estimate, a.reported, a.charged, a.outcome) for a in record.attempts_spend] == [
        (50, 10, 10, "throttled"),
        (50, None, 50, "failed"),  # kept at the estimate: an unknown outcome
        (50, 40, 40, "completed"),
    ]
    assert record.spent == 100 == (await queue.budgets.get("b")).used
    assert record.to_dict()["attempts_spend"][2]["outcome"] == "completed"


async def test_a_job_without_a_budget_sees_none(redis: Redis, prefix: str, queue: Queue) -> None:
    w = Worker("q", prefix=prefix)

    @w.handler(name="plain")
    async def plain(job: JobContext) -> list[object]:
        return [job.tokens, job.budget]

    job = await queue.add("plain", tokens=7)
    async with running(w, redis):
        assert await job.result(timeout=10) == [7, None]
    record = await job.info()
    assert (record.spent, record.attempts_spend) == (0, ())


async def _events(queue: Queue) -> AsyncIterator[Event]:
    entries: Any = await queue.redis.xrange(queue.keys.events, "-", "+")
    for stream_id, fields in entries:
        yield Event.parse(stream_id, fields)
