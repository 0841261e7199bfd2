"""Several windows per kind (Queue.set_limits): a provider's limits as its page states them.

The shortest window of each kind is the paced limit; the longer ones are hard
caps (exact sliding logs over W + h). Driven step by step with the clock passed
in (tests/harness/stepping.py), through the CLI, and against bad input.
"""

from __future__ import annotations

import json

import pytest
from redis.asyncio import Redis

from sluice import ConfigurationError, JobRejected, JobSpec, JobState, Queue, RateWindow
from sluice.engine.budget_state import TOKEN_RATE_BUDGET, token_cap_budget
from tests.cli.test_cli import invoke
from tests.harness.stepping import completed, leased, step
from tests.harness.stepping import ids_of as ids

#: A fixed clock for the tests that pass ``now`` (Unix ms).
T = 1_800_000_000_000
MINUTE, DAY = 60_000, 86_400_000
DAY_CAP = token_cap_budget(DAY)


# ---- requests ------------------------------------------------------------------------------------------
async def test_a_day_cap_stops_starts_the_minute_window_would_admit(queue: Queue) -> None:
    # Given 2 starts a minute and 6 a day, the logs alone (no pacer), 5 ms of headroom
    await queue.set_pacing(tolerance_ms=None, headroom_ms=5)
    await queue.set_limits(requests={"minute": 2, "day": 6})
    jobs = await queue.add_bulk(JobSpec("x") for _ in range(9))

    # When a worker takes what the windows admit, a minute (and the headroom) apart
    for i, at in enumerate((T, T + MINUTE + 5, T + 2 * (MINUTE + 5))):
        reply = await step(queue, at)
        assert ids(reply) == [j.id for j in jobs[2 * i : 2 * i + 2]]

    # Then the day is full though the minute has room: nothing starts, and the worker is told
    # to come back when the oldest start leaves the day's W + h
    assert reply.next_due == T + DAY + 5
    refused = (await queue.refusals())["rate"]
    reply = await step(queue, T + 3 * (MINUTE + 5))
    assert (ids(reply), reply.next_due) == ([], T + DAY + 5)
    assert (await queue.refusals())["rate"] == refused + 1  # counted as the request rate's
    flow = await queue.flow(now=T + 3 * (MINUTE + 5))
    assert flow.windows == (
        RateWindow("requests", 2, 60.0, 0, paced=True),
        RateWindow("requests", 6, 86_400.0, 6, paced=False),
    )
    assert ids(await step(queue, T + DAY + 4)) == []
    assert ids(await step(queue, T + DAY + 5)) == [j.id for j in jobs[6:8]]


async def test_a_full_window_opens_when_its_nth_newest_start_leaves(queue: Queue) -> None:
    # Given 6 starts in the day at T, T + 1 min and T + 2 min (2 each)
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_limits(requests={"minute": 2, "day": 6})
    jobs = await queue.add_bulk(JobSpec("x") for _ in range(8))
    for at in (T, T + MINUTE, T + 2 * MINUTE):
        await step(queue, at)

    # When the day's limit is lowered to 4: 6 starts are in its window
    await queue.set_limits(requests={"minute": 2, "day": 4})

    # Then the oldest two leaving is not enough: it opens when the 4th newest (T + 1 min) leaves
    reply = await step(queue, T + 3 * MINUTE)
    assert (ids(reply), reply.next_due) == ([], T + MINUTE + DAY)
    assert ids(await step(queue, T + DAY)) == []
    assert ids(await step(queue, T + MINUTE + DAY)) == [j.id for j in jobs[6:8]]


async def test_the_pacer_spaces_by_the_shortest_window_and_the_cap_still_binds(queue: Queue) -> None:
    # Given 4 starts a second (paced 250 ms apart, no headroom) and 6 a minute
    await queue.set_pacing(headroom_ms=0)
    await queue.set_limits(requests={"second": 4, "minute": 6})
    jobs = await queue.add_bulk(JobSpec("x") for _ in range(8))
    at, started = T, list[str]()
    while len(started) < 6:
        reply = await step(queue, at)
        started += ids(reply)
        at = reply.next_due
    # Then six went 250 ms apart (each worker 20 ms early: the tolerance), and the seventh
    # waits for the first to leave the minute
    assert started == [j.id for j in jobs[:6]]
    assert at == T + MINUTE
    assert ids(await step(queue, T + MINUTE)) == [jobs[6].id]


