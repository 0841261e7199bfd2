"""The root error handler: one line per error in the CLI's words, exit code 1; --debug for tracebacks."""

from __future__ import annotations

import subprocess
import sys

from redis.asyncio import Redis

from sluice import JobContext, Queue, Worker
from tests.cli.test_cli import cli, invoke
from tests.harness.proc_harness import REPO

UNREACHABLE = "redis://:s3cret@127.0.0.1:1/0"
PYTHON_WORDS = ("exist_ok", "queue.budgets", "set_limit", "top_up", "op_id", "None", "Traceback")


class BrokenWorker(Worker):
    """A user's Worker whose run() fails with an error Sluice does not know."""

    async def run(self, redis: object, *, handle_signals: bool = True) -> None:
        raise RuntimeError("the broken worker broke")


async def _noop(job: JobContext) -> None:
    return None


broken = BrokenWorker("broken", handlers={"noop": _noop})


def sluice_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_unreachable_redis_is_one_line_without_the_password() -> None:
    done = sluice_process("info", "--redis", UNREACHABLE)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: Redis at redis://127.0.0.1:1/0 is unavailable")
    assert "--redis or SLUICE_REDIS_URL" in lines[0] and "s3cret" not in done.stderr


def test_debug_prints_the_traceback() -> None:
    done = sluice_process("--debug", "budget", "list", "--redis", UNREACHABLE)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "RedisUnavailable" in done.stderr
    assert "s3cret" not in done.stderr
    by_env = cli("flow", "show", "--redis", UNREACHABLE, env={"SLUICE_DEBUG": "1"})
    assert by_env.exit_code == 1 and "Traceback (most recent call last)" in by_env.stderr
    at_the_end = cli("info", "--redis", UNREACHABLE, "--debug")  # as "run again with --debug" reads
    assert at_the_end.exit_code == 1 and "Traceback (most recent call last)" in at_the_end.stderr


def test_a_bad_environment_variable_is_one_line() -> None:
    done = sluice_process("info", env={"SLUICE_LOG_LEVEL": "loud"})
    assert done.returncode == 1
    assert done.stderr == "error: SLUICE_LOG_LEVEL='loud': use one of debug, info, warning, error\n"
    result = cli("dlq", "list", env={"SLUICE_LOG_FORMAT": "xml"})
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "SLUICE_LOG_FORMAT" in result.stderr


def test_any_other_exception_is_one_line_too(redis_url: str) -> None:
    result = cli("worker", "tests.cli.test_cli_errors:broken", "--redis", redis_url)
    assert result.exit_code == 1
    assert result.stderr == (
        "error: internal error: RuntimeError: the broken worker broke; run again with --debug and report it\n"
    )
    debug = cli("--debug", "worker", "tests.cli.test_cli_errors:broken", "--redis", redis_url)
    assert debug.exit_code == 1
    assert "Traceback (most recent call last)" in debug.stderr and "broken worker broke" in debug.stderr


def test_usage_errors_stay_clicks(redis_url: str) -> None:
    result = cli("info", "--bogus", "--redis", redis_url)
    assert result.exit_code == 2 and "No such option" in result.output
    result = cli("nonsense")
    assert result.exit_code == 2 and "No such command" in result.output


async def test_library_errors_are_worded_as_commands(redis: Redis, redis_url: str, prefix: str) -> None:
    where = ["-q", "words", "--prefix", prefix, "--redis", redis_url]
    await Queue("words", redis=redis, prefix=prefix).budgets.create("team", 100)
    exists = (await invoke("budget", "create", "team", "5", *where, code=1)).stderr
    assert f"budget 'team' exists already in queue words (prefix {prefix})" in exists
    assert f"`sluice budget adjust team N --queue words --prefix {prefix}` (every window)" in exists
    assert "`sluice budget credit team N" in exists
    missing = (await invoke("budget", "credit", "nobody", "5", *where, code=1)).stderr
    assert "no budget named 'nobody'" in missing and "`sluice budget create nobody LIMIT" in missing
    parent = (await invoke("budget", "create", "kid", "5", "--parent", "mom", *where, code=1)).stderr
    assert "parent budget 'mom' does not exist" in parent and "`sluice budget create mom LIMIT" in parent
    flow = (await invoke("flow", "set", "--rate", "0/1", *where, code=2)).output
    assert '"none" to remove it' in flow
    for text in (exists, missing, parent, flow):
        assert text.count("\n") <= 1 or "Usage:" in text
        assert not [w for w in PYTHON_WORDS if w in text], text
