"""A budget is the money spent: the three cases where the ledger used to say less.

Each runs jobs through a real worker whose handlers report usage as a provider
would bill it, and compares the budget with the sum of what was reported.
Before, each of them failed: usage beyond what fitted was dropped (a 200-token
budget showing 200 after 400 were spent), a job without an estimate was
admitted by a full budget, and a billed call that was then throttled was
refunded.
"""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from sluice import InvalidJobError, JobContext, JobState, Queue, Throttled, Worker
from tests.conftest import eventually, running
from tests.stepping import leased, step

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
