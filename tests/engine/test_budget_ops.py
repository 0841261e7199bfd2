"""Budget operations that are safe to retry, credits that stay in their window,
and callers' holds that can be listed and swept, on a real Redis.

Time is passed in (``now=``, Unix ms) so windows turn without sleeping; the
worker's sweep runs on the real clock.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio.subprocess import PIPE

import pytest

from sluice import BudgetError, BudgetNotFound, JobContext, Queue, Worker
from sluice.engine.budget_state import BudgetChange
from tests.conftest import eventually, running
from tests.engine.test_budgets import DAY_MS, T, ms

HOUR_MS = 3_600_000


# ---- credit: a one-off for the current window ------------------------------------------------------------
async def test_a_credit_on_a_day_budget_is_for_that_day_only(queue: Queue) -> None:
    # Given a day budget of 100, spent
    b = queue.budgets
    await b.create("daily", 100, window="day", now=T)
    assert (await b.reserve("daily", 100, "r1", now=T)).accepted

    # When it is credited 50 for today
    change = await b.credit("daily", 50, now=T + 1)

    # Then today admits 50 more, and the limit of every day is still 100
    assert change == BudgetChange("daily", limit=100, credit=50, applied=True)
    state = await b.get("daily", now=T + 2)
    assert (state.limit, state.credit, state.remaining) == (100, 50, 50)
    assert (await b.reserve("daily", 50, "r2", now=T + 3)).accepted
    assert not (await b.reserve("daily", 1, "r3", now=T + 4)).accepted

    # and tomorrow admits 100, not 150
    tomorrow = ms(2027, 3, 11, 0, 0, 1)
    state = await b.get("daily", now=tomorrow)
    assert (state.limit, state.credit, state.used, state.remaining) == (100, 0, 0, 100)
    assert not (await b.reserve("daily", 101, "r4", now=tomorrow)).accepted
    assert (await b.reserve("daily", 100, "r5", now=tomorrow)).accepted


async def test_a_credit_on_a_rolling_budget_lasts_one_window(queue: Queue) -> None:
    b = queue.budgets
    await b.create("hourly", 100, window=3600, now=T)
    await b.credit("hourly", 40, now=T)
    assert (await b.get("hourly", now=T + HOUR_MS - 1)).credit == 40
    # A second credit adds to it and starts the window length again
    change = await b.credit("hourly", 10, now=T + HOUR_MS - 1)
    assert (change.limit, change.credit) == (100, 50)
    assert (await b.get("hourly", now=T + 2 * HOUR_MS - 2)).credit == 50
    state = await b.get("hourly", now=T + 2 * HOUR_MS)
    assert (state.limit, state.credit, state.remaining) == (100, 0, 100)


async def test_a_credit_without_a_window_never_ends_and_wakes_parked_jobs(queue: Queue) -> None:
    b = queue.budgets
    await b.create("total", 100, now=T)
    job = await queue.add("llm", tokens=150, budget="total", on_exhausted="wait")
    from tests.harness.stepping import leased, step

    assert leased(await step(queue, T)) == []
    await b.credit("total", 60, now=T + 1)
    assert [i for i, _ in leased(await step(queue, T + 2))] == [job.id]
    state = await b.get("total", now=T + 100 * DAY_MS)
    assert (state.limit, state.credit, state.used, state.remaining) == (100, 60, 150, 10)


async def test_a_limit_change_keeps_the_current_credit(queue: Queue) -> None:
    b = queue.budgets
    await b.create("daily", 100, window="day", now=T)
    await b.credit("daily", 30, now=T)
    assert await b.set_limit("daily", 200, now=T) == BudgetChange("daily", 200, 30)
    assert await b.adjust("daily", -50, now=T) == BudgetChange("daily", 150, 30)
    assert (await b.get("daily", now=T)).remaining == 180


# ---- adjust: relative, atomic ------------------------------------------------------------------------------
_ADJUSTER = """
import asyncio, sys
from sluice import Queue
from sluice.engine.connection import connect

async def main() -> None:
    url, prefix, name = sys.argv[1:4]
    redis = connect(url)
    queue = Queue(name, redis=redis, prefix=prefix)
    print("ready", flush=True)
    sys.stdin.readline()
    await asyncio.gather(*(queue.budgets.adjust("b", -10) for _ in range(25)))
    await redis.aclose()

