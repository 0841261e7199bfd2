"""The token ledger: budgets, their windows and parents, and reservations, on a real Redis.

Time is passed in (``now=``, Unix ms) wherever the API takes it, so windows
turn without sleeping. Jobs that spend from a budget are driven through the
dispatch script with :meth:`Queue.step` (leases and outcomes by hand), or by
a Worker in this event loop where what matters is that a worker notices.
The concurrency claims are checked with real processes
(tests/harness/budget_race_proc.py), never with tasks of one event loop only.
"""

from __future__ import annotations

import asyncio
import random
import sys
from asyncio.subprocess import PIPE
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from sluice import (
    BudgetError,
    BudgetExists,
    BudgetNotFound,
    JobCancelled,
    JobContext,
    JobRejected,
    JobSpec,
    JobState,
    Queue,
    Worker,
)
from sluice.engine.connection import connect
from sluice.engine.queue import BULK_CHUNK
from tests.conftest import eventually, running
from tests.harness.budget_race_proc import go_key, ready_key, shared_size
from tests.harness.proc_harness import REPO
from tests.harness.stepping import completed, ids_of, leased, step

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def ms(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0, milli: int = 0) -> int:
    """Unix ms of a UTC date and time, computed by Python's datetime."""
    return (datetime(y, mo, d, h, mi, s, tzinfo=UTC) - EPOCH) // timedelta(milliseconds=1) + milli


DAY_MS = 86_400_000

#: A Wednesday noon, UTC: the clock of tests that do not care about the date.
T = ms(2027, 3, 10, 12)


async def events_of(redis: Redis, queue: Queue, name: str) -> list[dict[str, str]]:
    """The fields of every event ``name`` in the queue's stream, oldest first."""
    entries: Any = await redis.xrange(queue.keys.events, "-", "+")
    out = []
    for _, fields in entries:
        f = {k.decode(): v.decode() for k, v in fields.items()}
        if f.get("ev") == name:
            out.append(f)
    return out


# ---- many processes, one budget ------------------------------------------------------------------------
PROCS = 8
PER_PROC = 500


Answer = list[Any]


async def race(
    redis: Redis, redis_url: str, prefix: str, budgets: list[str], tmp: Path
) -> list[list[Answer]]:
    """Runs one racing process per budget name (tests/harness/budget_race_proc.py), all released at once.

    Returns the answers of each process: [id, tokens, accepted, duplicate, remaining, refused_by].
    """
    procs = []
    for i, name in enumerate(budgets):
        out = tmp / f"race-{i}.json"
        args = ["-m", "tests.harness.budget_race_proc", redis_url, prefix, name, str(i), str(PER_PROC)]
        args += [str(1000 + i), str(out)]
        proc = await asyncio.create_subprocess_exec(sys.executable, *args, cwd=REPO, stderr=PIPE)
        procs.append((proc, out))
    try:

        async def all_ready() -> bool:
            for proc, _ in procs:
                if proc.returncode is not None:  # it died before the start
                    _, err = await proc.communicate()
                    raise AssertionError(err.decode(errors="replace"))
            return int(await redis.get(ready_key(prefix)) or 0) == len(procs)

        await eventually(all_ready, timeout=30)
        await redis.rpush(go_key(prefix), *["go"] * len(procs))
        answers: list[list[Answer]] = []
        for proc, out in procs:
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode(errors="replace")
            answers.append(orjson.loads(out.read_bytes()))
        return answers
    finally:
        for proc, _ in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def admitted(answers: list[Answer]) -> int:
    """Tokens the processes were told were charged: accepted, and not a duplicate."""
    return sum(a[1] for a in answers if a[2] and not a[3])


async def resv_amounts(redis: Redis, queue: Queue) -> dict[str, tuple[int, str]]:
    """Every reservation a caller made: id -> (amount, budgets charged) (stored as u:<id>)."""
    out = {}
    prefix = queue.keys.reservation_prefix
    prefix += "u:"
    async for key in redis.scan_iter(match=prefix + "*", count=1000):
        fields: Any = await redis.hmget(key, "amt", "b")
        amt, names = fields
        out[key.decode()[len(prefix) :]] = (int(amt), names.decode())
    return out


