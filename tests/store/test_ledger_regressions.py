"""Regressions of three ledger bugs found by the budget tests.

1. A caller's reservation under a job's reservation id met the dispatch
   script's reservation and was answered as a free duplicate.
2. A rolling window read the amount of an expiring charge from its
   reservation record, which is kept 8 days: a budget left alone longer kept
   the charge for ever.
3. A rolling window let at most 1000 charges leave per call.

And of the bugs a review found (4-9): a calendar window reset by a caller
whose clock was behind; overuse not charged to a budget while the token-rate
window was full; a worker that filled its slots keeping the only timer for a
parked job; a record without a waiting score failing every dispatch; attempts
that never ran a handler kept charged as "unknown"; unchecked token counts.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import BudgetError, ConfigurationError, JobContext, JobFailed, JobSpec, JobState, Queue, Worker
from sluice.engine.job import MAX_TOKENS
from sluice.engine.protocol import LEASED_FIELDS
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
    reply = await queue.protocol.step(now=T, want=1, lease_ms=10_000, worker_id="w")
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
    reply = await queue.protocol.step(now=T, want=1, lease_ms=10_000, worker_id="w")
    token = str(reply.jobs[1]).encode()
    done: Any = [(job.id, token, b"c", b'"ok"', 0, 900)]
    await queue.protocol.step(now=T + 1, want=0, lease_ms=10_000, worker_id="w", outcomes=done)

    # When the queue is idle for 9 days (the settled reservation expires after 8)
    await expire_now(redis, queue.keys.reservation_prefix + f"{job.id}:1")

    # Then the window is empty again, and a job of 500 tokens runs
    later = T + 9 * DAY_MS
    assert (await queue.flow(now=later)).tokens_in_window == 0
    nxt = await queue.add("llm", tokens=500)
    reply = await queue.protocol.step(now=later, want=1, lease_ms=10_000, worker_id="w")
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
    # (it was rejected while one call let only 1000 of the expired charges leave). A call
    # still lets at most 1000 leave (bounded work), but one that has not caught up refuses
    # nothing: it tells the worker to come back at once, and the next call admits the job
    job = await queue.add("llm", tokens=1501, budget="roll")
    reply = await queue.protocol.step(now=later, want=1, lease_ms=10_000, worker_id="w")
    assert (reply.jobs, reply.next_due) == ([], later)
    assert await job.state() is JobState.WAITING
    reply = await queue.protocol.step(now=later + 1, want=1, lease_ms=10_000, worker_id="w")
    assert reply.jobs[:1] == [job.id.encode()], await job.info()


# ---- 4. a calendar window only moves forward -----------------------------------------------------------
async def test_a_caller_whose_clock_is_behind_does_not_restart_a_day_window(queue: Queue) -> None:
    # Given a day budget of 100, charged 100 just after midnight by one worker
    b = queue.budgets
    midnight = (T // DAY_MS + 1) * DAY_MS
    await b.create("daily", 100, window="day", now=midnight - 10)
    assert (await b.reserve("daily", 100, "a", now=midnight + 1)).accepted
    # When another worker, its clock 2 ms behind, reads and reserves
    await b.get("daily", now=midnight - 1)
    late = await b.reserve("daily", 100, "b", now=midnight - 1)
    # Then the new day's charge is not forgotten: nothing more fits
    assert not late.accepted
    assert (await b.get("daily", now=midnight + 2)).used == 100


# ---- 5. overuse is charged to budgets even when the token-rate window is full ------------------------
async def test_usage_beyond_the_estimate_is_charged_to_the_budget_under_a_full_token_window(
    queue: Queue,
) -> None:
    # Given a tenant budget of 1000 and a token-rate window of 1000 nearly full (900), filled
    # at once (the window alone: no pacer)
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_token_rate_limit(1000, per=60)
    await queue.budgets.create("tenant", 1000)
    a = await queue.add("llm", tokens=100, budget="tenant")
    await queue.add("llm", tokens=800)
    reply = await queue.protocol.step(now=T, want=2, lease_ms=10_000, worker_id="w")
    assert len(reply.jobs) == 2 * LEASED_FIELDS
    # When the first job reports 1000 tokens used (900 beyond its estimate)
    done: Any = [(a.id, str(reply.jobs[1]).encode(), b"c", b"1", 0, 1000)]
    assert (
        await queue.protocol.step(now=T + 1, want=0, lease_ms=10_000, worker_id="w", outcomes=done)
    ).codes == [1]
    # Then the tenant is charged all of it (it had room), and the window counts it too
    tenant = await queue.budgets.get("tenant", now=T + 2)
    assert (tenant.used, tenant.remaining) == (1000, 0)
    flow = await queue.flow(now=T + 2)
    assert flow.tokens_in_window == 1800
    stored = await queue.budgets.reservation(f"{a.id}:1")
    assert stored is not None and stored.get("over", "0") == "0"


# ---- 6. a worker that fills its slots hands the timer on ----------------------------------------------
async def test_a_full_step_wakes_an_idle_worker_to_keep_a_parked_jobs_timer(
    redis: Redis, queue: Queue
) -> None:
    # Given a rolling budget of 100: a first job fills it, a second waits on it,
    # and a third needs no budget
    await queue.budgets.create("roll", 100, window=2.0, now=T)
    await queue.add_bulk([JobSpec("llm", tokens=100, budget="roll", on_exhausted="wait") for _ in range(2)])
    await queue.add("llm")
    await redis.delete(queue.keys.wake)
    # When a worker with two free slots takes the first and the third (parking the second)
    reply = await queue.protocol.step(now=T, want=2, lease_ms=10_000, worker_id="w")
    assert len(reply.jobs) == 2 * LEASED_FIELDS and reply.next_due == T + 2000
    assert (await queue.counts())["parked"] == 1
    # Then an idle worker is woken to learn when the parked job may run: the
    # full worker may have no slot free by then
    assert await redis.zcard(queue.keys.wake) == 1


# ---- 7. a record without a waiting score does not break dispatch ---------------------------------------
async def test_a_parked_record_without_its_score_does_not_lose_the_jobs_beside_it(
    redis: Redis, queue: Queue
) -> None:
    # Given an empty budget, a job waiting on it whose record lost its score, and a plain job
    await queue.budgets.create("empty", 0)
    damaged = await queue.add("llm", tokens=10, budget="empty", on_exhausted="wait", priority=0)
    plain = await queue.add("llm", priority=1)
    await redis.hdel(queue.keys.job(damaged.id), "score")
    # When a worker asks for both
    reply = await queue.protocol.step(now=T, want=2, lease_ms=10_000, worker_id="w")
    # Then the plain job runs and the damaged one is parked in its place in line
    assert reply.jobs[:1] == [plain.id.encode()]
    assert await damaged.state() is JobState.PARKED
    assert await queue.ids(JobState.PARKED) == [damaged.id]


# ---- 8. an attempt that never ran a handler gives its tokens back -----------------------------------------
async def test_a_job_without_a_handler_is_not_charged(redis: Redis, prefix: str, queue: Queue) -> None:
    # Given a budgeted job that no handler of the worker serves
    await queue.budgets.create("team", 1000)
    job = await queue.add("nobody", tokens=400, budget="team")
    w = Worker("q", prefix=prefix, concurrency=1, lease=5.0)

    @w.handler
    async def other(ctx: JobContext) -> None:
        return None

    # When the worker dead-letters it
    async with running(w, redis):
        with pytest.raises(JobFailed):
            await job.result(timeout=10)
    # Then nothing was charged: no handler ran, so no provider was called
    team = await queue.budgets.get("team")
    assert (team.used, team.unknown_outcomes) == (0, 0)
    assert (await queue.counts())["unknown_outcome"] == 0


# ---- 9. token counts stay where Lua writes them exactly --------------------------------------------------
async def test_token_counts_past_the_largest_are_refused(queue: Queue) -> None:
    with pytest.raises(ConfigurationError, match="at most"):
        await queue.set_token_rate_limit(MAX_TOKENS + 1)
    await queue.budgets.create("big", MAX_TOKENS - 5)
    with pytest.raises(BudgetError, match="past"):
        await queue.budgets.credit("big", 10)
    assert (await queue.budgets.get("big")).limit == MAX_TOKENS - 5
    ctx = JobContext("q", "1", "llm", None, 1, 3, 0, "w", b"1")
    with pytest.raises(ValueError, match="from 0 to"):
        ctx.record_usage(MAX_TOKENS + 1)
    with pytest.raises(ValueError, match="an outcome is"):
        short: Any = [("1", b"1", b"c", b"1", 0)]
        await queue.protocol.step(now=T, want=0, lease_ms=100, worker_id="w", outcomes=short)


# ---- 10. an unknown outcome is counted on its budget even after the window moved on ---------------------
async def test_an_unknown_outcome_is_counted_on_a_budget_whose_window_has_turned(queue: Queue) -> None:
    # Given a job holding a reservation on a one-second rolling budget
    await queue.budgets.create("a", 10, window=1, now=T)
    await queue.add("llm", tokens=3, budget="a")
    assert len((await queue.protocol.step(now=T, want=1, lease_ms=100, worker_id="w")).jobs) == LEASED_FIELDS
    # When its lease is reaped after the charge has left the window
    assert await queue.protocol.reap(now=T + 1000) == (1, 0)
    # Then the budget counts the unknown outcome all the same
    assert (await queue.counts())["unknown_outcome"] == 1
    assert (await queue.budgets.get("a", now=T + 1001)).unknown_outcomes == 1
