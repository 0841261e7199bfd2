"""The command line against a real Redis: enqueue, info, show, dlq."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from typer.testing import CliRunner

from sluice import JobState, Queue
from sluice.cli.app import app

runner = CliRunner()


async def invoke(*args: str) -> str:
    """Run a command in a thread: the CLI runs its own event loop."""
    result = await asyncio.to_thread(runner.invoke, app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


async def test_enqueue_show_info(redis_url: str, redis: Redis) -> None:
    queue = "cli" + str(id(redis))
    out = await invoke(
        "enqueue",
        "summarize",
        '{"text": "hi"}',
        "--queue",
        queue,
        "--priority",
        "4",
        "--idempotency-key",
        "k1",
        "--redis",
        redis_url,
    )
    assert "job 1 added" in out
    out = await invoke(
        "enqueue",
        "summarize",
        '{"text": "again"}',
        "--queue",
        queue,
        "--idempotency-key",
        "k1",
        "--redis",
        redis_url,
    )
    assert "already existed" in out
    shown = await invoke("show", "1", "--queue", queue, "--redis", redis_url)
    assert '{"text":"hi"}' in shown and "waiting" in shown
    info = await invoke("info", "--queue", queue, "--redis", redis_url)
    assert "waiting" in info and "added" in info


def test_bad_payload_says_how_to_fix(redis_url: str) -> None:
    result = runner.invoke(app, ["enqueue", "x", "{bad", "--redis", redis_url])
    assert result.exit_code == 2
    assert "not valid JSON" in result.output


def test_bad_priority_is_a_clear_error(redis_url: str) -> None:
    result = runner.invoke(app, ["enqueue", "x", "--priority", "-3", "--redis", redis_url])
    assert result.exit_code == 1
    assert "priority must be an integer from 0" in result.output


def test_bad_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    result = runner.invoke(app, ["info", "--redis", "http://nope"])
    assert result.exit_code == 1
    assert "unix:///path/to/redis.sock" in result.output


def test_worker_target_must_be_a_worker() -> None:
    result = runner.invoke(app, ["worker", "tests.test_cli:runner", "--redis", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2
    assert "not a sluice.Worker" in result.output


async def test_dlq_list_redrive_purge(redis_url: str, redis: Redis, prefix: str) -> None:
    name = "dlq" + prefix
    q = Queue(name, redis=redis)
    jobs = [await q.add("x") for _ in range(2)]
    # Dead-letter both by leasing them and failing them permanently
    reply = await q.protocol.step(now=1, want=2, lease_ms=1000, worker_id="w")
    tokens = {reply.jobs[i].decode(): reply.jobs[i + 1] for i in range(0, len(reply.jobs), 9)}
    await q.protocol.step(
        now=2,
        want=0,
        lease_ms=1000,
        worker_id="w",
        outcomes=[(j.id, str(tokens[j.id]).encode(), b"p", b"boom: quota", 0, -1) for j in jobs],
    )
    out = await invoke("dlq", "list", "--queue", name, "--redis", redis_url)
    assert "boom: quota" in out
    assert "redrove 1 job(s)" in await invoke(
        "dlq", "redrive", jobs[0].id, "--queue", name, "--redis", redis_url
    )
    assert await q.job_state(jobs[0].id) is JobState.WAITING
    assert "purged 1 job(s)" in await invoke("dlq", "purge", "--yes", "--queue", name, "--redis", redis_url)
    assert await q.get_job(jobs[1].id) is None


async def test_budget_and_flow_commands_change_the_queue(redis_url: str, redis: Redis) -> None:
    name = "ledger" + str(id(redis))
    q = Queue(name, redis=redis)
    where = ["--queue", name, "--redis", redis_url]
    # budgets: create a team and a tenant under it, top the tenant up, list them
    await invoke("budget", "create", "team", "1000", "--window", "month", *where)
    await invoke("budget", "create", "tenant", "200", "--window", "3600", "--parent", "team", *where)
    await invoke("budget", "top-up", "tenant", "50", *where)
    tenant = await q.budgets.get("tenant")
    assert (tenant.limit, tenant.window, tenant.window_seconds, tenant.parent) == (
        250,
        "rolling",
        3600,
        "team",
    )
    out = await invoke("budget", "list", *where)
    assert "team" in out and "tenant" in out and "rolling 3600 s" in out and "month" in out
    bad = await asyncio.to_thread(runner.invoke, app, ["budget", "top-up", "nobody", "5", *where])
    assert bad.exit_code == 1 and "no budget named 'nobody'" in bad.output
    # flow: set limits, pause, throttle, resume, remove a limit
    await invoke("flow", "set", "--concurrency", "4", "--rate", "4/1", "--tokens", "9000/60", *where)
    await invoke("flow", "pause", *where)
    await invoke("flow", "throttle", "30", *where)
    f = await q.flow()
    assert (f.concurrency, f.rate_max, f.rate_per_seconds, f.token_limit, f.paused) == (4, 4, 1.0, 9000, True)
    assert f.throttled_until_ms is not None
    await invoke("flow", "resume", *where)
    await invoke("flow", "throttle", "0", *where)
    out = await invoke("flow", "set", "--rate", "none", *where)
    f = await q.flow()
    assert (f.paused, f.throttled_until_ms, f.rate_max, f.concurrency) == (False, None, None, 4)
    assert "request rate" in out and "none" in out
