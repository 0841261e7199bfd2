"""Flow control: the gates of the dispatch script, shared by every worker of a queue.

The token-rate, request-rate and concurrency gates are first driven through
:meth:`Queue.step` with the clock passed in. Throttling, pausing and waking
are checked with a Worker in this event loop, and the claims about several
workers (a global ceiling, a shared request rate) with two real worker
processes (tests/harness/flow_workers.py) whose handler records what it saw in Redis.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from sluice import (
    ConfigurationError,
    InvalidJobError,
    JobContext,
    JobRejected,
    JobSpec,
    JobState,
    Queue,
    Throttled,
    Worker,
)
from sluice.engine.clock import now_ms
from sluice.engine.job import MAX_TOKENS
from tests.conftest import eventually, running
from tests.harness.flow_workers import peaks_key, spans_key
from tests.harness.proc_harness import WorkerProc, WorkerProcs
from tests.harness.stepping import LEASE_MS, completed, leased, step
from tests.harness.stepping import ids_of as ids

#: A fixed clock for the tests that pass ``now`` (Unix ms).
T = 1_800_000_000_000


# ---- the token-rate window ------------------------------------------------------------------------------
async def test_the_token_window_keeps_what_the_providers_limiter_counted(queue: Queue) -> None:
    # Given 1000 tokens a minute at a provider that counts prompt + max_tokens on arrival and
    # gives nothing back (OpenAI's: the default)
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_token_rate_limit(1000, per=60)
    j1, j2, _ = await queue.add_bulk(JobSpec("llm", tokens=400) for _ in range(3))
    (_, t1), (_, t2) = leased(await step(queue, T, want=2))

    # When the first reports 100 tokens used, the window still counts its 400: the third waits
    reply = await step(queue, T + 1000, outcomes=[completed(j1.id, t1, usage=100)])
    assert (reply.codes, ids(reply)) == ([1], [])
    assert (await queue.flow(now=T + 1000)).tokens_in_window == 800
    # And usage above the estimate is counted in full
    await step(queue, T + 1001, want=0, outcomes=[completed(j2.id, t2, usage=550)])
    assert (await queue.flow(now=T + 1001)).tokens_in_window == 950
    # while the job's record says what it used and was charged, for the bill
    last = (await queue.get_job(j1.id)).attempts_spend[-1]  # type: ignore[union-attr]
    assert (last.reported, last.charged, (await queue.get_job(j1.id)).spent) == (100, 100, 100)  # type: ignore[union-attr]


async def test_token_rate_limit_admits_what_fits_and_reported_usage_frees_room(queue: Queue) -> None:
    # Given at most 1000 tokens a minute at a provider that gives back what a call did not
    # use, and jobs estimated at 400 tokens (the window alone: no pacer)
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_token_rate_limit(1000, per=60, refund_unused=True)
    j1, j2, j3, j4 = await queue.add_bulk(JobSpec("llm", tokens=400) for _ in range(4))

    # When a worker takes one at T and more half a second later
    assert ids(await step(queue, T, want=1)) == [j1.id]
    reply = await step(queue, T + 500)

    # Then only two are dispatched in the window, and the worker is told when it frees
    assert ids(reply) == [j2.id]
    assert reply.next_due == T + 60_000
    assert (await queue.flow(now=T + 500)).tokens_in_window == 800
    assert ids(await step(queue, T + 999)) == []

    # When the first completes reporting 100 tokens used
    token1 = b"1"
    reply = await step(queue, T + 1000, outcomes=[completed(j1.id, token1, usage=100)])

    # Then the 300 it did not use are free again at once: the third runs in the same call
    assert reply.codes == [1]
    assert ids(reply) == [j3.id]
    assert (await queue.flow(now=T + 1000)).tokens_in_window == 900
    # and the fourth must wait until j1's 100 and j2's 400 leave the window, which is
    # when j2 (reserved at T + 500) is a minute old: j1's 100 alone would not do
    assert reply.next_due == T + 500 + 60_000
    assert ids(await step(queue, T + 60_499)) == []
    assert ids(await step(queue, T + 60_500)) == [j4.id]
    assert (await queue.flow(now=T + 60_500)).tokens_in_window == 800


async def test_a_job_larger_than_the_token_rate_limit_is_rejected_with_a_reason(queue: Queue) -> None:
    await queue.set_token_rate_limit(1000, per=60)
    huge = await queue.add("llm", tokens=1001)
    fits = await queue.add("llm", tokens=1000)
    assert ids(await step(queue, T)) == [fits.id]
    assert await huge.state() is JobState.REJECTED
    with pytest.raises(JobRejected, match="token estimate 1001 exceeds the queue token-rate limit of 1000"):
        await huge.result(timeout=1)
    counts = await queue.counts()
    assert (counts["rejected"], counts["failed"]) == (1, 0)


async def test_the_token_rate_window_blocks_in_priority_order(queue: Queue) -> None:
    # A job that does not fit the window holds back the jobs behind it, even smaller
    # ones: the window is queue-wide, and nothing may overtake the head of the line
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_token_rate_limit(1000, per=60)
    first = await queue.add("llm", tokens=900)
    big = await queue.add("llm", tokens=200)
    small = await queue.add("llm", tokens=50)
    reply = await step(queue, T)
    assert (ids(reply), reply.next_due) == ([first.id], T + 60_000)
    assert ids(await step(queue, T + 1)) == []  # the 50 would fit the 100 left, but waits its turn
    assert ids(await step(queue, T + 60_000)) == [big.id, small.id]


# ---- the request-rate window and the global ceiling, step by step --------------------------------------
async def test_request_rate_window_in_steps(queue: Queue) -> None:
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)  # the log alone
    await queue.set_rate_limit(4, per=1)
    jobs = await queue.add_bulk(JobSpec("x") for _ in range(10))
    reply = await step(queue, T)
    assert ids(reply) == [j.id for j in jobs[:4]]
    assert reply.next_due == T + 1000
    assert ids(await step(queue, T + 999)) == []
    reply = await step(queue, T + 1000)
    assert ids(reply) == [j.id for j in jobs[4:8]]
    assert reply.next_due == T + 2000
    flow = await queue.flow(now=T + 1000)
    assert (flow.rate_max, flow.rate_per_seconds, flow.starts_in_window) == (4, 1.0, 4)


async def test_global_concurrency_in_steps(queue: Queue) -> None:
    # Given a ceiling of 2 jobs at once over all workers
    await queue.set_global_concurrency(2)
    j1, j2, j3, j4 = await queue.add_bulk(JobSpec("x") for _ in range(4))
    reply = await queue.protocol.step(now=T, want=4, lease_ms=LEASE_MS, worker_id="w1")
    assert ids(reply) == [j1.id, j2.id]
    assert reply.next_due == -1  # only a completion can open it: no time to come back at

    # Then another worker gets nothing
    assert ids(await queue.protocol.step(now=T + 1, want=4, lease_ms=LEASE_MS, worker_id="w2")) == []

    # and the call that reports a completion takes the next job itself
    done = [completed(j1.id, b"1")]
    reply = await queue.protocol.step(now=T + 2, want=3, lease_ms=LEASE_MS, worker_id="w1", outcomes=done)
    assert (reply.codes, ids(reply)) == ([1], [j3.id])
    assert (await queue.flow()).active == 2

    # and removing the ceiling lets the rest go
    await queue.set_global_concurrency(None)
    assert ids(await step(queue, T + 3)) == [j4.id]


# ---- throttling ----------------------------------------------------------------------------------------
async def test_a_throttled_attempt_pauses_the_queue_and_is_not_counted(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a budget, a job "a" of 100 tokens on it, and three plain jobs behind it
    await queue.budgets.create("b", 1000)
    a = await queue.add("llm", "a", tokens=100, budget="b")
    b, c, d = await queue.add_bulk(JobSpec("llm", x) for x in "bcd")
    starts: dict[str, list[int]] = {}
    throttled_at = 0
    used_on_retry: list[int] = []
    w = Worker("q", prefix=prefix, concurrency=2, lease=5.0)

    @w.handler
    async def llm(job: JobContext) -> str:
        nonlocal throttled_at
        starts.setdefault(job.payload, []).append(now_ms())
        if job.payload == "a" and len(starts["a"]) == 1:
            # When the provider answers "429, retry after 0.3 s" to a's first call
            await asyncio.sleep(0.05)
            throttled_at = now_ms()
            raise Throttled(retry_after=0.3)
        if job.payload == "a":
            used_on_retry.append((await queue.budgets.get("b")).used)
            job.record_usage(80)
        elif job.payload == "b":
            await asyncio.sleep(0.1)  # ends inside the throttle window
        return str(job.payload)

    async with running(w, redis):
        results = [await j.result(timeout=10) for j in (a, b, c, d)]
    assert results == ["a", "b", "c", "d"]

    # Then nothing started while the queue was throttled: b had started before
    # the 429 and its completion took no job; a's retry, c and d started once it ended
    until = int(await redis.hget(queue.keys.control, "throttled_until") or 0)
    assert until >= throttled_at + 300
    assert starts["b"][0] < throttled_at
    later = [starts["a"][1], starts["c"][0], starts["d"][0]]
    assert min(later) >= until, (later, until)
    records = {r.payload: r for r in await queue.get_jobs([a.id, c.id, d.id]) if r is not None}
    assert all(r.started_ms is not None and r.started_ms >= until for r in records.values())
    # and promptly: the worker came back when told, not after its 5 s block
    assert starts["a"][1] - until < 1000

    # and the throttled attempt did not count: one attempt, no failure
    rec = records["a"]
    assert (rec.state, rec.attempt, rec.failures, rec.usage) == (JobState.COMPLETED, 1, 0, 80)
    counts = await queue.counts()
    assert (counts["throttled"], counts["failed"], counts["retried"], counts["completed"]) == (1, 0, 0, 4)

    # and a "throttled" event says for how long
    entries: Any = await redis.xrange(queue.keys.events, "-", "+")
    throttled = [f for _, f in entries if f[b"ev"] == b"throttled"]
    assert throttled == [{b"ev": b"throttled", b"id": a.id.encode(), b"retry_after_ms": b"300"}]

    # and its reservation was refunded: the retry saw only its own 100 tokens held
    assert used_on_retry == [100]
    first = await queue.budgets.reservation(f"{a.id}:1")
    assert first is not None and first["state"] == "refunded"
    assert rec.reservation == f"{a.id}:2"
    assert (await queue.budgets.get("b")).used == 80


async def test_queue_throttle_holds_dispatch_until_it_ends(queue: Queue) -> None:
    job = await queue.add("x")
    before = now_ms()
    await queue.throttle(30)
    flow = await queue.flow()
    assert flow.throttled_until_ms is not None
    until = flow.throttled_until_ms
    assert before + 30_000 <= until <= now_ms() + 30_000

    reply = await step(queue, until - 1)
    assert (ids(reply), reply.next_due) == ([], until)
    assert ids(await step(queue, until)) == [job.id]

    await queue.throttle(30)
    await queue.throttle(0)
    assert (await queue.flow()).throttled_until_ms is None


async def test_pause_holds_dispatch_and_resume_wakes_an_idle_worker(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a worker of one slot, running a job that waits for a signal
    release = asyncio.Event()
    w = Worker("q", prefix=prefix, concurrency=1, lease=5.0)

    @w.handler
    async def hold(job: JobContext) -> str:
        await release.wait()
        return "held"

    @w.handler
    async def quick(job: JobContext) -> str:
        return "quick"

    async with running(w, redis):
        first = await queue.add("hold")
        await eventually(lambda: _is(first, JobState.ACTIVE))
        second = await queue.add("quick")

        # When the queue is paused, and the running job ends
        await queue.pause()
        assert (await queue.flow()).paused
        release.set()
        assert await first.result(timeout=5) == "held"

        # Then the running job finished, but nothing else is dispatched
        await asyncio.sleep(0.3)
        assert await second.state() is JobState.WAITING
        third = await queue.add("quick")
        await asyncio.sleep(0.3)
        assert await third.state() is JobState.WAITING

        # When it is resumed
        loop = asyncio.get_running_loop()
        resumed = loop.time()
        await queue.resume()

        # Then the idle worker takes the jobs at once (not after its 5 s block)
        assert [await second.result(timeout=3), await third.result(timeout=3)] == ["quick", "quick"]
        assert loop.time() - resumed < 1.0
    assert not (await queue.flow()).paused


async def _is(job: Any, state: JobState) -> bool:
    return bool(await job.state() is state)


async def test_flow_reports_the_gates_and_their_windows(queue: Queue) -> None:
    empty = await queue.flow(now=T)
    assert empty.paused is False
    assert (empty.concurrency, empty.rate_max, empty.token_limit, empty.throttled_until_ms) == (
        None,
        None,
        None,
        None,
    )
    assert (empty.active, empty.starts_in_window, empty.tokens_in_window) == (0, 0, 0)

    await queue.set_global_concurrency(3)
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_rate_limit(4, per=2)
    await queue.set_token_rate_limit(1000, per=60)
    await queue.add_bulk(JobSpec("llm", tokens=100) for _ in range(3))
    await step(queue, T, want=2)

    flow = await queue.flow(now=T + 1)
    assert (flow.concurrency, flow.active) == (3, 2)
    assert (flow.rate_max, flow.rate_per_seconds, flow.starts_in_window) == (4, 2.0, 2)
    assert (flow.token_limit, flow.token_per_seconds, flow.tokens_in_window) == (1000, 60.0, 200)
    # the windows move with the clock
    assert (await queue.flow(now=T + 2000)).starts_in_window == 0
    assert (await queue.flow(now=T + 60_000)).tokens_in_window == 0

    await queue.pause()
    assert (await queue.flow(now=T)).paused

    await queue.set_global_concurrency(None)
    await queue.set_rate_limit(None)
    await queue.set_token_rate_limit(None)
    flow = await queue.flow(now=T + 1)
    assert (flow.concurrency, flow.rate_max, flow.token_limit, flow.tokens_in_window) == (None, None, None, 0)


# ---- two worker processes ------------------------------------------------------------------------------
FLOW_TARGET = "tests.harness.flow_workers:worker"


@pytest.fixture
def procs(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[WorkerProcs]:
    with WorkerProcs(redis_url, prefix, tmp_path) as p:
        yield p


def start_flow_worker(procs: WorkerProcs, worker_id: str, concurrency: int) -> WorkerProc:
    """A ``sluice worker tests.harness.flow_workers:worker`` process, cleaned up with ``procs``."""
    return procs.launch(worker_id, FLOW_TARGET, "--concurrency", str(concurrency))


async def both_idle(redis: Redis, queue: Queue) -> None:
    """Wait until two workers are up and blocked on the wake marker."""

    async def idle() -> bool:
        if len(await redis.hkeys(queue.keys.workers)) < 2:
            return False
        blocked = [c for c in await redis.client_list() if c["cmd"] == "bzpopmin" and "b" in c["flags"]]
        return len(blocked) >= 2

    await eventually(idle, timeout=20)


async def spans(redis: Redis, prefix: str, job_ids: Sequence[str]) -> list[dict[str, Any]]:
    """What the handler recorded for each job: worker, start and end (Unix ms)."""
    raw: Any = await redis.hmget(spans_key(prefix), list(job_ids))
    return [orjson.loads(r) for r in raw if r is not None]


def most_at_once(recorded: list[dict[str, Any]]) -> int:
    """The most handler spans that overlap at one instant."""
    edges = sorted([(s["start"], 1) for s in recorded] + [(s["end"], -1) for s in recorded])
    return max(itertools.accumulate(e for _, e in edges))


@pytest.mark.slow
async def test_global_concurrency_holds_across_worker_processes(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given at most 2 jobs at once over the queue, and two idle worker processes of 3 slots
    await queue.set_global_concurrency(2)
    workers = {wid: start_flow_worker(procs, wid, concurrency=3) for wid in ("A", "B")}
    await both_idle(redis, queue)
    loop = asyncio.get_running_loop()

    # When 12 jobs of 50 ms are added
    began = loop.time()
    jobs = await queue.add_bulk(JobSpec("probe", {"sleep": 0.05}) for _ in range(12))
    await asyncio.gather(*(j.result(timeout=15) for j in jobs))
    took = loop.time() - began

    # Then never more than 2 ran at once, and 2 did: a freed slot is taken at once,
    # so 6 rounds of 50 ms take well under the 5 s a missed wake-up would cost
    peaks = [int(p) for p in await redis.lrange(peaks_key(prefix), 0, -1)]
    assert max(peaks) == 2, peaks
    recorded = await spans(redis, prefix, [j.id for j in jobs])
    assert most_at_once(recorded) <= 2
    assert took < 2.5, took

    # When 16 more jobs of 100 ms come, and the process running them is stopped
    # (SIGTERM: it finishes what it runs and takes nothing more)
    more = await queue.add_bulk(JobSpec("probe", {"sleep": 0.1}) for _ in range(16))

    async def two_done() -> list[dict[str, Any]]:
        done = await spans(redis, prefix, [j.id for j in more])
        return done if len(done) >= 2 else []

    first_runner = (await eventually(two_done))[0]["worker"]
    workers[first_runner].send(signal.SIGTERM)
    await asyncio.gather(*(j.result(timeout=15) for j in more))
    assert await workers[first_runner].wait_exit() == 0

    # Then the other process took over, still within the ceiling, with no pause
    # longer than a job between starts (a missed hand-over would leave one of 5 s)
    recorded = await spans(redis, prefix, [j.id for j in more])
    assert {s["worker"] for s in recorded} == {"A", "B"}
    assert max(int(p) for p in await redis.lrange(peaks_key(prefix), 0, -1)) == 2
    assert most_at_once(recorded) <= 2
    starts = sorted(s["start"] for s in recorded)
    assert max(b - a for a, b in itertools.pairwise(starts)) < 1000, starts
    counts = await queue.counts()
    assert (counts["completed"], counts["active"], counts["waiting"], counts["stalled"]) == (28, 0, 0, 0)


@pytest.mark.slow
async def test_request_rate_holds_across_worker_processes(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given at most 4 starts per second over the queue (the log alone: no pacer), and two
    # idle worker processes
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_rate_limit(4, per=1)
    for wid in ("A", "B"):
        start_flow_worker(procs, wid, concurrency=2)
    await both_idle(redis, queue)

    # When 10 short jobs are added
    jobs = await queue.add_bulk(JobSpec("probe") for _ in range(10))
    await asyncio.gather(*(j.result(timeout=15) for j in jobs))

    # Then every 5 consecutive starts (dispatch times, as stored in the records) span
    # at least a second. No clock tolerance is needed: each start is checked against
    # the stored ones with its own caller's clock, so even starts stamped by two
    # processes whose clocks disagree keep any 5 of them a window apart.
    records = [r for r in await queue.get_jobs([j.id for j in jobs]) if r is not None]
    starts = sorted(r.started_ms for r in records if r.started_ms is not None)
    assert len(starts) == 10
    spans_of_5 = [b - a for a, b in zip(starts, starts[4:], strict=False)]
    assert min(spans_of_5) >= 1000, starts
    # and the limit is not stricter than asked: the first 4 went at once, and each
    # refused worker came back when the window freed (not after its 5 s block)
    assert starts[3] - starts[0] < 500, starts
    assert starts[-1] - starts[0] < 3000, starts
    # both processes dispatched
    assert {r.worker for r in records} == {"A", "B"}


# ---- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
async def test_unusable_limits_are_configuration_errors(queue: Queue, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="must be an integer >= 1"):
        await queue.set_rate_limit(bad)
    with pytest.raises(ConfigurationError, match="must be an integer >= 1"):
        await queue.set_global_concurrency(bad)
    with pytest.raises(ConfigurationError, match="must be an integer >= 1"):
        await queue.set_token_rate_limit(bad)
    assert await queue.redis.hgetall(queue.keys.control) == {}


@pytest.mark.parametrize("per", [0, -1, 0.0001, 86_401, math.nan, math.inf, True, "1"])
async def test_unusable_windows_are_configuration_errors(queue: Queue, per: Any) -> None:
    with pytest.raises(ConfigurationError, match="per must be"):
        await queue.set_rate_limit(4, per=per)
    with pytest.raises(ConfigurationError, match="per must be"):
        await queue.set_token_rate_limit(1000, per=per)


async def test_throttle_and_token_window_bounds(queue: Queue) -> None:
    with pytest.raises(ConfigurationError, match="a token-rate window must be at least 1 second"):
        await queue.set_token_rate_limit(1000, per=0.5)
    for bad in (-1, 86_401, True, math.nan):
        with pytest.raises(ConfigurationError, match="seconds must be from 0 to 86400"):
            await queue.throttle(bad)
    assert await queue.redis.hgetall(queue.keys.control) == {}


@pytest.mark.parametrize("retry_after", [-1, -0.001, 86_401, math.nan, True, "1"])
def test_throttled_refuses_an_unusable_retry_after(retry_after: Any) -> None:
    with pytest.raises(ValueError, match="retry_after must be 0 to 86400 seconds"):
        Throttled(retry_after=retry_after)


def test_throttled_says_when() -> None:
    t = Throttled(retry_after=2)
    assert (t.retry_after, str(t)) == (2.0, "provider rate limit; retry after 2s")


@pytest.mark.parametrize("usage", [-1, 1.5, True, "10", MAX_TOKENS + 1])
def test_record_usage_refuses_what_is_not_a_token_count(usage: Any) -> None:
    ctx = JobContext("q", "1", "llm", None, 1, 3, 0, "w", b"1")
    with pytest.raises(ValueError, match="tokens must be an integer from 0 to"):
        ctx.record_usage(usage)
    assert ctx.usage == -1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tokens": -1}, "tokens must be an integer from 0"),
        ({"tokens": 1.5}, "tokens must be an integer"),
        ({"tokens": True}, "tokens must be an integer"),
        ({"tokens": MAX_TOKENS + 1}, "tokens must be an integer"),
        ({"budget": ""}, "is not a budget name"),
        ({"budget": "a b"}, "is not a budget name"),
        ({"budget": "#tpm"}, "is not a budget name"),
        ({"budget": 5}, "is not a budget name"),
        ({"on_exhausted": "park"}, 'on_exhausted must be "reject" or "wait"'),
        ({"on_exhausted": None}, 'on_exhausted must be "reject" or "wait"'),
    ],
)
async def test_unusable_token_options_are_refused_before_anything_is_written(
    queue: Queue, redis: Redis, prefix: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidJobError, match=message):
        JobSpec("llm", **options)
    with pytest.raises(InvalidJobError, match=message):
        await queue.add("llm", **options)
    assert [k async for k in redis.scan_iter(match=f"{prefix}:*")] == []


async def test_a_record_written_before_budgets_existed_still_reads_and_runs(
    queue: Queue, redis: Redis
) -> None:
    # Given a job record as the previous version wrote it: no tokens, budget or on_ex fields
    await redis.hset(
        queue.keys.job("1"),
        mapping={
            "v": 1,
            "name": "llm",
            "payload": "{}",
            "priority": 0,
            "score": 1,
            "state": "waiting",
            "attempt": 0,
            "token": 0,
            "failures": 0,
            "stalls": 0,
            "max_attempts": 3,
            "backoff": '["exponential",1.0,300.0,0.5]',
            "timeout_ms": 0,
            "max_stalls": 1,
            "created": T,
        },
    )
    await redis.set(queue.keys.seq, 1)
    await redis.zadd(queue.keys.waiting, {"1": 1})

    # Then it reads with no token estimate
    record = await queue.get_job("1")
    assert record is not None
    assert (record.tokens, record.budget, record.on_exhausted, record.usage) == (0, None, "reject", None)
    assert (record.reservation, record.parked_on) == (None, None)

    # and it runs under a token-rate limit, charged nothing
    await queue.set_token_rate_limit(1000, per=60)
    ((job_id, token),) = leased(await step(queue, T))
    reply = await step(queue, T + 1, want=0, outcomes=[completed(job_id, token)])
    assert reply.codes == [1]
    assert (await queue.flow(now=T + 1)).tokens_in_window == 0
    done = await queue.get_job("1")
    assert done is not None and (done.state, done.tokens) == (JobState.COMPLETED, 0)