@pytest.mark.slow
async def test_eight_processes_reserving_at_once_never_overspend(
    redis: Redis, redis_url: str, prefix: str, queue: Queue, tmp_path: Path
) -> None:
    # Given one budget of 50,000 tokens
    limit = 50_000
    await queue.budgets.create("shared", limit)

    # When 8 processes make 500 reservations of 1 to 200 tokens each against it
    # (about 400,000 tokens asked for), and race on the same "shared-<i>.shared" ids too
    answers = [a for proc in await race(redis, redis_url, prefix, ["shared"] * PROCS, tmp_path) for a in proc]

    # Then no more than the limit was admitted, and the ledger agrees with what
    # each process was told, to the token
    assert len(answers) == PROCS * (PER_PROC + PER_PROC // 10)
    total = admitted(answers)
    state = await queue.budgets.get("shared")
    assert total <= limit
    assert state.used == total
    assert state.remaining == limit - total
    # it was really contended: refusals happened, so less than one request's worth is left
    refused = [a for a in answers if not a[2]]
    assert refused and all(a[5] == "shared" for a in refused)
    assert limit - total < 200
    # every remaining figure a process saw is at least what is left at the end
    assert min(a[4] for a in answers) == state.remaining
    # the budget counted each call once
    charged = [a for a in answers if a[2] and not a[3]]
    # (a refusal asked again under its id is answered from the record: not counted again)
    assert (state.accepted, state.rejected) == (len(charged), len([a for a in refused if not a[3]]))
    # a shared id was charged by one process at most, and answered as a duplicate to the others
    shared = {}
    for a in answers:
        if a[0].startswith("shared-") and a[2] and not a[3]:
            assert a[0] not in shared, f"{a[0]} charged twice"
            shared[a[0]] = a[1]
    assert all(size == shared_size(int(rid.split("-")[1].split(".")[0])) for rid, size in shared.items())
    # and the stored reservations are exactly the charged ones (a refused one is remembered,
    # charging nothing)
    stored = await resv_amounts(redis, queue)
    assert {rid: amt for rid, (amt, _) in stored.items() if amt} == {a[0]: a[1] for a in charged}
    assert {rid for rid, (amt, _) in stored.items() if not amt} == {a[0] for a in refused}


@pytest.mark.slow
async def test_processes_reserving_under_a_smaller_parent_never_overspend_it(
    redis: Redis, redis_url: str, prefix: str, queue: Queue, tmp_path: Path
) -> None:
    # Given a team of 30,000 tokens with two tenants of 20,000 each
    await queue.budgets.create("team", 30_000)
    for tenant in ("tenant-a", "tenant-b"):
        await queue.budgets.create(tenant, 20_000, parent="team")

    # When 4 processes reserve against each tenant at once (500 reservations each)
    names = ["tenant-a", "tenant-b"] * (PROCS // 2)
    per_proc = await race(redis, redis_url, prefix, names, tmp_path)
    answers = [a for proc in per_proc for a in proc]

    # Then the team admitted no more than its limit, and each level's 'used' is
    # exactly what its processes were told they had reserved
    a_total, b_total = (
        sum(admitted(proc) for proc, name in zip(per_proc, names, strict=True) if name == tenant)
        for tenant in ("tenant-a", "tenant-b")
    )
    team, ta, tb = await queue.budgets.get_many(["team", "tenant-a", "tenant-b"])
    assert team is not None and ta is not None and tb is not None
    assert a_total + b_total <= 30_000
    assert (team.used, ta.used, tb.used) == (a_total + b_total, a_total, b_total)
    assert (ta.remaining, tb.remaining) == (20_000 - a_total, 20_000 - b_total)
    assert 30_000 - team.used < 200
    # the smaller parent did the refusing; nothing was charged to one level only
    refusers = {a[5] for a in answers if not a[2]}
    assert "team" in refusers and refusers <= {"team", "tenant-a", "tenant-b"}
    stored = await resv_amounts(redis, queue)
    assert {names_ for _, names_ in stored.values()} == {"tenant-a team", "tenant-b team"}
    assert sum(amt for amt, n in stored.values() if n == "tenant-a team") == a_total


# ---- the equal-size oracle: 20 x 75 tokens against 500 ------------------------------------------------
async def test_twenty_reservations_of_75_against_500_admit_exactly_six(queue: Queue) -> None:
    await queue.budgets.create("b", 500)
    answers = [await queue.budgets.reserve("b", 75, f"r{i}") for i in range(20)]
    assert [a.accepted for a in answers] == [True] * 6 + [False] * 14
    assert [a.remaining for a in answers[:6]] == [425, 350, 275, 200, 125, 50]
    assert {(a.remaining, a.refused_by) for a in answers[6:]} == {(50, "b")}
    state = await queue.budgets.get("b")
    assert (state.used, state.remaining, state.accepted, state.rejected) == (450, 50, 6, 14)


async def test_twenty_connections_reserving_75_at_once_get_exactly_six(
    redis_url: str, prefix: str, queue: Queue
) -> None:
    # Given 20 clients of their own, each with a Queue on the same budget
    await queue.budgets.create("b", 500)
    clients = [connect(redis_url) for _ in range(20)]
    try:
        queues = [Queue("q", redis=c, prefix=prefix) for c in clients]
        await asyncio.gather(*(c.ping() for c in clients))  # connected before the race

        # When they all reserve 75 tokens at once
        answers = await asyncio.gather(*(q.budgets.reserve("b", 75, f"r{i}") for i, q in enumerate(queues)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))

    # Then exactly 6 got theirs
    assert sum(a.accepted for a in answers) == 6
    assert (await queue.budgets.get("b")).used == 450


async def test_twenty_jobs_of_75_tokens_on_a_500_budget_run_six_and_reject_fourteen(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a budget of 500 tokens and 20 jobs estimated at 75 tokens each
    await queue.budgets.create("b", 500)
    jobs = await queue.add_bulk(JobSpec("llm", i, tokens=75, budget="b") for i in range(20))
    ran: list[int] = []
    w = Worker("q", prefix=prefix, concurrency=4, lease=5.0)

    @w.handler
    async def llm(job: JobContext) -> int:
        ran.append(job.payload)
        return int(job.payload)

    # When a worker serves the queue
    async with running(w, redis):
        outcomes = await asyncio.gather(*(j.result(timeout=10) for j in jobs), return_exceptions=True)

    # Then the first six in line ran and completed; the other fourteen were
    # rejected (not failed), with a reason naming the budget
    assert sorted(ran) == list(range(6))
    assert outcomes[:6] == list(range(6))
    rejected = outcomes[6:]
    assert all(isinstance(r, JobRejected) for r in rejected), rejected
    assert {r.reason for r in rejected if isinstance(r, JobRejected)} == {
        "budget b cannot admit 75 tokens (50 of 500 left)"
    }
    records = await queue.get_jobs([j.id for j in jobs])
    assert [r.state if r else None for r in records] == [JobState.COMPLETED] * 6 + [JobState.REJECTED] * 14
    counts = await queue.counts()
    assert (counts["completed"], counts["rejected"], counts["failed"], counts["dead"]) == (6, 14, 0, 0)
    assert (counts["waiting"], counts["active"], counts["parked"]) == (0, 0, 0)
    state = await queue.budgets.get("b")
    assert (state.used, state.accepted, state.rejected) == (450, 6, 14)
    assert len(await events_of(redis, queue, "rejected")) == 14


async def test_a_job_naming_a_missing_budget_is_refused_at_add_and_nothing_is_written(queue: Queue) -> None:
    # Given a queue with one budget
    await queue.budgets.create("real", 100)
    # When a batch holds one job whose budget does not exist, beside good ones
    specs = [
        JobSpec("llm", tokens=1, budget="real"),
        JobSpec("llm"),
        JobSpec("llm", tokens=1, budget="ghost"),
    ]
    with pytest.raises(BudgetNotFound, match="names budget 'ghost', which does not exist") as refused:
        await queue.add_bulk(specs)
    # Then the error names it, and not one job of the batch was added
    assert refused.value.name == "ghost"
    counts = await queue.counts()
    assert (counts["added"], counts["waiting"]) == (0, 0)
    assert await queue.redis.get(queue.keys.seq) is None
    # And a call of several script chunks is all-or-nothing too (the ghost is in the last chunk)
    many = [JobSpec("llm") for _ in range(BULK_CHUNK)] + [JobSpec("llm", tokens=1, budget="ghost")]
    with pytest.raises(BudgetNotFound):
        await queue.add_bulk(many)
    assert (await queue.counts())["added"] == 0
    # And once the budget exists, the same batch goes in
    await queue.budgets.create("ghost", 100)
    assert len(await queue.add_bulk(specs)) == 3


async def test_a_stored_job_whose_budget_is_gone_is_rejected_at_dispatch(queue: Queue) -> None:
    # Given a job added with its budget, whose budget record then vanished (deleted by
    # hand, or the job was written by an older Sluice that did not check at add)
    await queue.budgets.create("ghost", 100)
    job = await queue.add("llm", tokens=10, budget="ghost")
    await queue.redis.delete(queue.keys.budget_prefix + "ghost")
    # When a worker asks for it, it is not leased but rejected, with the advice to create it
    reply = await step(queue, T)
    assert leased(reply) == []
    with pytest.raises(JobRejected, match="no budget named ghost; create it") as rejected:
        await job.result(timeout=1)
    assert "Create the budget" in str(rejected.value) and "Top up" not in str(rejected.value)


# ---- budgets above budgets -----------------------------------------------------------------------------
async def test_a_reservation_must_fit_every_level_and_names_the_one_that_refused(queue: Queue) -> None:
    # Given a team of 1000 tokens with two tenants of 600
    b = queue.budgets
    await b.create("team", 1000)
    await b.create("alice", 600, parent="team")
    await b.create("bob", 600, parent="team")

    # When alice takes 500, and asks for 200 more: her own budget refuses
    assert (await b.reserve("alice", 500, "a1")).accepted
    r = await b.reserve("alice", 200, "a2")
    assert (r.accepted, r.refused_by, r.remaining) == (False, "alice", 100)

    # and bob asks for 600 (his own limit, but the team has 500 left): the team refuses
    r = await b.reserve("bob", 600, "b1")
    assert (r.accepted, r.refused_by, r.remaining) == (False, "team", 600)

    # and bob takes 500, then asks for 50 more: he has 100 left, the team has none
    assert (await b.reserve("bob", 500, "b2")).accepted
    r = await b.reserve("bob", 50, "b3")
    assert (r.accepted, r.refused_by, r.remaining) == (False, "team", 100)

    # Then every level was charged for what it admitted, and only the refusing
    # level counted each refusal
    team, alice, bob = await b.get_many(["team", "alice", "bob"])
    assert team is not None and alice is not None and bob is not None
    assert (team.used, alice.used, bob.used) == (1000, 500, 500)
    assert (team.rejected, alice.rejected, bob.rejected) == (2, 1, 0)
    assert (team.accepted, alice.accepted, bob.accepted) == (2, 1, 1)
    assert (alice.parent, team.parent) == ("team", None)
    stored = await b.reservation("a1")
    assert stored is not None
    assert (stored["b"], stored["amt"], stored["state"]) == ("alice team", "500", "held")


async def test_a_grandparent_refuses_too(queue: Queue) -> None:
    b = queue.budgets
    await b.create("org", 100)
    await b.create("team", 1000, parent="org")
    await b.create("tenant", 1000, parent="team")
    r = await b.reserve("tenant", 101, "r1")
    assert (r.accepted, r.refused_by) == (False, "org")
    assert (await b.reserve("tenant", 100, "r2")).accepted
    assert [s.used if s else None for s in await b.get_many(["org", "team", "tenant"])] == [100, 100, 100]


async def test_budgets_nest_at_most_eight_deep(queue: Queue) -> None:
    await queue.budgets.create("l1", 10)
    for level in range(2, 9):
        await queue.budgets.create(f"l{level}", 10, parent=f"l{level - 1}")
    with pytest.raises(BudgetError, match="at most 8 deep"):
        await queue.budgets.create("l9", 10, parent="l8")
    # and a reservation on the deepest is charged on all eight
    assert (await queue.budgets.reserve("l8", 10, "r")).accepted
    states = await queue.budgets.get_many([f"l{i}" for i in range(1, 9)])
    assert [s.used if s else None for s in states] == [10] * 8


async def test_topping_up_the_parent_lets_a_parked_job_run(redis: Redis, prefix: str, queue: Queue) -> None:
    # Given a tenant of 1000 tokens under a team of 500, and a worker
    await queue.budgets.create("team", 500)
    await queue.budgets.create("tenant", 1000, parent="team")
    w = Worker("q", prefix=prefix, concurrency=2, lease=5.0)

    @w.handler
    async def llm(job: JobContext) -> str:
        return "done"

    async with running(w, redis):
        # When two jobs of 400 tokens that wait for room are added
        first = await queue.add("llm", tokens=400, budget="tenant", on_exhausted="wait")
        assert await first.result(timeout=10) == "done"
        second = await queue.add("llm", tokens=400, budget="tenant", on_exhausted="wait")

        # Then the second is parked on the team, the level that refused it
        async def parked() -> bool:
            return await second.state() is JobState.PARKED

        await eventually(parked)
        record = await second.info()
        assert record.parked_on == "team"
        assert (await queue.counts())["parked"] == 1
        assert (await queue.budgets.get("team")).parked == 1
        assert [e["budget"] for e in await events_of(redis, queue, "parked")] == ["team"]

        # and topping up the tenant does not help it
        assert (await queue.budgets.credit("tenant", 100)).credit == 100
        await asyncio.sleep(0.2)
        assert await second.state() is JobState.PARKED

        # When the team is topped up
        assert (await queue.budgets.credit("team", 300)).credit == 300

        # Then the idle worker runs it at once (not after its 5 s block)
        assert await second.result(timeout=2) == "done"
    assert (await queue.budgets.get("team")).used == 800
    counts = await queue.counts()
    assert (counts["parked"], counts["completed"], counts["rejected"]) == (0, 2, 0)


async def test_a_parked_job_can_be_cancelled(queue: Queue) -> None:
    # Given a job parked on a budget that cannot admit it
    await queue.budgets.create("b", 100)
    job = await queue.add("llm", tokens=150, budget="b", on_exhausted="wait")
    reply = await step(queue, T)
    assert leased(reply) == []
    assert reply.next_due == -1  # only a top-up can help: no time to come back at
    assert await job.state() is JobState.PARKED

    # When it is cancelled
    assert await job.cancel()

    # Then it is gone from the budget's parked jobs, and a top-up does not bring it back
    assert await job.state() is JobState.CANCELLED
    assert (await queue.budgets.get("b")).parked == 0
    counts = await queue.counts()
    assert (counts["parked"], counts["cancelled"]) == (0, 1)
    await queue.budgets.credit("b", 1000)
    assert leased(await step(queue, T + 1)) == []
    assert await job.state() is JobState.CANCELLED
    with pytest.raises(JobCancelled):
        await job.result(timeout=1)
    assert not await job.cancel()


# ---- windows, with the clock passed in -----------------------------------------------------------------
async def test_a_day_budget_renews_at_utc_midnight(queue: Queue) -> None:
    b = queue.budgets
    last = ms(2027, 3, 10, 23, 59, 59, 999)
    midnight = ms(2027, 3, 11)
    state = await b.create("daily", 100, window="day", now=ms(2027, 3, 10, 8))
    assert (state.window, state.resets_at_ms) == ("day", midnight)

    assert (await b.reserve("daily", 100, "r1", now=last)).accepted
    assert not (await b.reserve("daily", 1, "r2", now=last)).accepted
    assert (await b.get("daily", now=last)).used == 100

    r = await b.reserve("daily", 100, "r3", now=midnight)
    assert (r.accepted, r.remaining) == (True, 0)
    state = await b.get("daily", now=midnight)
    assert (state.used, state.resets_at_ms) == (100, ms(2027, 3, 12))


async def test_charged_counts_what_was_spent_across_windows_and_levels(queue: Queue) -> None:
    """``charged`` is the money spent: commits at their actual usage, nothing for a refund or
    a held estimate, on every level, and it keeps counting when the day's window turns."""
    b = queue.budgets
    day = ms(2027, 3, 10, 12)
    await b.create("team", 10_000, now=day)
    await b.create("daily", 1_000, window="day", parent="team", now=day)
    assert (await b.reserve("daily", 300, "r1", now=day)).accepted
    assert (await b.reserve("daily", 200, "r2", now=day)).accepted
    assert (await b.reserve("daily", 100, "r3", now=day)).accepted
    assert (await b.get("daily", now=day)).charged == 0  # held: not spent yet
    await b.commit("r1", 120, now=day)
    await b.refund("r2", now=day)
    assert [(await b.get(n, now=day)).charged for n in ("daily", "team")] == [120, 120]
    tomorrow = ms(2027, 3, 11, 1)
    await b.commit("r3", 90, now=tomorrow)  # reserved yesterday, settled today
    assert (await b.reserve("daily", 50, "r4", now=tomorrow)).accepted
    await b.commit("r4", 70, now=tomorrow)  # beyond its estimate: charged in full
    state = await b.get("daily", now=tomorrow)
    assert (state.used, state.charged) == (70, 280)
    assert (await b.get("team", now=tomorrow)).charged == 280


@pytest.mark.parametrize(
    ("last_day", "next_first"),
    [
        ((2027, 1, 31), (2027, 2, 1)),
        ((2027, 12, 31), (2028, 1, 1)),
        ((2027, 2, 28), (2027, 3, 1)),
        ((2028, 2, 29), (2028, 3, 1)),  # a leap year
        ((2100, 2, 28), (2100, 3, 1)),  # a century that is not a leap year
        ((2000, 2, 29), (2000, 3, 1)),  # one that is
        ((2027, 4, 30), (2027, 5, 1)),
    ],
)
async def test_a_month_budget_renews_on_the_first(
    queue: Queue, last_day: tuple[int, int, int], next_first: tuple[int, int, int]
) -> None:
    b = queue.budgets
    start = ms(*last_day[:2], 1)
    last = ms(*last_day, 23, 59, 59, 999)
    first = ms(*next_first)
    await b.create("monthly", 1000, window="month", now=start)
    assert (await b.reserve("monthly", 1000, "r1", now=start)).accepted
    state = await b.get("monthly", now=last)
    assert (state.used, state.resets_at_ms) == (1000, first)
    assert not (await b.reserve("monthly", 1, "r2", now=last)).accepted

    assert (await b.reserve("monthly", 1000, "r3", now=first)).accepted
    state = await b.get("monthly", now=first)
    assert state.used == 1000
    nxt = datetime(*next_first, tzinfo=UTC)
    following = datetime(nxt.year + nxt.month // 12, nxt.month % 12 + 1, 1, tzinfo=UTC)
    assert state.resets_at_ms == (following - EPOCH) // timedelta(milliseconds=1)


async def test_feb_28_to_29_of_a_leap_year_is_the_same_month(queue: Queue) -> None:
    b = queue.budgets
    await b.create("monthly", 1000, window="month", now=ms(2028, 2, 1))
    assert (await b.reserve("monthly", 1000, "r1", now=ms(2028, 2, 28, 23))).accepted
    assert not (await b.reserve("monthly", 1, "r2", now=ms(2028, 2, 29))).accepted
    assert (await b.get("monthly", now=ms(2028, 2, 29))).resets_at_ms == ms(2028, 3, 1)


async def test_calendar_resets_agree_with_python_datetime(queue: Queue) -> None:
    # Given a day and a month budget
    await queue.budgets.create("d", 1, window="day", now=T)
    await queue.budgets.create("m", 1, window="month", now=T)
    rng = random.Random(7)
    lo, hi = ms(2000, 1, 1), ms(2400, 12, 31)
    # at random instants of four centuries, and at every month's first and last millisecond of 2027-2028
    instants = [rng.randrange(lo, hi) for _ in range(300)]
    for y in (2027, 2028):
        for mo in range(1, 13):
            instants += [ms(y, mo, 1), ms(y, mo, 1) - 1]
    for now in instants:
        # When read at that instant
        d, m = await queue.budgets.get_many(["d", "m"], now=now)
        assert d is not None and m is not None
        # Then each says when its window turns as datetime does
        at = EPOCH + timedelta(milliseconds=now)
        next_day = datetime(at.year, at.month, at.day, tzinfo=UTC) + timedelta(days=1)
        y, mo = divmod(at.year * 12 + at.month, 12)  # the month after, 0-based
        next_month = datetime(y, mo + 1, 1, tzinfo=UTC)
        assert d.resets_at_ms == (next_day - EPOCH) // timedelta(milliseconds=1), at
        assert m.resets_at_ms == (next_month - EPOCH) // timedelta(milliseconds=1), at


async def test_a_rolling_budget_lets_charges_leave_after_the_window(queue: Queue) -> None:
    b = queue.budgets
    state = await b.create("roll", 1000, window=60, now=T)
    assert (state.window, state.window_seconds, state.resets_at_ms) == ("rolling", 60.0, None)

    # Given 600 tokens reserved at T and 400 at T+30 s
    assert (await b.reserve("roll", 600, "a", now=T)).accepted
    assert (await b.reserve("roll", 400, "b", now=T + 30_000)).accepted
    assert (await b.get("roll", now=T + 30_000)).resets_at_ms == T + 60_000

    # Then the budget is full until the first charge is a window old
    assert not (await b.reserve("roll", 1, "c0", now=T + 59_999)).accepted
    r = await b.reserve("roll", 600, "c", now=T + 60_000)
    assert (r.accepted, r.remaining) == (True, 0)
    assert (await b.get("roll", now=T + 60_000)).resets_at_ms == T + 30_000 + 60_000

    # When "b" is committed at 100 tokens, only 100 leave with it
    assert (await b.commit("b", 100, now=T + 60_001)).charged == 100
    assert (await b.get("roll", now=T + 60_001)).used == 700
    assert (await b.get("roll", now=T + 90_000)).used == 600

    # and a reservation settled after it left the window gives nothing back twice
    s = await b.refund("c", now=T + 120_000)
    assert (s.state, s.changed) == ("refunded", True)
    assert (await b.get("roll", now=T + 120_000)).used == 0


async def test_settling_after_the_day_turned_does_not_touch_the_new_day(queue: Queue) -> None:
    b = queue.budgets
    await b.create("daily", 100, window="day", now=T)
    assert (await b.reserve("daily", 100, "late", now=ms(2027, 3, 10, 23, 59))).accepted
    assert (await b.reserve("daily", 30, "early", now=ms(2027, 3, 11, 0, 0, 1))).accepted
    # the commit of yesterday's reservation (more than reserved, even) is not charged today
    s = await b.commit("late", 500, now=ms(2027, 3, 11, 0, 1))
    assert s.changed
    assert (await b.get("daily", now=ms(2027, 3, 11, 0, 1))).used == 30


async def test_parked_jobs_on_a_day_budget_come_back_at_the_next_window(queue: Queue) -> None:
    # Given a day budget of 500 tokens, and two jobs of 300 that wait for room
    await queue.budgets.create("daily", 500, window="day", now=T)
    midnight = ms(2027, 3, 11)
    first = await queue.add("llm", tokens=300, budget="daily", on_exhausted="wait")
    second = await queue.add("llm", tokens=300, budget="daily", on_exhausted="wait")
    # and one that could never fit the day's limit
    huge = await queue.add("llm", tokens=501, budget="daily", on_exhausted="wait")

    # When a worker steps at noon: the first runs, the others are parked
    reply = await step(queue, T)
    ((first_id, first_token),) = leased(reply)
    assert first_id == first.id
    assert await second.state() is JobState.PARKED
    assert await huge.state() is JobState.PARKED
    # and the worker is told to come back at midnight
    assert reply.next_due == midnight
    assert (await queue.budgets.get("daily", now=T)).parked == 2

    # Then nothing runs before midnight
    assert leased(await step(queue, midnight - 1)) == []
    # and at midnight the second runs in the new day's window; the huge one is parked again,
    # with no time to come back at
    reply = await step(queue, midnight)
    assert [i for i, _ in leased(reply)] == [second.id]
    assert reply.next_due == -1
    assert await huge.state() is JobState.PARKED
    state = await queue.budgets.get("daily", now=midnight)
    assert (state.used, state.parked) == (300, 1)

    # and the first job's completion (reserved yesterday) does not charge today
    reply = await step(queue, midnight + 1, want=0, outcomes=[completed(first.id, first_token, 250)])
    assert reply.codes == [1]
    assert (await queue.budgets.get("daily", now=midnight + 1)).used == 300


async def test_a_job_parked_on_a_rolling_budget_comes_back_when_enough_has_left_it(queue: Queue) -> None:
    # Given a rolling budget of 500 tokens a minute, and two jobs of 300 that wait for room
    await queue.budgets.create("roll", 500, window=60, now=T)
    first = await queue.add("llm", tokens=300, budget="roll", on_exhausted="wait")
    second = await queue.add("llm", tokens=300, budget="roll", on_exhausted="wait")

    # When the first runs at T, the second is parked until the first's charge leaves
    reply = await step(queue, T)
    assert ids_of(reply) == [first.id]
    assert reply.next_due == T + 60_000
    assert (await queue.budgets.get("roll", now=T)).resets_at_ms == T + 60_000

    # Then it runs a minute later, not before
    assert ids_of(await step(queue, T + 59_999)) == []
    assert ids_of(await step(queue, T + 60_000)) == [second.id]


async def test_tokens_given_back_unpark_only_the_jobs_they_admit(redis: Redis, queue: Queue) -> None:
    # Given a rolling budget of 10 tokens a minute, filled by a caller's reservation,
    # and five jobs of 3 tokens parked on it
    b = queue.budgets
    await b.create("roll", 10, window=60, now=T)
    assert (await b.reserve("roll", 10, "fill", now=T)).accepted
    jobs = [await queue.add("llm", tokens=3, budget="roll", on_exhausted="wait") for _ in range(5)]
    reply = await step(queue, T)
    assert ids_of(reply) == [] and (await queue.counts())["parked"] == 5

    # When the caller commits 4 of its 10 (6 come back)
    await b.commit("fill", 4, now=T + 1)
    reply = await step(queue, T + 2)

    # Then the two that fit run, the other three stay parked (none went back to waiting
    # only to be parked again), until the commit's 4 tokens leave the window
    assert ids_of(reply) == [jobs[0].id, jobs[1].id]
    counts = await queue.counts()
    assert (counts["parked"], counts["waiting"]) == (3, 0)
    assert reply.next_due == T + 60_000
    assert [await j.state() for j in jobs[2:]] == [JobState.PARKED] * 3
    # and each job said "parked" once, with one "unparked" for the budget
    entries: Any = await redis.xrange(queue.keys.events, "-", "+")
    kinds = [f[b"ev"] for _, f in entries]
    assert (kinds.count(b"parked"), kinds.count(b"unparked")) == (5, 1)


async def test_a_full_window_passing_at_once_leaves_in_bounded_steps(queue: Queue) -> None:
    # Given a rolling budget filled by 2,500 charges of 1 token made at once
    b = queue.budgets
    await b.create("roll", 2500, window=60, now=T)
    for i in range(2500):
        assert (await b.reserve("roll", 1, f"r{i}", now=T)).accepted
    # and a job that needs the whole budget, rejected if it does not fit
    job = await queue.add("llm", tokens=2500, budget="roll")

    # When the window has passed: each call removes at most 1,000 charges, and
    # until all have left the budget refuses nothing on their account (the job is
    # not rejected); the worker is told to come back at once
    calls = []
    for k in range(5):
        reply = await step(queue, T + 60_000 + k)
        calls.append((ids_of(reply), reply.next_due))
        if ids_of(reply):
            break
    assert calls == [([], T + 60_000), ([], T + 60_001), ([job.id], -1)]
    assert await job.state() is JobState.ACTIVE
    assert (await b.get("roll", now=T + 60_002)).used == 2500


async def test_a_reservation_gets_a_definite_answer_when_a_window_passed_at_once(queue: Queue) -> None:
    b = queue.budgets
    await b.create("roll", 2500, window=60, now=T)
    for i in range(2500):
        assert (await b.reserve("roll", 1, f"r{i}", now=T)).accepted
    # 2,500 charges left at once: the reservation catches up in its own call
    r = await b.reserve("roll", 2500, "all", now=T + 60_000)
    assert r.accepted and r.remaining == 0


async def test_a_hold_left_too_long_is_swept_and_stays_charged(redis: Redis, queue: Queue) -> None:
    # Given a caller that reserves 300 tokens for one second, then crashes
    b = queue.budgets
    await b.create("b", 1000)
    assert (await b.reserve("b", 300, "crashed", hold=1)).accepted
    # (the record outlives the hold, so that a sweep finds it)
    assert 8 * DAY_MS < await redis.pttl(queue.keys.reservation_prefix + "u:crashed") <= 8 * DAY_MS + 1000
    # When the hold has passed and the holds are swept
    await asyncio.sleep(1.1)
    swept = await b.sweep()
    # Then it is an unknown outcome: the tokens count as spent, the budget counts it,
    # and a late commit changes nothing
    assert [(s.id, s.state) for s in swept] == [("crashed", "unknown")]
    state = await b.get("b")
    assert (state.used, state.unknown_outcomes) == (300, 1)
    late = await b.commit("crashed", 10)
    assert (late.state, late.changed, late.charged) == ("unknown", False, 300)
    # and a hold is checked like any other input
    with pytest.raises(BudgetError, match="hold must be from 1 to"):
        await b.reserve("b", 1, "x", hold=0)


# ---- commit and refund ---------------------------------------------------------------------------------
async def test_commit_and_refund_are_idempotent(queue: Queue) -> None:
    b = queue.budgets
    await b.create("b", 1000)
    await b.reserve("b", 300, "r1")
    await b.reserve("b", 200, "r2")

    s = await b.commit("r1", 300)
    assert (s.state, s.changed, s.charged, s.beyond) == ("committed", True, 300, 0)
    again = await b.commit("r1", 10)
    assert (again.state, again.changed, again.charged) == ("committed", False, 300)
    late_refund = await b.refund("r1")
    assert (late_refund.state, late_refund.changed, late_refund.charged) == ("committed", False, 300)

    s = await b.refund("r2")
    assert (s.state, s.changed, s.charged) == ("refunded", True, 0)
    again = await b.refund("r2")
    assert (again.state, again.changed) == ("refunded", False)
    late_commit = await b.commit("r2", 200)
    assert (late_commit.state, late_commit.changed, late_commit.charged) == ("refunded", False, 0)
    assert (await b.get("b")).used == 300

    missing = await b.commit("nope", 5)
    assert (missing.state, missing.changed, missing.charged) == ("missing", False, 0)


async def test_committing_less_gives_the_difference_back_on_every_level(queue: Queue) -> None:
    b = queue.budgets
    await b.create("team", 1000)
    await b.create("tenant", 1000, parent="team")
    await b.reserve("tenant", 400, "r")
    s = await b.commit("r", 150)
    assert (s.charged, s.beyond) == (150, 0)
    assert [x.used if x else None for x in await b.get_many(["team", "tenant"])] == [150, 150]
    stored = await b.reservation("r")
    assert stored is not None
    assert (stored["est"], stored["amt"], stored["state"]) == ("400", "150", "committed")


async def test_committing_more_than_reserved_is_charged_in_full_past_the_limit(queue: Queue) -> None:
    # Given a tenant of 1000 under a team of 800, 500 reserved under "r1" and 200 under "r2"
    b = queue.budgets
    await b.create("team", 800)
    await b.create("tenant", 1000, parent="team")
    await b.reserve("tenant", 500, "r1")
    await b.reserve("tenant", 200, "r2")

    # When r1 reports 750 tokens used (250 more than reserved; the team has 100 left)
    s = await b.commit("r1", 750)

    # Then all 750 are charged on both levels (the provider billed them): the team is 150
    # past its limit, and says so
    assert (s.state, s.changed, s.charged, s.beyond) == ("committed", True, 750, 250)
    team, tenant = await b.get_many(["team", "tenant"])
    assert team is not None and tenant is not None
    assert (team.used, team.remaining, team.overspent, team.beyond_estimates) == (950, 0, 150, 250)
    assert (tenant.used, tenant.remaining, tenant.overspent, tenant.beyond_estimates) == (950, 50, 0, 250)
    raw: Any = await queue.redis.xrange(queue.keys.events)
    events = [fields for _, fields in raw if fields[b"ev"] == b"overspent"]
    assert [(e[b"budget"], e[b"used"], e[b"limit"], e[b"reservation"]) for e in events] == [
        (b"team", b"950", b"800", b"r1")
    ]

    # and an overspent budget admits nothing, not even what its child still has room for
    refused = await b.reserve("tenant", 1, "r3")
    assert (refused.accepted, refused.refused_by) == (False, "team")
    # while a commit of more is still charged in full, and goes past the tenant's limit too
    s = await b.commit("r2", 300)
    assert (s.charged, s.beyond) == (300, 100)
    tenant_state = await b.get("tenant")
    assert (tenant_state.used, tenant_state.overspent) == (1050, 50)


async def test_a_known_reservation_id_is_a_duplicate_and_charges_nothing(queue: Queue) -> None:
    b = queue.budgets
    await b.create("b", 100)
    first = await b.reserve("b", 100, "r")
    assert (first.accepted, first.duplicate, first.remaining) == (True, False, 0)
    # the budget is full, yet asking again under the same id is answered as accepted
    again = await b.reserve("b", 100, "r")
    assert (again.accepted, again.duplicate, again.remaining) == (True, True, 0)
    # a refunded id stays a duplicate: not accepted, and nothing charged again
    await b.refund("r")
    after_refund = await b.reserve("b", 100, "r")
    assert (after_refund.accepted, after_refund.duplicate, after_refund.remaining) == (False, True, 100)
    state = await b.get("b")
    assert (state.used, state.accepted) == (0, 1)


async def test_limits_can_be_changed_and_topped_up(queue: Queue) -> None:
    b = queue.budgets
    await b.create("b", 100)
    await b.reserve("b", 80, "r")
    assert (await b.set_limit("b", 50)).limit == 50
    state = await b.get("b")
    assert (state.used, state.remaining) == (80, 0)
    refused = await b.reserve("b", 1, "r2")
    assert (refused.accepted, refused.remaining) == (False, 0)
    assert (await b.reserve("b", 80, "r")).remaining == 0  # a duplicate: never negative either
    assert (await b.credit("b", 40)).credit == 40
    assert (await b.reserve("b", 10, "r3")).accepted
    assert (await b.get("b")).remaining == 0


# ---- jobs: what their attempts leave charged -----------------------------------------------------------
async def test_an_expired_lease_keeps_its_charge_as_an_unknown_outcome(queue: Queue) -> None:
    # Given a job of 100 tokens on a budget, leased for 1 s
    await queue.budgets.create("b", 1000)
    job = await queue.add("llm", tokens=100, budget="b")
    reply = await queue.protocol.step(now=T, want=1, lease_ms=1000, worker_id="lost")
    ((job_id, token),) = leased(reply)
    assert (await queue.budgets.get("b")).used == 100

    # When its worker is lost and the lease expires
    assert await queue.protocol.reap(now=T + 1000) == (1, 0)

    # Then the charge stays (the provider may have been called), marked unknown
    rid = f"{job_id}:1"
    stored = await queue.budgets.reservation(rid)
    assert stored is not None and stored["state"] == "unknown"
    state = await queue.budgets.get("b")
    assert (state.used, state.unknown_outcomes) == (100, 1)
    assert (await queue.counts())["unknown_outcome"] == 1

    # and the lost worker's late completion settles nothing
    late = await step(queue, T + 1001, want=0, outcomes=[completed(job_id, token, 10)])
    assert late.codes == [0]
    assert (await queue.budgets.get("b")).used == 100

    # and the next attempt reserves again under a reservation of its own
    ((_, token2),) = leased(await step(queue, T + 1002))
    assert (await job.info()).reservation == f"{job_id}:2"
    assert (await queue.budgets.get("b")).used == 200
    await step(queue, T + 1003, want=0, outcomes=[completed(job_id, token2, 40)])
    state = await queue.budgets.get("b")
    assert (state.used, state.unknown_outcomes) == (140, 1)
    record = await job.info()
    assert (record.state, record.usage, record.stalls) == (JobState.COMPLETED, 40, 1)
    assert (await queue.counts())["unknown_outcome"] == 1


@pytest.mark.parametrize(
    ("kind", "usage", "state", "used", "unknown"),
    [
        (b"c", -1, "committed", 100, 0),  # completed, usage not reported: the estimate stays
        (b"c", 30, "committed", 30, 0),
        (b"f", -1, "unknown", 100, 1),  # failed without a report: the provider may have been called
        (b"f", 0, "committed", 0, 0),  # failed before calling the provider
        (b"p", 55, "committed", 55, 0),
        (b"r", -1, "unknown", 100, 1),  # released at shutdown
        (b"x", -1, "unknown", 100, 1),  # cancelled while running
        (b"t", -1, "refunded", 0, 0),  # throttled: the provider refused the call
        (b"t", 70, "committed", 70, 0),  # throttled after usage was reported: billed, so charged
    ],
)
async def test_each_outcome_settles_the_reservation(
    queue: Queue, kind: bytes, usage: int, state: str, used: int, unknown: int
) -> None:
    await queue.budgets.create("b", 1000)
    job = await queue.add("llm", tokens=100, budget="b", max_attempts=3)
    ((job_id, token),) = leased(await step(queue, T))
    value = {b"c": b'"ok"', b"t": b"0"}.get(kind, b"boom")
    await step(queue, T + 1, want=0, outcomes=[(job_id, token, kind, value, T + 1, usage)])
    stored = await queue.budgets.reservation(f"{job_id}:1")
    assert stored is not None and stored["state"] == state
    b = await queue.budgets.get("b")
    assert (b.used, b.unknown_outcomes) == (used, unknown)
    assert (await queue.counts())["unknown_outcome"] == unknown
    assert (await job.info()).usage == (usage if usage >= 0 else None)


# ---- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["", "a b", "x" * 101, "#tpm", "ünï", 5, None])
async def test_unusable_budget_names_are_refused(queue: Queue, name: Any) -> None:
    with pytest.raises(BudgetError, match="not usable: use 1-100 characters"):
        await queue.budgets.create(name, 10)
    with pytest.raises(BudgetError, match="not usable"):
        await queue.budgets.reserve(name, 1, "r")


@pytest.mark.parametrize("limit", [-1, 1.5, True, "10", 10**15 + 1])
async def test_unusable_limits_are_refused(queue: Queue, limit: Any) -> None:
    with pytest.raises(BudgetError, match="limit must be an integer from 0 to"):
        await queue.budgets.create("b", limit)


@pytest.mark.parametrize(
    "window", ["week", "Day", 0, 0.5, -60, 7 * 86_400 + 1, float("nan"), float("inf"), True]
)
async def test_unusable_windows_are_refused(queue: Queue, window: Any) -> None:
    with pytest.raises(BudgetError, match="window must be"):
        await queue.budgets.create("b", 10, window=window)
    assert await queue.budgets.get_many(["b"]) == [None]


async def test_budget_operations_that_cannot_be_done_say_why(queue: Queue) -> None:
    b = queue.budgets
    with pytest.raises(BudgetNotFound, match="parent budget 'team' does not exist; create it first"):
        await b.create("tenant", 10, parent="team")
    with pytest.raises(BudgetError, match="cannot be its own parent"):
        await b.create("b", 10, parent="b")
    created = await b.create("b", 10)
    exists = r"exists already; change it with .*set_limit\(\), adjust\(\) or credit\(\)"
    with pytest.raises(BudgetExists, match=exists):
        await b.create("b", 20)
    assert await b.create("b", 20, exist_ok=True) == created  # left as it was
    for call in (b.get("nope"), b.reserve("nope", 1, "r"), b.set_limit("nope", 5), b.credit("nope", 5)):
        with pytest.raises(BudgetNotFound, match=r"no budget named 'nope'; create it first") as missing:
            await call
        assert missing.value.name == "nope"
    with pytest.raises(BudgetError, match="tokens must be an integer from 0"):
        await b.reserve("b", -1, "r")
    with pytest.raises(BudgetError, match="used_tokens must be an integer from 0"):
        await b.commit("r", -5)
    with pytest.raises(BudgetError, match="tokens must be an integer from 1"):
        await b.credit("b", 0)
    for rid in ("", "a b", "x" * 201, "r/1"):
        with pytest.raises(BudgetError, match=r"reservation id .* is not usable"):
            await b.reserve("b", 1, rid)
    assert (await b.get("b")).used == 0


async def test_a_refusal_is_remembered_and_an_id_belongs_to_one_budget(queue: Queue) -> None:
    b = queue.budgets
    await b.create("b", 100)
    await b.create("other", 100)
    # A refused reservation, asked again after room appeared (a retry after a timeout),
    # gets the first answer: it was refused, and nothing is charged
    first = await b.reserve("b", 150, "big")
    assert (first.accepted, first.duplicate, first.refused_by) == (False, False, "b")
    assert (await b.credit("b", 100)).credit == 100
    again = await b.reserve("b", 150, "big")
    assert (again.accepted, again.duplicate, again.refused_by) == (False, True, "b")
    assert (await b.get("b")).used == 0
    settled = await b.commit("big", 10)
    assert (settled.state, settled.changed, settled.charged) == ("refused", False, 0)
    # An id names one reservation: the same id on another budget is an error, not a
    # duplicate that charges nothing there
    with pytest.raises(BudgetError, match="was reserved on budget 'b', not 'other'"):
        await b.reserve("other", 1, "big")
    assert (await b.reserve("b", 1, "small")).accepted
    with pytest.raises(BudgetError, match="pick a new one for this budget"):
        await b.reserve("other", 1, "small")
    assert (await b.get("other")).used == 0
