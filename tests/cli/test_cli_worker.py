"""``sluice worker`` options reach the Worker, in every process of ``--processes N``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from redis.asyncio import Redis

from sluice import JobState, Queue, WorkerInfo
from sluice.engine.clock import now_ms
from tests.cli.test_cli import cli
from tests.conftest import eventually
from tests.harness.proc_harness import REPO, TARGET, WorkerProc


async def test_worker_options_reach_every_worker_process(
    redis: Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # The module's own settings (from SLUICE_TEST_*) say lease 30 s, grace 30 s, queue "q",
    # no timeout; the command line says otherwise, and the processes must do as it says.
    env = {
        **os.environ,
        "SLUICE_TEST_REDIS": redis_url,
        "SLUICE_TEST_PREFIX": "not" + prefix,
        "SLUICE_TEST_LEASE": "30",
        "SLUICE_TEST_GRACE": "30",
        "SLUICE_LOG_LEVEL": "info",
    }
    options = ["--lease", "0.5", "--shutdown-grace", "1", "--timeout", "2", "--concurrency", "2"]
    where = ["--queue", "cliq", "--prefix", prefix, "--redis", redis_url, "--worker-id", "w"]
    argv = [sys.executable, "-m", "sluice", "worker", TARGET, "--processes", "2", *options, *where]
    proc = _start(argv, env, tmp_path / "worker.log")
    q = Queue("cliq", redis=redis, prefix=prefix)
    try:
        workers = await eventually(lambda: _both(q), timeout=30)
        assert sorted(w.id for w in workers) == ["w-1", "w-2"] and {w.concurrency for w in workers} == {2}
        # The children get the URL in their environment: `ps` must not show a password.
        assert [c for c in proc.children() if redis_url in " ".join(c.cmdline())] == []
        never = str(tmp_path / "never-opened")
        timed_out = await q.add("task", {"gate": never}, max_attempts=1)
        released = await q.add("task", {"gate": never}, timeout=60)
        await eventually(lambda: _active(q, 2), timeout=10)
        # --lease 0.5: every lease deadline is at most half a second away (renewed every 1/6 s).
        deadlines: list[tuple[bytes, float]] = await redis.zrange(q.keys.active, 0, -1, withscores=True)  # type: ignore[assignment]
        assert all(score - now_ms() <= 600 for _, score in deadlines), deadlines
        # --timeout 2: the job without a timeout of its own is stopped after 2 s.
        dead = await eventually(lambda: _in_state(q, timed_out.id, JobState.DEAD), timeout=10)
        assert "timeout of 2s" in (dead.error or "")
        # What start-up made is frozen out of the collector's way in every worker process.
        frozen = await (await q.add("task", {"report_gc": True})).result(timeout=10)
        assert frozen["frozen"] > 0, frozen
        # --shutdown-grace 1: SIGTERM releases the other job after 1 s, not 30.
        loop = asyncio.get_running_loop()
        started = loop.time()
        proc.send(signal.SIGTERM)
        assert await proc.wait_exit(timeout=15) == 0, proc.log()
        assert 0.9 <= loop.time() - started < 10, proc.log()
        assert await q.job_state(released.id) is JobState.WAITING
    finally:
        proc.kill()
        await q.close()


def _start(argv: list[str], env: dict[str, str], log_path: Path) -> WorkerProc:
    with log_path.open("wb") as log:
        return WorkerProc(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log), log_path, "w")


async def _both(q: Queue) -> list[WorkerInfo] | None:
    workers = await q.workers()
    return workers if len(workers) == 2 else None


async def _active(q: Queue, n: int) -> bool:
    return len(await q.ids(JobState.ACTIVE)) == n


async def _in_state(q: Queue, job_id: str, state: JobState) -> object:
    record = await q.get_job(job_id)
    return record if record is not None and record.state is state else None


def test_worker_options_are_checked_before_anything_starts(redis_url: str) -> None:
    result = cli("worker", "tests.cli.test_cli:runner", "--redis", redis_url)
    assert result.exit_code == 2 and "not a sluice.Worker" in result.output
    result = cli("worker", "no_such_module_here:worker", "--redis", redis_url)
    assert result.exit_code == 2 and "cannot import 'no_such_module_here'" in result.output
    result = cli("worker", TARGET, "--lease", "0.05", "--redis", redis_url)
    assert result.exit_code == 2 and "the lease must be at least 0.1 seconds, got 0.05" in result.output
    result = cli("worker", TARGET, "--shutdown-grace", "-1", "--redis", redis_url)
    assert result.exit_code == 2 and "the shutdown grace must be more than 0 seconds" in result.output


async def test_a_sigterm_while_children_start_stops_every_one_of_them(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # Given a supervisor that starts many worker processes
    env = {**os.environ, "SLUICE_TEST_REDIS": redis_url, "SLUICE_TEST_PREFIX": prefix}
    where = ["--queue", "cliq", "--prefix", prefix, "--redis", redis_url]
    argv = [sys.executable, "-m", "sluice", "worker", TARGET, "--processes", "12", *where]
    proc = _start(argv, env, tmp_path / "worker.log")
    try:
        # When SIGTERM comes once the first few children exist, while others are still to start
        await eventually(lambda: _some_children(proc, 2), timeout=30, interval=0.005)
        proc.send(signal.SIGTERM)
        # Then the supervisor starts no more, every child stops, and it exits cleanly (it waits
        # for each child it started, so its exit means none is left behind)
        assert await proc.wait_exit(timeout=30) == 0, proc.log()
        assert not any(child.is_running() for child in proc.seen_children.values())
    finally:
        proc.kill()


async def _some_children(proc: WorkerProc, n: int) -> bool:
    return len(proc.children()) >= n


def test_hooks_that_do_nothing_around_an_attempt_are_left_out_of_it() -> None:
    from sluice import Hook
    from sluice.engine.hooks import FreezeAfterStartup, around_attempts

    class Before(Hook):
        def before_attempt(self, job: object) -> None: ...

    class After(Hook):
        def after_attempt(self, job: object, end: object, before: object) -> None: ...

    before, after = Before(), After()
    assert around_attempts([Hook(), FreezeAfterStartup(), before, after]) == (before, after)


def test_a_traced_worker_gets_one_attempt_spans_hook_around_its_own() -> None:
    # With tracing on, `sluice worker` adds the attempts' spans outermost, unless the code did.
    from sluice import Hook, Worker, tracing
    from sluice.cli.worker_cmd import _trace_attempts

    own = Hook()
    w = Worker("q", hooks=[own])
    _trace_attempts(w)
    _trace_attempts(w)
    assert [type(h) for h in w.hooks] == [tracing.AttemptSpans, Hook]
    mine = tracing.AttemptSpans()
    w = Worker("q", hooks=[own, mine])
    _trace_attempts(w)
    assert w.hooks == (own, mine)
