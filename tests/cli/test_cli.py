"""The command line against a real Redis: enqueue, info, show, dlq, --prefix, --json, --help.

Commands run through typer's CliRunner in a thread (the CLI runs its own
event loop); the other tests/test_cli_*.py files use :func:`invoke` from here.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from typer.core import TyperArgument, TyperOption
from typer.main import get_command
from typer.testing import CliRunner, Result

import sluice
from sluice import JobState, Queue
from sluice.cli.app import app
from sluice.engine.protocol import LEASED_FIELDS
from sluice.settings import ENVIRONMENT

runner = CliRunner()


def cli(*args: str, env: dict[str, str] | None = None, input: str | None = None) -> Result:
    return runner.invoke(app, list(args), env={"COLUMNS": "200", **(env or {})}, input=input)


async def invoke(
    *args: str, code: int = 0, env: dict[str, str] | None = None, input: str | None = None
) -> Result:
    """Run a command in a thread and check its exit code."""
    result = await asyncio.to_thread(cli, *args, env=env, input=input)
    assert result.exit_code == code, result.output
    return result


async def dead_letter(q: Queue, error: str, count: int = 1) -> list[str]:
    """Add jobs and dead-letter them as a worker would (leased, then failed permanently)."""
    ids = [(await q.add("x")).id for _ in range(count)]
    reply = await q.protocol.step(now=1, want=count, lease_ms=1000, worker_id="w")
    tokens = {reply.jobs[i].decode(): reply.jobs[i + 1] for i in range(0, len(reply.jobs), LEASED_FIELDS)}
    outcomes = [(i, str(tokens[i]).encode(), b"p", error.encode(), 0, -1) for i in ids]
    await q.protocol.step(now=2, want=0, lease_ms=1000, worker_id="w", outcomes=outcomes)
    return ids


async def test_enqueue_show_info(redis_url: str, prefix: str) -> None:
    where = ["--queue", "cli", "--prefix", prefix, "--redis", redis_url]
    out = await invoke(
        "enqueue", "summarize", '{"text": "hi"}', "--priority", "4", "--idempotency-key", "k1", *where
    )
    assert "job 1 added to queue cli" in out.stdout
    assert "could not be checked" in out.stderr  # no worker has served the queue yet
    out = await invoke("enqueue", "summarize", '{"text": "again"}', "--idempotency-key", "k1", *where)
    assert "job 1 already existed (same id or idempotency key)" in out.stdout
    shown = (await invoke("show", "1", *where)).stdout
    assert '{"text":"hi"}' in shown and "waiting, for" in shown and "idempotency key  k1" in shown
    assert "created " in shown and " UTC" in shown and "_ms" not in shown
    info = (await invoke("info", *where)).stdout
    assert re.search(r"waiting\s+1\s", info) and re.search(r"added\s+1\s", info)
    assert "no worker has served this queue yet" in info


async def test_show_prints_utc_times_durations_and_the_whole_error(
    redis: Redis, redis_url: str, prefix: str
) -> None:
    q = Queue("shown", redis=redis, prefix=prefix)
    trace = (
        'ValueError: bad input\nTraceback (most recent call last):\n  File "app.py", line 3\n'
        "ValueError: bad input"
    )
    (job_id,) = await dead_letter(q, trace)
    out = (await invoke("show", job_id, "-q", "shown", "--prefix", prefix, "--redis", redis_url)).stdout
    for label in ("created ", "started ", "finished ", "waited ", "ran ", "1970-01-01 00:00:00.001 UTC"):
        assert label in out, out
    assert out.rstrip().endswith('  File "app.py", line 3\nValueError: bad input')
    record = json.loads(
        (
            await invoke("show", job_id, "-q", "shown", "--prefix", prefix, "--redis", redis_url, "--json")
        ).stdout
    )
    assert (record["state"], record["started_ms"], record["error"]) == ("dead", 1, trace)


async def test_json_on_stdout_alone(redis: Redis, redis_url: str, prefix: str) -> None:
    where = ["-q", "js", "--prefix", prefix, "--redis", redis_url, "--json"]
    q = Queue("js", redis=redis, prefix=prefix)
    (dead,) = await dead_letter(q, "boom")
    added = await invoke("enqueue", "x", "[1, 2]", *where)
    assert json.loads(added.stdout) == {"ids": ["2"], "added": 1, "existing": 0}
    assert "warning" in added.stderr  # the name could not be checked: said on stderr only
    info = json.loads((await invoke("info", *where)).stdout)
    assert (info["counts"]["dead"], info["counts"]["waiting"], info["workers"]) == (1, 1, [])
    assert [r["id"] for r in json.loads((await invoke("dlq", "list", *where)).stdout)] == [dead]
    assert json.loads((await invoke("dlq", "show", dead, *where)).stdout)["error"] == "boom"
    assert json.loads((await invoke("show", "2", *where)).stdout)["payload"] == [1, 2]
    assert json.loads((await invoke("flow", "show", *where)).stdout)["paused"] is False
    assert json.loads((await invoke("budget", "list", *where)).stdout) == []


async def test_prefix_finds_a_queue_with_a_custom_prefix(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("custom", redis=redis, prefix=prefix)
    await q.add("x", {"n": 1})
    await q.budgets.create("team", 10)
    missing = await invoke("show", "1", "-q", "custom", "--redis", redis_url, code=1)
    assert "no job 1 in queue custom" in missing.stderr and "--prefix" in missing.stderr
    assert "no jobs and no workers" in (await invoke("info", "-q", "custom", "--redis", redis_url)).stderr
    where = ["-q", "custom", "--prefix", prefix, "--redis", redis_url]
    assert '{"n":1}' in (await invoke("show", "1", *where)).stdout
    assert re.search(r"waiting\s+1\s", (await invoke("info", *where)).stdout)
    assert "team" in (await invoke("budget", "list", *where)).stdout
    await invoke("flow", "pause", *where)
    assert (await q.flow()).paused
    bad = await invoke("info", "--prefix", "no{braces}", "--redis", redis_url, code=2)
    assert "key prefix 'no{braces}' is not usable" in bad.output


async def test_dlq_list_show_redrive_purge(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("dlq", redis=redis, prefix=prefix)
    ids = await dead_letter(q, "boom: quota\nTraceback...", count=2)
    where = ["--queue", "dlq", "--prefix", prefix, "--redis", redis_url]
    out = (await invoke("dlq", "list", *where)).stdout
    assert "boom: quota" in out and "Traceback" not in out and "2 job(s)" in out
    assert "Traceback..." in (await invoke("dlq", "show", ids[0], *where)).stdout
    assert "redrove 1 job(s)" in (await invoke("dlq", "redrive", ids[0], *where)).stdout
    assert await q.job_state(ids[0]) is JobState.WAITING
    again = await invoke("dlq", "redrive", ids[0], *where, code=1)
    assert "is waiting; only dead jobs can be redriven" in again.stderr
    # A list with one id that is not dead changes nothing, not even for the dead ones in it
    mixed = await invoke("dlq", "redrive", ids[1], ids[0], *where, code=1)
    assert "only dead jobs can be redriven" in mixed.stderr
    assert await q.job_state(ids[1]) is JobState.DEAD
    refused = await invoke("dlq", "purge", *where, input="n\n", code=1)
    assert "Aborted" in refused.output and await q.get_job(ids[1]) is not None
    assert "purged 1 job(s)" in (await invoke("dlq", "purge", "--yes", *where)).stdout
    assert await q.get_job(ids[1]) is None


def test_bad_payload_says_how_to_fix(redis_url: str) -> None:
    result = cli("enqueue", "x", "{bad", "--redis", redis_url)
    assert result.exit_code == 2
    assert "not valid JSON" in result.output and "quote it" in result.output


def test_bad_priority_is_a_usage_error(redis_url: str) -> None:
    result = cli("enqueue", "x", "--priority", "-3", "--redis", redis_url)
    assert result.exit_code == 2
    assert "--priority" in result.output and "No such option" not in result.output


def test_bad_redis_url() -> None:
    result = cli("info", "--redis", "http://nope")
    assert result.exit_code == 1
    assert "unix:///path/to/redis.sock" in result.stderr and len(result.stderr.splitlines()) == 1


def test_version() -> None:
    result = cli("--version")
    assert (result.exit_code, result.stdout) == (0, f"sluice {sluice.__version__}\n")


def _commands(command: object, path: str = "sluice") -> Iterator[tuple[str, object]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, f"{path} {name}")


def test_help_explains_every_command_option_and_variable() -> None:
    root = cli("--help", env={"COLUMNS": "120"})
    assert root.exit_code == 0
    for var in ENVIRONMENT:
        assert var.name in root.stdout
    assert "embedded Redis of SLUICE_HOME" in root.stdout and "shared" in root.stdout
    missing = []
    for path, command in _commands(get_command(app)):
        if not getattr(command, "help", None):
            missing.append(path)
        for param in getattr(command, "params", []):
            if isinstance(param, TyperOption | TyperArgument) and not param.help:
                missing.append(f"{path} {param.name}")
    assert missing == []


@pytest.mark.parametrize(
    "command", ["info", "enqueue", "show", "worker", "dlq list", "budget create", "flow set"]
)
def test_every_command_has_help(command: str) -> None:
    result = cli(*command.split(), "--help")
    assert result.exit_code == 0 and "--redis" in result.stdout
