"""``sluice budget`` and ``sluice flow``: they change the queue, fit 80 columns, take negative numbers."""

from __future__ import annotations

import asyncio
import json

from redis.asyncio import Redis

from sluice import Queue
from tests.cli.test_cli import invoke
from tests.harness.stepping import completed, leased, step

T = 1_800_000_000_000


async def test_budget_and_flow_commands_change_the_queue(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("ledger", redis=redis, prefix=prefix)
    where = ["--queue", "ledger", "--prefix", prefix, "--redis", redis_url]
    await invoke("budget", "create", "team", "1000", "--window", "month", *where)
    await invoke("budget", "create", "tenant", "200", "--window", "3600", "--parent", "team", *where)
    await invoke("budget", "create", "tenant", "5", "--exist-ok", *where)
    out = (await invoke("budget", "credit", "tenant", "50", *where)).stdout
    assert "200 +50" in out
    tenant = await q.budgets.get("tenant")
    assert (tenant.limit, tenant.credit, tenant.window, tenant.window_seconds, tenant.parent) == (
        200,
        50,
        "rolling",
        3600,
        "team",
    )
    await invoke("budget", "adjust", "tenant", "-20", "--op-id", "cut-1", *where)
    again = await invoke("budget", "adjust", "tenant", "-20", "--op-id", "cut-1", *where)
    assert "applied before: nothing changed now" in again.stderr
    assert (await q.budgets.get("tenant")).limit == 180
    reused = await invoke("budget", "credit", "tenant", "5", "--op-id", "cut-1", *where, code=1)
    assert "operation id 'cut-1' was used for adjust on 'tenant'" in reused.output
    assert "Nothing was changed" in reused.output
    old = await invoke("budget", "top-up", "tenant", "5", *where)
    assert "deprecated" in old.stderr and (await q.budgets.get("tenant")).credit == 55
    await invoke("budget", "set-limit", "team", "900", *where)
    assert (await q.budgets.get("team")).limit == 900
    out = (await invoke("budget", "list", *where)).stdout
    assert "team" in out and "└─tenant" in out and "rolling 1 h" in out and "month" in out
    assert out.index("team") < out.index("└─tenant")
    bad = await invoke("budget", "create", "x", "1", "--window", "fortnight", *where, code=2)
    assert '"day" or "month"' in bad.output
    # flow: set limits, pause, throttle, resume, remove a limit
    await invoke("flow", "set", "--concurrency", "4", "--rate", "4/1", "--tokens", "9000/60", *where)
    await invoke("flow", "pause", *where)
    await invoke("flow", "throttle", "30", *where)
    f = await q.flow()
    assert (f.concurrency, f.rate_max, f.rate_per_seconds, f.token_limit, f.paused) == (4, 4, 1.0, 9000, True)
    assert f.throttled_until_ms is not None
    await invoke("flow", "resume", *where)
    await invoke("flow", "throttle", "0", *where)
    out = (await invoke("flow", "set", "--rate", "none", *where)).stdout
    f = await q.flow()
    assert (f.paused, f.throttled_until_ms, f.rate_max, f.concurrency) == (False, None, None, 4)
    assert "request rate        none" in out
    nothing = await invoke("flow", "set", *where, code=2)
    assert "give --concurrency, --rate, --tokens, --limit, --token-limit, --tolerance-ms or" in nothing.output
    # the pacing: one setting changes, the other stays
    out = (await invoke("flow", "set", "--headroom-ms", "30", *where)).stdout
    assert "20 ms tolerance, 30 ms headroom (at least 30; none measured lately)" in out
    await invoke("flow", "set", "--tolerance-ms", "off", *where)
    f = await q.flow()
    assert (f.pace_tolerance_ms, f.headroom_ms) == (None, 30)
    bad = await invoke("flow", "set", "--tolerance-ms", "soon", *where, code=2)
    assert 'use whole ms from 0 to 60000, or "off"' in bad.output


async def test_budget_list_fits_80_columns(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("narrow", redis=redis, prefix=prefix)
    await q.budgets.create("engineering", 500_000_000, window="month")
    await q.budgets.create("search-team", 120_000_000, window=86_400, parent="engineering")
    await q.budgets.create("tenant.acme-corp", 2_500_000, window="day", parent="search-team")
    await q.budgets.reserve("tenant.acme-corp", 1_234_567, "r1")
    where = ["--queue", "narrow", "--prefix", prefix, "--redis", redis_url]
    out = (await invoke("budget", "list", *where, env={"COLUMNS": "80"})).stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    header = next(line for line in lines if "remaining" in line)
    assert header.split() == ["budget", "limit", "used", "remaining", "window", "resets", "in"]
    acme = next(line for line in lines if "tenant.acme-corp" in line)
    assert acme.split()[1:5] == ["2.5M", "1.23M", "1.27M", "day"], acme
    assert "└─search-team" in out and "rolling 1 d" in out and "accepted" not in out
    wide = (await invoke("budget", "list", "--wide", *where, env={"COLUMNS": "160"})).stdout
    assert "accepted" in wide and "parked" in wide and "UTC" in wide and "1,265,433" in wide
    data = json.loads((await invoke("budget", "list", "--json", *where)).stdout)
    assert [(b["name"], b["used"], b["parent"]) for b in data] == [
        ("engineering", 1_234_567, None),
        ("search-team", 1_234_567, "engineering"),
        ("tenant.acme-corp", 1_234_567, "search-team"),
    ]


async def test_negative_numbers_reach_the_command(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("neg", redis=redis, prefix=prefix)
    await q.budgets.create("plain", 100)
    where = ["--queue", "neg", "--prefix", prefix, "--redis", redis_url]
    credit = (await invoke("budget", "credit", "plain", "-100", *where, code=2)).output
    assert "tokens must be 1 or more, got -100" in credit and "sluice budget adjust NAME -N" in credit
    await invoke("budget", "adjust", "plain", "-30", *where)
    assert (await q.budgets.get("plain")).limit == 70
    await invoke("budget", "adjust", "plain", "30", *where)
    for args, said in (
        (["budget", "set-limit", "plain", "-5"], "the limit must be from 0 to"),
        (["budget", "create", "neg", "-1.5"], "'limit'"),
        (["flow", "throttle", "-2"], "seconds must be from 0 to 86400 (0 lifts the throttle), got -2"),
        (["flow", "set", "--concurrency", "-1"], "use a whole number of 1 or more"),
        (["enqueue", "x", "--priority", "-3"], "--priority"),
    ):
        out = (await invoke(*args, *where, code=2)).output
        assert said in out and "No such option" not in out, out
    assert (await q.budgets.get("plain")).limit == 100
    # Options are still options, and a payload may be a negative number.
    assert (
        "No such option: --bogus"
        in (await invoke("budget", "credit", "plain", "5", "--bogus", *where, code=2)).output
    )
    await invoke("enqueue", "x", "-7", "--any-name", *where)
    assert (await q.get_job("1")).payload == -7  # type: ignore[union-attr]


async def test_retention_commands_show_and_change_the_queues_setting(
    redis: Redis, redis_url: str, prefix: str
) -> None:
    q = Queue("kept", redis=redis, prefix=prefix)
    where = ["--queue", "kept", "--prefix", prefix, "--redis", redis_url]
    out = (await invoke("retention", "show", *where, env={"COLUMNS": "80"})).stdout
    assert "completed" in out and "1d" in out and "1,000,000 jobs" in out and "30d" in out
    await invoke("retention", "set", "completed", "--age", "2h", "--count", "50_000", *where)
    await invoke("retention", "set", "dead", "--age", "none", *where)
    kept = await q.retention()
    assert (kept["completed"].age, kept["completed"].count, kept["dead"].age) == (7200.0, 50_000, None)
    shown = json.loads((await invoke("retention", "show", "--json", *where)).stdout)
    assert shown["completed"] == {"age": 7200.0, "count": 50_000} and shown["dead"]["age"] is None
    for args, says in (
        (["finished", "--age", "1h"], "use one of completed, dead"),
        (["dead", "--age", "2x"], "use a duration such as 90s"),
        (["dead", "--count", "0"], "whole number of jobs"),
        (["dead"], "give --age or --count"),
    ):
        bad = await invoke("retention", "set", *args, *where, code=2)
        assert says in bad.output, bad.output
    assert await q.retention() == kept


async def test_an_overspent_budget_says_by_how_much(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("spent", redis=redis, prefix=prefix)
    await q.budgets.create("b", 100)
    await q.budgets.reserve("b", 100, "r")
    await q.budgets.commit("r", 150)  # the provider billed 150
    where = ["--queue", "spent", "--prefix", prefix, "--redis", redis_url]
    row = next(line for line in (await invoke("budget", "list", *where)).stdout.splitlines() if " b " in line)
    assert row.split()[1:5] == ["100", "150", "over", "50"], row
    data = json.loads((await invoke("budget", "list", "--json", *where)).stdout)
    assert (data[0]["overspent"], data[0]["beyond_estimates"], data[0]["remaining"]) == (50, 50, 0)


async def test_held_reservations_are_listed_and_swept(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("holds", redis=redis, prefix=prefix)
    await q.budgets.create("b", 1000)
    await q.budgets.reserve("b", 100, "crashed-caller", hold=1, job_id="42")
    await q.budgets.reserve("b", 200, "slow-caller", hold=3600)
    await q.budgets.reserve("b", 50, "never-called", hold=7200)
    await asyncio.sleep(1.1)
    where = ["--queue", "holds", "--prefix", prefix, "--redis", redis_url]
    out = (await invoke("budget", "held", *where, env={"COLUMNS": "100"})).stdout
    rows = [line for line in out.splitlines() if "caller" in line or "never" in line]
    assert [r.split()[0] for r in rows] == ["crashed-caller", "slow-caller", "never-called"], out
    assert "expired" in rows[0] and "42" in rows[0] and "expired" not in rows[1]
    data = json.loads((await invoke("budget", "held", "--json", *where)).stdout)
    assert next((h["id"], h["tokens"], h["budgets"]) for h in data) == ("crashed-caller", 100, ["b"])
    bad = await invoke("budget", "sweep", "--refund", *where, code=1)
    assert "--refund needs the ids" in bad.output
    out = (await invoke("budget", "sweep", *where)).stdout
    assert "1 hold(s) settled as unknown outcomes (tokens stay charged): crashed-caller" in out
    out = (await invoke("budget", "sweep", "never-called", "crashed-caller", "--refund", *where)).stdout
    assert "1 hold(s) refunded: never-called" in out and "crashed-caller: not held (unknown)" in out
    state = await q.budgets.get("b")
    assert (state.used, state.unknown_outcomes) == (300, 1)
    assert [h.id for h in await q.budgets.held()] == ["slow-caller"]


async def test_show_lists_what_each_attempt_spent(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("spend", redis=redis, prefix=prefix)
    await q.budgets.create("b", 1000)
    job = await q.add("llm", tokens=100, budget="b", max_attempts=2)
    ((job_id, token),) = leased(await step(q, T))
    failed = (job_id, token, b"f", b"boom", 0, 120)
    ((_, token2),) = leased(await step(q, T + 1, outcomes=[failed]))
    await step(q, T + 2, want=0, outcomes=[completed(job_id, token2)])
    where = ["--queue", "spend", "--prefix", prefix, "--redis", redis_url]
    out = (await invoke("show", job.id, *where, env={"COLUMNS": "120"})).stdout
    assert "220 tokens charged over its attempts" in out, out
    assert f"{job_id}:1" in out and "120 charged: 100 reserved, 120 reported (failed)" in out
    assert "100 charged: 100 reserved, not reported (completed)" in out
    data = json.loads((await invoke("show", job.id, "--json", *where)).stdout)
    assert data["spent"] == 220 and [a["outcome"] for a in data["attempts_spend"]] == ["failed", "completed"]