async def test_the_log_keeps_the_starts_of_the_longest_window(queue: Queue) -> None:
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_limits(requests={"second": 1, "hour": 5})
    await queue.add_bulk(JobSpec("x") for _ in range(3))
    await step(queue, T)
    await step(queue, T + 10 * MINUTE)
    # until an hour (and the 500 ms margin) later, the first start is kept; then it goes
    await step(queue, T + 3_600_499)
    assert await queue.redis.zcard(queue.keys.starts) == 3
    await step(queue, T + 3_600_500)
    assert await queue.redis.zcard(queue.keys.starts) == 2


async def test_set_rate_limit_replaces_the_paced_window_and_keeps_the_caps(queue: Queue) -> None:
    await queue.set_limits(requests={"minute": 500, "day": 10_000})
    await queue.set_rate_limit(600, per=60)
    flow = await queue.flow(now=T)
    assert [(w.limit, w.per_seconds, w.paced) for w in flow.windows] == [
        (600, 60.0, True),
        (10_000, 86_400.0, False),
    ]
    # the paced window must stay the shortest and the lowest: nothing changes otherwise
    for most, per in ((20_000, 60), (600, 86_400)):
        with pytest.raises(
            ConfigurationError, match=r"other requests window \(10000 per 86400 s\); set every"
        ):
            await queue.set_rate_limit(most, per=per)
    assert (await queue.flow(now=T)).windows == flow.windows
    # None removes every request window
    await queue.set_rate_limit(None)
    flow = await queue.flow(now=T)
    assert (flow.rate_max, flow.windows) == (None, ())
    assert await queue.redis.hget(queue.keys.control, "rate_caps") is None


# ---- tokens ------------------------------------------------------------------------------------------
async def test_a_day_token_cap_stops_starts_the_minute_window_would_admit(queue: Queue) -> None:
    # Given 1000 tokens a minute and 1500 a day (no pacer, 5 ms of headroom), jobs of 400
    await queue.set_pacing(tolerance_ms=None, headroom_ms=5)
    await queue.set_limits(tokens={"minute": 1000, "day": 1500})
    jobs = await queue.add_bulk(JobSpec("llm", tokens=400) for _ in range(5))

    # Then two fit the minute, and the third waits for it to turn
    reply = await step(queue, T)
    assert (ids(reply), reply.next_due) == ([jobs[0].id, jobs[1].id], T + MINUTE + 5)
    # When the minute has turned, the day admits one more (1200 of 1500), not two: the fourth
    # waits until the day frees 100 tokens, when the first charge leaves its W + h
    reply = await step(queue, T + MINUTE + 5)
    assert (ids(reply), reply.next_due) == ([jobs[2].id], T + DAY + 5)
    assert (await queue.refusals())["token_rate"] == 2
    flow = await queue.flow(now=T + MINUTE + 5)
    assert flow.windows == (
        RateWindow("tokens", 1000, 60.0, 400, paced=True),
        RateWindow("tokens", 1500, 86_400.0, 1200, paced=False),
    )
    assert (flow.token_limit, flow.token_per_seconds, flow.tokens_in_window) == (1000, 60.0, 400)
    # the two charges of T leave both windows: 400 + 800 of the day's 1500, 800 of the minute's
    assert ids(await step(queue, T + DAY + 4)) == []
    assert ids(await step(queue, T + DAY + 5)) == [jobs[3].id, jobs[4].id]


@pytest.mark.parametrize("refund", [False, True])
async def test_usage_below_the_estimate_is_kept_by_every_token_window(queue: Queue, refund: bool) -> None:
    # Given a minute and a day of tokens (no pacer), and a budget of the job's own
    await queue.set_pacing(tolerance_ms=None, headroom_ms=5)
    await queue.set_limits(tokens={"minute": 1000, "day": 5000}, refund_unused=refund)
    await queue.budgets.create("team", 10_000)
    job = await queue.add("llm", tokens=400, budget="team")
    ((_, token),) = leased(await step(queue, T))

    # When it reports 100 tokens used
    await step(queue, T + 1, want=0, outcomes=[completed(job.id, token, usage=100)])

    # Then every token window keeps the 400 its provider counted (or gives back 300 on all
    # of them with refund_unused), while the budget is charged what was used
    kept = 100 if refund else 400
    assert [w.in_window for w in (await queue.flow(now=T + 1)).windows] == [kept, kept]
    tpm, day, team = await queue.budgets.get_many([TOKEN_RATE_BUDGET, DAY_CAP, "team"], now=T + 1)
    assert (tpm and tpm.used, day and day.used, team and team.used) == (kept, kept, 100)
    # and usage above it is taken in full on all of them
    second = await queue.add("llm", tokens=100, budget="team")
    ((_, token),) = leased(await step(queue, T + 2))
    await step(queue, T + 3, want=0, outcomes=[completed(second.id, token, usage=250)])
    assert [w.in_window for w in (await queue.flow(now=T + 3)).windows] == [kept + 250, kept + 250]


