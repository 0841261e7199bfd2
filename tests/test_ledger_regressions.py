"""Regressions of three ledger bugs found by the budget tests.

1. A caller's reservation under a job's reservation id met the dispatch
   script's reservation and was answered as a free duplicate.
2. A rolling window read the amount of an expiring charge from its
   reservation record, which is kept 8 days: a budget left alone longer kept
   the charge for ever.
3. A rolling window let at most 1000 charges leave per call.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from sluice import JobContext, JobSpec, Queue, Worker
from tests.conftest import running

T = 1_800_000_000_000
DAY_MS = 86_400_000


# ---- 1. a handler's own reservation under ctx.reservation_id collides with the dispatch's ----------------
async def test_a_handlers_reservation_under_its_reservation_id_is_charged_under_a_token_rate_limit(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a queue with a token-rate limit, a "tools" budget of 100 tokens, and a
    # handler that reserves 100 tokens from it under ctx.reservation_id, as
    # JobContext.reservation_id's docstring suggests, and as the lab's atomic gate does
    await queue.set_token_rate_limit(10_000, per=60)
    await queue.budgets.create("tools", 100)
    w = Worker("q", prefix=prefix, concurrency=1, lease=5.0)

    @w.handler
    async def llm(job: JobContext) -> list[bool]:
        r = await queue.budgets.reserve("tools", 100, job.reservation_id)
        return [r.accepted, r.duplicate]

    # When two such jobs run
    jobs = await queue.add_bulk(JobSpec("llm", tokens=10) for _ in range(2))
    async with running(w, redis):
        results = [await j.result(timeout=10) for j in jobs]

    # Then the first is charged, and the second refused: the budget holds 100
    # (callers' reservations are kept apart from the dispatch script's "<id>:<token>")
    assert results == [[True, False], [False, False]]
    assert (await queue.budgets.get("tools")).used == 100


async def test_reservation_ids_of_callers_and_of_the_dispatch_script_do_not_collide(queue: Queue) -> None:
    # Minimal form: a job with a budget is dispatched (reservation "1:1" on "team");
    # a caller then reserves on another budget under the same id
    await queue.budgets.create("team", 1000)
    await queue.budgets.create("tools", 100)
    await queue.add("llm", tokens=10, budget="team")
    reply = await queue.step(now=T, want=1, lease_ms=10_000, worker_id="w")
    rid = f"{reply.jobs[0].decode()}:{reply.jobs[1]}"
    r = await queue.budgets.reserve("tools", 100, rid)
    assert (r.accepted, r.duplicate) == (True, False)
    assert (await queue.budgets.get("tools")).used == 100


# ---- 2. rolling windows forget expired reservations' charges -----------------------------------------------
async def expire_now(redis: Redis, key: str) -> None:
    """Let a key's TTL run out now, as Redis would once it is due (settled reservations: 8 days)."""
    ttl = await redis.pttl(key)
    assert 0 < ttl <= 8 * DAY_MS, ttl
    await redis.pexpire(key, 1)
    await asyncio.sleep(0.05)
    assert not await redis.exists(key)


async def test_a_rolling_budget_left_alone_longer_than_reservations_are_kept_frees_its_charges(
    redis: Redis, queue: Queue
) -> None:
    # Given an hourly rolling budget of 1000 tokens, 600 of them committed
    b = queue.budgets
    await b.create("hourly", 1000, window=3600, now=T)
    assert (await b.reserve("hourly", 600, "r", now=T)).accepted
    await b.commit("r", 600, now=T + 1000)

    # When nobody uses the budget for 9 days: the settled reservation, kept 8 days, expires
    await expire_now(redis, queue.keys.reservation_prefix + "u:r")

    # Then the charge, an hour old many times over, no longer counts
    state = await b.get("hourly", now=T + 9 * DAY_MS)
    assert state.used == 0, state
    assert (await b.reserve("hourly", 1000, "r2", now=T + 9 * DAY_MS)).accepted


async def test_the_token_rate_window_of_a_queue_idle_for_nine_days_is_whole_again(
    redis: Redis, queue: Queue
) -> None:
    # Given a token-rate limit of 1000 a minute, and a job that used 900 of it
    await queue.set_token_rate_limit(1000, per=60)
    job = await queue.add("llm", tokens=900)
    reply = await queue.step(now=T, want=1, lease_ms=10_000, worker_id="w")
    token = str(reply.jobs[1]).encode()
    done: Any = [(job.id, token, b"c", b'"ok"', 0, 900)]
    await queue.step(now=T + 1, want=0, lease_ms=10_000, worker_id="w", outcomes=done)

    # When the queue is idle for 9 days (the settled reservation expires after 8)
    await expire_now(redis, queue.keys.reservation_prefix + f"{job.id}:1")

    # Then the window is empty again, and a job of 500 tokens runs
    later = T + 9 * DAY_MS
    assert (await queue.flow(now=later)).tokens_in_window == 0
    nxt = await queue.add("llm", tokens=500)
    reply = await queue.step(now=later, want=1, lease_ms=10_000, worker_id="w")
    assert reply.jobs[:1] == [nxt.id.encode()]


# ---- 3. a rolling window trims at most 1000 expired charges per call --------------------------------------
async def test_a_rolling_budget_counts_none_of_its_expired_charges(queue: Queue) -> None:
    # Given a rolling budget of 2000 tokens a minute, 1500 reservations of 1 token made at T
    b = queue.budgets
    await b.create("roll", 2000, window=60, now=T)
    for i in range(1500):
        assert (await b.reserve("roll", 1, f"r{i}", now=T)).accepted

    # When a minute has passed (all of them have left the window)
    later = T + 60_000

    # Then the whole limit is free: a job of 1501 tokens with on_exhausted="reject" runs
    # (it was rejected while one call let only 1000 of the expired charges leave)
    job = await queue.add("llm", tokens=1501, budget="roll")
    reply = await queue.step(now=later, want=1, lease_ms=10_000, worker_id="w")
    assert reply.jobs[:1] == [job.id.encode()], await job.info()