asyncio.run(main())
"""


async def test_concurrent_adjustments_from_processes_all_apply(queue: Queue, redis_url: str) -> None:
    # Given a budget of 1,000 and four processes, each about to lower it by 10, 25 times at once
    await queue.budgets.create("b", 1000)
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _ADJUSTER, redis_url, queue.prefix, queue.name, stdin=PIPE, stdout=PIPE
        )
        for _ in range(4)
    ]
    for p in procs:
        assert p.stdout is not None
        assert await asyncio.wait_for(p.stdout.readline(), 30) == b"ready\n"
    # When they are let go together
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        await p.stdin.drain()
    assert [await asyncio.wait_for(p.wait(), 60) for p in procs] == [0, 0, 0, 0]
    # Then every adjustment applied (a read-then-set would lose some)
    assert (await queue.budgets.get("b")).limit == 0


async def test_an_adjustment_may_not_take_a_limit_below_zero(queue: Queue) -> None:
    await queue.budgets.create("b", 100)
    with pytest.raises(BudgetError, match=r"adjusting 'b' by -101 would take its limit \(100\) below 0"):
        await queue.budgets.adjust("b", -101)
    assert (await queue.budgets.get("b")).limit == 100
    with pytest.raises(BudgetError, match="delta must be an integer"):
        await queue.budgets.adjust("b", 1.5)  # type: ignore[arg-type]
    with pytest.raises(BudgetNotFound):
        await queue.budgets.adjust("nope", 1)


# ---- operation ids: apply once -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "arg", "first", "after"),
    [
        ("credit", 50, BudgetChange("b", 100, 50), (100, 50)),
        ("adjust", 50, BudgetChange("b", 150, 0), (150, 0)),
        ("adjust", -30, BudgetChange("b", 70, 0), (70, 0)),
        ("set_limit", 80, BudgetChange("b", 80, 0), (80, 0)),
    ],
)
async def test_an_operation_sent_again_under_its_id_applies_once(
    queue: Queue, op: str, arg: int, first: BudgetChange, after: tuple[int, int]
) -> None:
    b = queue.budgets
    await b.create("b", 100)
    call = getattr(b, op)
    assert await call("b", arg, op_id="op-1") == first
    # a change by someone else in between does not alter what the retry answers
    await b.adjust("b", 1000, op_id="op-2")
    retry = await call("b", arg, op_id="op-1")
    assert retry == BudgetChange("b", first.limit, first.credit, applied=False)
    state = await b.get("b")
    assert (state.limit, state.credit) == (after[0] + 1000, after[1])


async def test_an_operation_id_names_one_operation(queue: Queue) -> None:
    b = queue.budgets
    await b.create("a", 100)
    await b.create("c", 100)
    await b.credit("a", 10, op_id="x")
    for call in (b.credit("a", 11, op_id="x"), b.credit("c", 10, op_id="x"), b.adjust("a", 10, op_id="x")):
        with pytest.raises(BudgetError, match=r"operation id 'x' was used for credit on 'a'"):
            await call
    assert ((await b.get("a")).credit, (await b.get("c")).credit) == (10, 0)
    with pytest.raises(BudgetError, match="operation id 'no spaces' is not usable"):
        await b.credit("a", 1, op_id="no spaces")


async def test_top_up_is_a_deprecated_name_for_credit(queue: Queue) -> None:
    await queue.budgets.create("b", 100)
    with pytest.warns(DeprecationWarning, match="use credit"):
        change = await queue.budgets.top_up("b", 5, op_id="t")
    assert change == BudgetChange("b", 100, 5)


async def test_a_change_past_the_largest_limit_changes_nothing(queue: Queue) -> None:
    b = queue.budgets
    await b.create("b", 10**12 - 5)
    with pytest.raises(BudgetError, match="would take what it admits past"):
        await b.credit("b", 6, op_id="big")
    state = await b.get("b")
    assert (state.limit, state.credit) == (10**12 - 5, 0)
    # the id was not used up by the failed call
    assert await b.credit("b", 5, op_id="big") == BudgetChange("b", 10**12 - 5, 5)


# ---- held reservations: listed and swept -------------------------------------------------------------
async def test_held_reservations_are_listed_and_expired_ones_swept(queue: Queue) -> None:
    b = queue.budgets
    await b.create("team", 1000, now=T)
    await b.create("tenant", 500, parent="team", now=T)
    await b.reserve("tenant", 100, "crashed", hold=60, job_id="7", now=T)
    await b.reserve("team", 200, "alive", hold=3600, now=T + 1)
    await b.reserve("team", 50, "done", hold=60, now=T + 2)
    await b.commit("done", 40, now=T + 3)

    held = await b.held()
    assert [(h.id, h.budgets, h.tokens, h.reserved_at_ms, h.expires_at_ms, h.job) for h in held] == [
        ("crashed", ("tenant", "team"), 100, T, T + 60_000, "7"),
        ("alive", ("team",), 200, T + 1, T + 1 + HOUR_MS, None),
    ]
    assert [h.id for h in await b.held(budget="tenant")] == ["crashed"]
    assert await b.held(budget="nope") == []

    # Before its hold ends nothing is swept
    assert await b.sweep(now=T + 59_999) == []

    # After it, the crashed caller's hold is an unknown outcome: still charged, counted
    swept = await b.sweep(now=T + 60_000)
    assert [(s.id, s.state, s.changed, s.charged) for s in swept] == [("crashed", "unknown", True, 100)]
    tenant, team = await b.get_many(["tenant", "team"], now=T + 60_001)
    assert tenant is not None and team is not None
    assert (tenant.used, tenant.unknown_outcomes) == (100, 1)
    assert (team.used, team.unknown_outcomes) == (340, 1)
    assert [h.id for h in await b.held()] == ["alive"]
    # and a late commit changes nothing
    late = await b.commit("crashed", 10, now=T + 60_002)
    assert (late.state, late.changed, late.charged) == ("unknown", False, 100)


async def test_holds_can_be_swept_by_id_refunded_or_as_unknown(queue: Queue) -> None:
    b = queue.budgets
    await b.create("b", 1000)
    for rid in ("r1", "r2", "r3"):
        await b.reserve("b", 100, rid)
    await b.commit("r3", 100)
    swept = await b.sweep(["r1"], refund=True)
    assert [(s.id, s.state, s.changed, s.charged) for s in swept] == [("r1", "refunded", True, 0)]
    swept = await b.sweep(["r2", "r3", "never"])
    assert [(s.id, s.state, s.changed) for s in swept] == [
        ("r2", "unknown", True),
        ("r3", "committed", False),
        ("never", "missing", False),
    ]
    state = await b.get("b")
    assert (state.used, state.unknown_outcomes) == (200, 1)
    assert await b.held() == []
    with pytest.raises(BudgetError, match="refund=True needs the ids"):
        await b.sweep(refund=True)


async def test_reserve_sweeps_a_few_expired_holds_itself(queue: Queue) -> None:
    # A ledger used without any worker still cleans up after crashed callers
    b = queue.budgets
    await b.create("b", 1000, now=T)
    for i in range(12):
        await b.reserve("b", 10, f"old-{i}", hold=1, now=T)
    await b.reserve("b", 10, "new", now=T + 5000)
    left = [h.id for h in await b.held()]
    assert len(left) == 3 and "new" in left  # 10 swept by that one call
    assert (await b.get("b", now=T + 5000)).unknown_outcomes == 10


async def test_a_worker_sweeps_expired_holds(queue: Queue, redis_url: str) -> None:
    await queue.budgets.create("b", 1000)
    await queue.budgets.reserve("b", 70, "forgotten", hold=1)
    worker = Worker(queue.name, prefix=queue.prefix, reap_interval=0.2)

    @worker.handler
    async def noop(ctx: JobContext) -> None:
        return None

    async with running(worker, redis_url):

        async def swept() -> bool:
            return (await queue.budgets.get("b")).unknown_outcomes == 1

        await eventually(swept, timeout=10)
    assert await queue.budgets.held() == []
    assert (await queue.budgets.get("b")).used == 70