async def test_a_token_cap_counts_over_the_headroom_and_follows_it(queue: Queue) -> None:
    await queue.set_limits(tokens={"minute": 1000, "day": 5000})
    cap = queue.keys.budget_prefix + DAY_CAP
    assert await queue.redis.hget(cap, "win_ms") == str(DAY + 10).encode()  # the least, by default
    await queue.set_pacing(headroom_ms=30)
    assert await queue.redis.hget(cap, "win_ms") == str(DAY + 30).encode()
    # the workers' measured spread, when larger (lag.lua)
    k = queue.keys
    await queue.scripts.lag(
        keys=[k.control, k.lags, k.budget_prefix, k.budget_log_prefix],
        args=[T, "w", 0.0, 45.0, 10_000, 0],
    )
    assert await queue.redis.hget(cap, "win_ms") == str(DAY + 45).encode()
    assert await queue.redis.hget(k.budget_prefix + TOKEN_RATE_BUDGET, "win_ms") == str(MINUTE + 45).encode()


async def test_a_token_cap_removed_is_forgotten_and_one_kept_goes_on_counting(queue: Queue) -> None:
    await queue.set_limits(tokens={"minute": 1000, "hour": 3000, "day": 5000})
    await queue.add("llm", tokens=400)
    await step(queue, T)
    hour = token_cap_budget(3_600_000)
    # the hour goes, the day stays with a new limit and keeps its count
    await queue.set_limits(tokens={"minute": 1000, "day": 6000})
    assert not await queue.redis.exists(queue.keys.budget_prefix + hour, queue.keys.budget_log_prefix + hour)
    flow = await queue.flow(now=T + 1)
    assert [(w.limit, w.in_window) for w in flow.windows] == [(1000, 400), (6000, 400)]
    # set_token_rate_limit changes the paced window only; None removes them all
    await queue.set_token_rate_limit(2000, per=60)
    assert [w.limit for w in (await queue.flow(now=T + 1)).windows] == [2000, 6000]
    await queue.set_token_rate_limit(None)
    assert (await queue.flow(now=T + 1)).windows == ()
    assert not await queue.redis.exists(queue.keys.budget_prefix + DAY_CAP)


async def test_an_estimate_larger_than_a_cap_is_rejected_with_the_window_named(queue: Queue) -> None:
    # A longer window always admits more (set_limits checks it), so only a cap lowered by
    # hand (or another writer) can be smaller than the paced limit: the job is still refused
    await queue.set_limits(tokens={"minute": 1000, "day": 5000})
    await queue.redis.hset(queue.keys.budget_prefix + DAY_CAP, "limit", 700)
    job = await queue.add("llm", tokens=800)
    await step(queue, T)
    assert await job.state() is JobState.REJECTED
    with pytest.raises(
        JobRejected, match="token estimate 800 exceeds the queue token-rate limit of 700 per 86400 s"
    ):
        await job.result(timeout=1)


