"""The measured headroom: workers time their calls from dispatch to send, and the pacer's windows
widen by the spread of those delays over every worker (engine/lag.py, lua/lag.lua).

The meter's arithmetic with explicit times; the script's merge of reports (the spread over
workers, expiry, withdrawal, the bound, the token-rate window's length) on a real Redis; the
dispatch using it; and two real worker processes whose handlers send after known waits.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from redis.asyncio import Redis

from sluice import JobContext, JobSpec, Queue
from sluice.engine.budget_state import TOKEN_RATE_BUDGET
from sluice.engine.lag import (
    LEARN_MAX_MS,
    MIN_SAMPLES,
    REPORT_INTERVAL_S,
    SOON_INTERVAL_S,
    WINDOW_S,
    LagMeter,
)
from tests.engine.test_flow import FLOW_TARGET
from tests.harness.proc_harness import WorkerProcs
from tests.harness.stepping import ids_of as ids
from tests.harness.stepping import step

#: A fixed clock for the tests that pass ``now`` (Unix ms).
T = 1_800_000_000_000


# ---- the meter ------------------------------------------------------------------------------------------
def test_the_meter_takes_the_least_reply_delay_as_the_clock_offset() -> None:
    meter = LagMeter()
    meter.sent(T, at_ms=T + 5)
    assert meter.spread(now_ms=T + 5) is None  # no reply yet: no offset, no sample
    # This host's clock runs 1,000 ms ahead of Redis's; replies took 3 and 1 ms to come back.
    meter.reply(T, received_ms=T + 1003)
    meter.reply(T + 10, received_ms=T + 1011)
    meter.sent(T + 10, at_ms=T + 1016)  # 5 ms after the reply was taken
    meter.sent(T + 10, at_ms=T + 1041)  # 30 ms after
    assert meter.spread(now_ms=T + 1041) == (5.0, 30.0)


def test_old_samples_leave_the_spread() -> None:
    meter = LagMeter()
    meter.reply(T, received_ms=T)
    meter.sent(T, at_ms=T + 20)
    meter.sent(T, at_ms=T + 45)
    assert meter.spread(now_ms=T + 45) == (20.0, 45.0)
    # Past the window, old samples leave: only those taken since count.
    later = int(T + WINDOW_S * 1000 + 100)
    meter.reply(later - 50, received_ms=later - 50)
    meter.sent(later - 50, at_ms=later)
    assert meter.spread(now_ms=later) == (50.0, 50.0)


def test_a_429_raises_the_highest_delay_by_how_early_the_call_came() -> None:
    meter = LagMeter()
    meter.reply(T, received_ms=T)
    meter.sent(T, at_ms=T + 2)
    meter.sent(T, at_ms=T + 9)
    meter.throttled(6.0, at_ms=T + 10)  # the provider asked for 6 ms: the call was early by that
    meter.throttled(-1.0, at_ms=T + 10)  # (a wait of nothing teaches nothing)
    assert meter.spread(now_ms=T + 10) == (2.0, 15.0)
    meter.throttled(LEARN_MAX_MS + 1, at_ms=T + 11)  # a longer wait is a window's turn: nothing
    assert meter.spread(now_ms=T + 11) == (2.0, 15.0)
    assert meter.report_due(now_s=100.0) == (2.0, 15.0)  # due at once
    # it is forgotten with the samples of its time
    later = T + WINDOW_S * 1000 + 20
    meter.sent(T, at_ms=later)
    assert meter.spread(now_ms=later) == (later - T, later - T)


def test_lateness_is_the_send_delay_and_the_transit_beyond_the_quickest() -> None:
    meter = LagMeter()
    meter.reply(T, received_ms=T)
    quick = meter.sent(T, at_ms=T + 2)
    slow = meter.sent(T, at_ms=T + 14)
    assert (quick, slow) == (2.0, 14.0)
    assert meter.lateness(quick, 40.0, at_ms=T + 100) == 0.0  # the first transit is the quickest
    assert meter.lateness(slow, 55.0, at_ms=T + 101) == 12.0 + 15.0
    assert meter.lateness(slow, None, at_ms=T + 102) == 12.0  # no transit said: the send alone
    assert meter.lateness(None, 30.0, at_ms=T + 103) == 0.0  # quicker than all: the new least


def test_reports_come_soon_at_first_then_every_interval() -> None:
    meter = LagMeter()
    meter.reply(T, received_ms=T)
    assert meter.report_due(now_s=100.0) is None  # nothing measured
    for i in range(MIN_SAMPLES):
        meter.sent(T, at_ms=T + i)
    assert meter.report_due(now_s=100.0) is not None
    meter.sent(T, at_ms=T + 3)
    assert meter.report_due(now_s=100.0 + SOON_INTERVAL_S) is None  # one sample: not yet
    assert meter.report_due(now_s=100.0 + REPORT_INTERVAL_S) is not None
    assert meter.report_due(now_s=100.0 + 2 * REPORT_INTERVAL_S) is None  # nothing new


# ---- the script ------------------------------------------------------------------------------------------
def lag_keys(queue: Queue) -> list[str]:
    k = queue.keys
    return [k.control, k.lags, k.budget_prefix, k.budget_log_prefix]


async def report(queue: Queue, worker: str, lo: float, hi: float, now: int, ttl: int = 10_000) -> int:
    return int(await queue.scripts.lag(keys=lag_keys(queue), args=[now, worker, lo, hi, ttl, 0]))


async def test_the_headroom_is_the_spread_over_all_workers(queue: Queue) -> None:
    # Each worker's own spread is 4 ms; together they span 2 to 27 ms
    assert await report(queue, "a", 2.0, 6.0, T) == 4
    assert await report(queue, "b", 23.0, 27.0, T + 1) == 25
    flow = await queue.flow(now=T + 1)
    assert (flow.headroom_ms, flow.measured_headroom_ms, flow.effective_headroom_ms) == (10, 25, 25)
    # b's report expires: a's alone counts again at the next report
    assert await report(queue, "a", 2.0, 6.5, T + 10_002) == 5
    assert await queue.redis.hkeys(queue.keys.lags) == [b"a"]
    # a leaves: nothing is measured, the least set is what counts
    await queue.scripts.lag(
        keys=lag_keys(queue),
        args=[T + 10_003, "a", 0, 0, 0, 1],
    )
    assert await report(queue, "c", 1.0, 1.0, T + 10_004) == 0
    flow = await queue.flow(now=T + 10_004)
    assert (flow.measured_headroom_ms, flow.effective_headroom_ms) == (0, 10)


async def test_the_measured_headroom_is_bounded(queue: Queue) -> None:
    assert await report(queue, "a", 0.0, 9_000.0, T) == 500


async def test_the_token_window_counts_over_the_larger_headroom(queue: Queue) -> None:
    await queue.set_token_rate_limit(1000, per=1)
    budget = queue.keys.budget_prefix + TOKEN_RATE_BUDGET
    assert await queue.redis.hget(budget, "win_ms") == b"1010"
    await report(queue, "a", 0.0, 40.0, T)
    assert await queue.redis.hget(budget, "win_ms") == b"1040"
    await queue.set_pacing(headroom_ms=60)  # the least set is larger now
    assert await queue.redis.hget(budget, "win_ms") == b"1060"
    await report(queue, "a", 0.0, 10.0, T + 1)
    assert await queue.redis.hget(budget, "win_ms") == b"1060"
    await queue.set_pacing(headroom_ms=0)
    assert await queue.redis.hget(budget, "win_ms") == b"1010"


async def test_a_token_window_that_grows_is_charged_what_it_dropped_meanwhile(queue: Queue) -> None:
    # Given 1000 tokens a second (least headroom 0), 500 of them charged over the last second
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_token_rate_limit(1000, per=1)
    await queue.add_bulk(JobSpec("llm", tokens=100) for _ in range(5))
    for i in range(5):
        assert len(ids(await step(queue, T + i * 200, want=1))) == 1
    assert (await queue.flow(now=T + 1000)).tokens_in_window == 400  # the one from T has left

    # When the measured headroom grows to 100 ms, the window would count again what it dropped
    # in its last 100 ms (the 100 from T): it is charged 400 x 100 / 1000 = 40 in its place,
    # leaving 50 ms later
    await report(queue, "a", 0.0, 100.0, T + 1000)
    flow = await queue.flow(now=T + 1000)
    assert (flow.effective_headroom_ms, flow.tokens_in_window) == (100, 440)
    assert (await queue.flow(now=T + 1049)).tokens_in_window == 440
    assert (await queue.flow(now=T + 1050)).tokens_in_window == 400
    # and a window that shrinks is charged nothing
    await report(queue, "a", 0.0, 10.0, T + 1051)
    assert (await queue.flow(now=T + 1051)).tokens_in_window == 400


async def test_the_pacer_spaces_starts_by_the_measured_headroom(queue: Queue) -> None:
    # 4 starts a second, no least headroom, no tolerance: 250 ms apart
    await queue.set_pacing(tolerance_ms=0, headroom_ms=0)
    await queue.set_rate_limit(4, per=1)
    await queue.add_bulk(JobSpec("x") for _ in range(8))
    assert (await step(queue, T)).next_due == T + 250
    # Workers measure 100 ms of spread: (1000 + 100) / 4 = 275 ms apart from the next start on
    await report(queue, "a", 0.0, 100.0, T + 1)
    assert len(ids(await step(queue, T + 250))) == 1
    assert (await step(queue, T + 251)).next_due == T + 525
    # and the log counts over 1,100 ms: the fifth start waits for the first to leave it
    for at in (T + 525, T + 800):
        assert len(ids(await step(queue, at))) == 1
    reply = await step(queue, T + 1075)
    assert (ids(reply), reply.next_due) == ([], T + 1100)


# ---- real workers ----------------------------------------------------------------------------------------
async def test_worker_processes_measure_the_spread_of_their_sends(
    redis: Redis, queue: Queue, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # Given two worker processes whose handlers send 0 to 60 ms after they start
    waits = [i % 7 * 0.01 for i in range(70)]
    with WorkerProcs(redis_url, prefix, tmp_path) as procs:
        workers = [procs.launch(wid, FLOW_TARGET, "--concurrency", "8") for wid in ("w1", "w2")]
        jobs = await queue.add_bulk(JobSpec("sends", {"before": w}) for w in waits)
        for job in jobs:
            await job.result(timeout=60)
        # Then within a report interval the queue's measured headroom covers the 60 ms
        deadline = time.monotonic() + 10
        measured = 0
        while time.monotonic() < deadline:
            measured = (await queue.flow()).measured_headroom_ms
            if measured >= 60 and await redis.hlen(queue.keys.lags) == 2:
                break
            await asyncio.sleep(0.1)
        assert 60 <= measured <= 500, measured
        assert sorted(await redis.hkeys(queue.keys.lags)) == [b"w1", b"w2"]
        # And workers that stop withdraw their reports
        for w in workers:
            w.send(signal.SIGTERM)
        for w in workers:
            assert await w.wait_exit() == 0
        assert await redis.hkeys(queue.keys.lags) == []


def test_a_context_outside_a_worker_measures_nothing_but_knows_its_first_call() -> None:
    ctx = JobContext("q", "1", "x", None, 1, 1, 0, "w", 1)
    assert ctx.note_sent() is True  # no meter: nothing measured, and no error
    assert ctx.sent_delay is None
    assert ctx.note_sent() is False  # a second call of the attempt is not the one dispatched


async def test_past_256_reports_the_expired_ones_still_go(queue: Queue) -> None:
    # Given 257 workers that reported (one with a 100 ms spread), then crashed without a word
    for i in range(257):
        await report(queue, f"w{i}", 0.0, 100.0 if i == 0 else 3.0, T, ttl=1_000)
    assert (await queue.flow(now=T)).measured_headroom_ms == 100
    # When a live worker reports after they expired, the expired are swept (a bounded sample
    # per report) and the headroom follows the live ones again
    await report(queue, "live", 0.0, 3.0, T + 5_000)
    assert await report(queue, "live", 0.0, 3.0, T + 5_001) == 3
    assert await queue.redis.hkeys(queue.keys.lags) == [b"live"]


async def test_two_workers_growing_the_window_at_once_leave_a_consistent_count(queue: Queue) -> None:
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_token_rate_limit(1000, per=1)
    await queue.add("llm", tokens=100)
    await step(queue, T)
    await report(queue, "a", 0.0, 40.0, T + 10)
    await report(queue, "b", 0.0, 60.0, T + 10)  # the same ms: two charges, not one overwritten
    budget = queue.keys.budget_prefix + TOKEN_RATE_BUDGET
    log: list[bytes] = await queue.redis.zrange(queue.keys.budget_log_prefix + TOKEN_RATE_BUDGET, 0, -1)  # type: ignore[assignment]
    used: bytes = await queue.redis.hget(budget, "used")  # type: ignore[assignment]
    assert int(used) == sum(int(m.split(b" ")[0]) for m in log)
    # and once every charge has left, the window is empty
    assert (await queue.flow(now=T + 10 * 60_000)).tokens_in_window == 0
