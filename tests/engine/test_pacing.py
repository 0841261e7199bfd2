"""The pacer: starts spaced evenly inside the rate limits, the exact logs as the hard cap.

Step by step with the clock passed in (:meth:`Queue.step`), then as a property
over random call schedules (any W + h holds at most N starts, and any
interval of length d at most 1 + (d + tau) / T of them), and with two real
worker processes: paced starts spread over the window, unpaced ones come in a
burst as soon as it opens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import ConfigurationError, JobSpec, Queue
from sluice.engine.budget_state import TOKEN_RATE_BUDGET
from tests.engine.test_flow import FLOW_TARGET, both_idle
from tests.harness.proc_harness import WorkerProcs
from tests.harness.stepping import ids_of as ids
from tests.harness.stepping import leased, step

#: A fixed clock for the tests that pass ``now`` (Unix ms).
T = 1_800_000_000_000


# ---- step by step -----------------------------------------------------------------------------------------
async def test_the_request_pacer_spaces_starts_by_w_over_n(queue: Queue) -> None:
    # Given at most 4 starts a second (one per 250 ms: no headroom), paced with the default
    # 20 ms tolerance
    await queue.set_pacing(headroom_ms=0)
    await queue.set_rate_limit(4, per=1)
    jobs = await queue.add_bulk(JobSpec("x") for _ in range(8))

    # When a worker asks for all of them at once
    reply = await step(queue, T)

    # Then it gets one, and is told to come back 20 ms before the next is due
    assert (ids(reply), reply.next_due) == ([jobs[0].id], T + 230)
    assert (await queue.refusals())["rate"] == 1
    assert ids(await step(queue, T + 229)) == []
    reply = await step(queue, T + 230)
    assert (ids(reply), reply.next_due) == ([jobs[1].id], T + 480)  # due at T + 500, less 20

    # When a worker comes late (T + 900, where two were due), it takes what the tolerance
    # lets it owe: nothing is made up beyond it
    reply = await step(queue, T + 900)
    assert (ids(reply), reply.next_due) == ([jobs[2].id], T + 1130)


async def test_a_larger_tolerance_lets_a_late_worker_catch_up_within_the_log(queue: Queue) -> None:
    # With 600 ms of tolerance and 250 ms per start, a worker may be up to 2.4 starts ahead
    await queue.set_pacing(tolerance_ms=600, headroom_ms=0)
    await queue.set_rate_limit(4, per=1)
    jobs = await queue.add_bulk(JobSpec("x") for _ in range(8))
    # 1 + 600 / 250 -> 3 at once (their theoretical times T, T + 250, T + 500)
    reply = await step(queue, T)
    assert (ids(reply), reply.next_due) == ([j.id for j in jobs[:3]], T + 150)
    # the fourth is due at T + 750, less 600
    reply = await step(queue, T + 150)
    assert ids(reply) == [jobs[3].id]
    # the pacer would let the fifth go at T + 400, but the log (4 per second) holds it until T + 1000
    reply = await step(queue, T + 400)
    assert (ids(reply), reply.next_due) == ([], T + 1000)
    # and then three at once: the log holds only the one from T + 150, the pacer's times
    # (T + 1000, T + 1250, T + 1500) are within 600 ms
    assert ids(await step(queue, T + 1000)) == [j.id for j in jobs[4:7]]


async def test_the_token_pacer_spaces_starts_by_their_tokens(queue: Queue) -> None:
    # Given 1000 tokens a second: one ms per token (no headroom)
    await queue.set_pacing(headroom_ms=0)
    await queue.set_token_rate_limit(1000, per=1)
    a, free, b, c = await queue.add_bulk(
        [JobSpec("llm", tokens=100), JobSpec("x"), JobSpec("llm", tokens=100), JobSpec("llm", tokens=300)]
    )
    # Then the first goes, a job with no tokens is not held back, the next waits 100 ms less 20
    reply = await step(queue, T)
    assert (ids(reply), reply.next_due) == ([a.id, free.id], T + 80)
    assert (await queue.refusals())["token_rate"] == 1
    reply = await step(queue, T + 80)
    assert (ids(reply), reply.next_due) == ([b.id], T + 180)
    assert ids(await step(queue, T + 180)) == [c.id]


async def test_the_headroom_widens_the_windows_the_logs_count(queue: Queue) -> None:
    # Given 30 ms of headroom and the logs alone (no pacer)
    await queue.set_pacing(tolerance_ms=None, headroom_ms=30)
    await queue.set_rate_limit(2, per=1)
    await queue.set_token_rate_limit(1000, per=1)
    jobs = await queue.add_bulk(JobSpec("llm", tokens=400) for _ in range(5))

    # Then two start at once, and the third waits W + h, for either log
    reply = await step(queue, T)
    assert (ids(reply), reply.next_due) == ([j.id for j in jobs[:2]], T + 1030)
    flow = await queue.flow(now=T + 1029)
    assert (flow.starts_in_window, flow.tokens_in_window) == (2, 800)
    assert (flow.rate_per_seconds, flow.token_per_seconds, flow.headroom_ms) == (1.0, 1.0, 30)
    tpm = await queue.budgets.get(TOKEN_RATE_BUDGET, now=T)
    assert tpm is not None and tpm.window_seconds == 1.03
    assert ids(await step(queue, T + 1029)) == []
    assert ids(await step(queue, T + 1030)) == [j.id for j in jobs[2:4]]

    # When the headroom goes, the token window counts over its own length again
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    tpm = await queue.budgets.get(TOKEN_RATE_BUDGET, now=T)
    assert tpm is not None and tpm.window_seconds == 1.0


async def test_the_pacer_spaces_by_w_plus_h_over_n(queue: Queue) -> None:
    # 1030 ms / 4 = 257.5 ms per start, kept to the microsecond
    await queue.set_pacing(headroom_ms=30)
    await queue.set_rate_limit(4, per=1)
    await queue.add_bulk(JobSpec("x") for _ in range(3))
    assert (await step(queue, T)).next_due == T + 238  # 237.5, rounded up
    assert (await step(queue, T + 238)).next_due == T + 495


async def test_flow_reports_the_pacing(queue: Queue) -> None:
    flow = await queue.flow(now=T)
    assert (flow.pace_tolerance_ms, flow.headroom_ms) == (20, 10)
    await queue.set_pacing(tolerance_ms=5, headroom_ms=0)
    flow = await queue.flow(now=T)
    assert (flow.pace_tolerance_ms, flow.headroom_ms) == (5, 0)
    await queue.set_pacing(tolerance_ms=None)
    flow = await queue.flow(now=T)
    assert (flow.pace_tolerance_ms, flow.headroom_ms) == (None, 10)


@pytest.mark.parametrize("bad", [-1, 60_001, 1.5, True, "20"])
async def test_unusable_pacing_is_a_configuration_error(queue: Queue, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="tolerance_ms must be an integer number of ms"):
        await queue.set_pacing(tolerance_ms=bad)
    with pytest.raises(ConfigurationError, match="headroom_ms must be an integer number of ms"):
        await queue.set_pacing(headroom_ms=bad)
    assert await queue.redis.hgetall(queue.keys.control) == {}


# ---- a property over random call schedules ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("seed", "tolerance", "headroom"), [(1, 0, 0), (2, 20, 0), (3, 20, 10), (4, 60, 10), (5, 60, 0)]
)
async def test_paced_starts_keep_both_the_cap_and_the_spacing(
    queue: Queue, seed: int, tolerance: int, headroom: int
) -> None:
    """Workers call at random times (1 to 30 ms apart) asking for 1 to 4 jobs; every start
    is checked against both limits: the log's cap over W + h, and the pacer's spacing."""
    rnd = random.Random(seed)
    n, w = 5, 200  # requests per ms
    limit, tw = 600, 1000  # tokens per ms
    await queue.set_pacing(tolerance_ms=tolerance, headroom_ms=headroom)
    await queue.set_rate_limit(n, per=w / 1000)
    await queue.set_token_rate_limit(limit, per=tw / 1000)
    cost = {}
    for job in await queue.add_bulk(JobSpec("llm", tokens=rnd.choice([0, 5, 20, 40])) for _ in range(300)):
        cost[job.id] = (await queue.get_job(job.id)).tokens  # type: ignore[union-attr]
    starts: list[tuple[int, int]] = []  # (when, tokens)
    now = T
    while now < T + 3000:
        now += rnd.randint(1, 30)
        for job_id in ids(await step(queue, now, want=rnd.randint(1, 4))):
            starts.append((now, cost[job_id]))
    assert len(starts) > 50  # the schedule admitted something: 3 s at up to 25 a second

    t_req = (w + headroom) / n  # ms per start
    t_tok = (tw + headroom) / limit  # ms per token
    for i, (s_i, _) in enumerate(starts):
        # the cap: at most n starts and `limit` tokens in any W + h
        window = [c for s, c in starts if s_i - (w + headroom) < s <= s_i]
        assert len(window) <= n
        window_tok = [c for s, c in starts if s_i - (tw + headroom) < s <= s_i]
        assert sum(window_tok) <= limit
        # the spacing: j - i starts after start i, at least (j - i) * T - tau later;
        # tokens: the tokens of those before j, at T per token
        paid = 0
        for j in range(i + 1, len(starts)):
            s_j = starts[j][0]
            assert (j - i) * t_req <= s_j - s_i + tolerance, (i, j, starts[i : j + 1])
            paid += starts[j - 1][1]
            if starts[j][1] > 0:
                assert paid * t_tok <= s_j - s_i + tolerance + 1e-9, (i, j, starts[i : j + 1])


# ---- two worker processes ---------------------------------------------------------------------------------
@pytest.fixture
def procs(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[WorkerProcs]:
    with WorkerProcs(redis_url, prefix, tmp_path) as p:
        yield p


def most_in(starts: list[int], ms: int) -> int:
    """The most starts in any interval of ``ms`` (half-open)."""
    return max(sum(1 for t in starts[i:] if t < s + ms) for i, s in enumerate(starts))


@pytest.mark.slow
@pytest.mark.parametrize("paced", [True, False])
async def test_paced_starts_spread_over_the_window_across_processes(
    procs: WorkerProcs, redis: Redis, queue: Queue, paced: bool
) -> None:
    # Given 50 starts a second over the queue and two idle processes of 16 slots each
    if not paced:
        await queue.set_pacing(tolerance_ms=None)
    await queue.set_rate_limit(50, per=1)
    for wid in ("A", "B"):
        procs.launch(wid, FLOW_TARGET, "--concurrency", "16")
    await both_idle(redis, queue)

    # When 60 short jobs come at once
    jobs = await queue.add_bulk(JobSpec("probe") for _ in range(60))
    for j in jobs:
        await j.result(timeout=15)

    records = [r for r in await queue.get_jobs([j.id for j in jobs]) if r is not None]
    starts = sorted(r.started_ms for r in records if r.started_ms is not None)
    assert len(starts) == 60
    # Then no 51 starts fall in any second (the log's cap over 1.03 s, either way)
    assert most_in(starts, 1000) <= 50
    if paced:
        # and paced (20.6 ms apart, 20 ms of tolerance) at most 1 + (100 + 20) / 20.6 < 7 start in
        # any 100 ms, far below the 50 the window would let go at once
        assert most_in(starts, 100) <= 6, starts
        # yet at the rate asked: 60 starts 20.6 ms apart take about 1.2 s, not a second window
        assert 1000 <= starts[-1] - starts[0] < 2500, starts
    else:
        # unpaced, the whole window leaves at once: every slot in the first 100 ms
        assert most_in(starts, 100) >= 30, starts


# ---- after a provider's 429 -------------------------------------------------------------------------------
async def test_repeated_429s_slow_the_pacer_which_then_recovers(queue: Queue) -> None:
    # Given 4 starts a second, 4 of them leased at T (a wide tolerance lets them go at once)
    await queue.set_pacing(tolerance_ms=1000, headroom_ms=0)
    await queue.set_rate_limit(4, per=1)
    await queue.add_bulk(JobSpec("x") for _ in range(12))
    (j1, t1), (j2, t2), (j3, t3), _ = leased(await step(queue, T))

    # When a first call gets a 429 asking for 100 ms: the queue waits that long, and the
    # pacer keeps its rate (one late arrival is an accident of timing)
    assert (await step(queue, T + 10, want=0, outcomes=[(j1, t1, b"t", b"100", 0, 0)])).codes == [6]
    flow = await queue.flow(now=T + 10)
    assert (flow.throttled_until_ms, flow.pace_factor_pm) == (T + 110, 1000)
    # a second within 250 ms is the same mistake
    await step(queue, T + 200, want=0, outcomes=[(j2, t2, b"t", b"0", 0, 0)])
    assert (await queue.flow(now=T + 200)).pace_factor_pm == 1000

    # When another comes later within the recovery, the pacer runs at 95 % of the limit's
    # rate, climbing back over two windows (2 s)
    await step(queue, T + 300, want=0, outcomes=[(j3, t3, b"t", b"0", 0, 0)])
    assert (await queue.flow(now=T + 300)).pace_factor_pm == 950
    assert (await queue.flow(now=T + 1300)).pace_factor_pm == 975
    assert (await queue.flow(now=T + 2300)).pace_factor_pm == 1000
    # at 975 per mille the starts are 250 / 0.975 = 256.4 ms apart
    await queue.set_pacing(tolerance_ms=0, headroom_ms=0)
    assert len(ids(await step(queue, T + 1300))) == 1
    assert (await step(queue, T + 1301)).next_due == T + 1557