async def test_the_rate_budgets_are_not_listed_as_budgets(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("llm", redis=redis, prefix=prefix)
    await q.set_limits(tokens={"minute": 1000, "day": 5000})
    await q.budgets.create("team", 10)
    out = json.loads(
        (
            await invoke(
                "budget", "list", "--json", "--queue", "llm", "--prefix", prefix, "--redis", redis_url
            )
        ).stdout
    )
    assert [b["name"] for b in out] == ["team"]


# ---- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({}, "give requests=, tokens= or both"),
        ({"requests": [500]}, "requests must be a dict of window -> limit"),
        ({"requests": {"week": 5}}, "'week' is not a window: use one of second, minute, hour, day"),
        ({"requests": {"minute": 0}}, "requests per 'minute' must be an integer >= 1, got 0"),
        ({"requests": {"minute": 5.5}}, "must be an integer >= 1, got 5.5"),
        ({"requests": {172_800: 5}}, "requests window must be from 0.001 to 86400 seconds, got 172800"),
        ({"requests": {1: 1, 60: 2, 3600: 3, 86_400: 4}}, "requests: at most 3 windows, got 4"),
        ({"requests": {"minute": 5, 60: 6}}, "the window of 60 s is given twice"),
        ({"requests": {"minute": 500, "day": 400}}, "400 per 86400 s must be more than 500 per 60 s"),
        (
            {"requests": {"minute": 500, "day": 2_000_000}},
            "at most 1,000,000, got 2,000,000: the request log",
        ),
        ({"tokens": {0.5: 100}}, "tokens window must be from 1 to 86400 seconds, got 0.5"),
        ({"tokens": {"minute": 2 * 10**12}}, "tokens per 60 s must be at most"),
        ({"requests": {"minute": 5}, "refund_unused": True}, "refund_unused applies to the token windows"),
        ({"requests": {"minute": 5}, "tokens": {"day": 0}}, "tokens per 'day' must be an integer"),
    ],
)
async def test_bad_limits_say_what_to_fix_and_change_nothing(
    queue: Queue, kwargs: dict[str, object], said: str
) -> None:
    await queue.set_limits(requests={"second": 2})
    with pytest.raises(ConfigurationError, match=said.replace("(", r"\(").replace(")", r"\)")):
        await queue.set_limits(**kwargs)  # type: ignore[arg-type]
    assert [(w.kind, w.limit) for w in (await queue.flow()).windows] == [("requests", 2)]


async def test_an_empty_dict_removes_the_windows_of_its_kind(queue: Queue) -> None:
    await queue.set_limits(requests={"minute": 500, "day": 10_000}, tokens={"minute": 30_000, "day": 10**6})
    await queue.set_limits(requests={})
    flow = await queue.flow()
    assert [(w.kind, w.limit) for w in flow.windows] == [("tokens", 30_000), ("tokens", 10**6)]
    assert flow.rate_max is None


# ---- the command line ----------------------------------------------------------------------------------
async def test_flow_set_takes_a_providers_limits(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("llm", redis=redis, prefix=prefix)
    where = ["--queue", "llm", "--prefix", prefix, "--redis", redis_url]
    out = (
        await invoke(
            "flow",
            "set",
            "--limit",
            "500/min",
            "--limit",
            "10000/day",
            "--token-limit",
            "30000/minute",
            "--token-limit",
            "1000000/d",
            *where,
            env={"COLUMNS": "100"},
        )
    ).stdout
    assert "request rate        500 per 60 s (0 started in the window)" in out
    assert "request cap         10000 per 86400 s (0 started in it)" in out
    assert "token cap           1,000,000 per 86400 s (0 in it)" in out
    flow = await q.flow()
    assert [(w.kind, w.limit, w.per_seconds, w.paced) for w in flow.windows] == [
        ("requests", 500, 60.0, True),
        ("requests", 10_000, 86_400.0, False),
        ("tokens", 30_000, 60.0, True),
        ("tokens", 1_000_000, 86_400.0, False),
    ]
    shown = json.loads((await invoke("flow", "show", "--json", *where)).stdout)
    assert shown["windows"][1] == {
        "kind": "requests",
        "limit": 10_000,
        "per_seconds": 86_400.0,
        "in_window": 0,
        "paced": False,
    }
    # seconds work too; "none" removes a kind's windows
    await invoke("flow", "set", "--limit", "4/1", "--limit", "100/3600", "--token-limit", "none", *where)
    assert [(w.kind, w.limit) for w in (await q.flow()).windows] == [("requests", 4), ("requests", 100)]
    for args, said in (
        (["--limit", "5/week"], "use N/WINDOW, WINDOW one of s, min, h, day"),
        (["--limit", "five/min"], "e.g. 500/min or 10000/day"),
        (["--limit", "5/min", "--limit", "6/60"], "the window of 60 s is given twice"),
        (["--limit", "500/min", "--limit", "10/day"], "10 per 86400 s must be more than 500 per 60 s"),
        (["--limit", "5/min", "--rate", "4/1"], "give --rate (the shortest window only) or --limit"),
        (["--token-limit", "100/0.5"], "tokens window must be from 1 to 86400 seconds"),
    ):
        bad = (await invoke("flow", "set", *args, *where, code=2)).output
        assert said in " ".join(bad.split()), bad
    assert [w.limit for w in (await q.flow()).windows] == [4, 100]
