"""Helpers for tests with real worker processes, and with workers in the test's loop.

:class:`WorkerProcs` starts ``sluice worker`` processes, signals them, and
always cleans them up. Each process runs ``tests.harness.proc_workers:worker`` (see
that module) against the test's Redis and key prefix, with its stdout and
stderr in a log file. The logs are printed when the harness closes, so pytest
shows them for a failed test. Closing kills (SIGCONT, then SIGKILL) every
process started here that is still alive, and every child of theirs that was
ever seen, by pid.

:func:`start_in_loop`, :func:`stop_in_loop` and :func:`serving` run a Worker in
the test's own event loop, with a bounded stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from types import TracebackType

import psutil
from redis.asyncio import Redis

from sluice import Worker
from sluice.engine.connection import connect
from tests.harness.proc_workers import runs_key

REPO = Path(__file__).resolve().parents[2]
TARGET = "tests.harness.proc_workers:worker"
#: Names of the tasks a running Worker keeps beside its handlers.
HELPER_TASKS = frozenset({"sluice-waker", "sluice-renewer", "sluice-reaper"})
STOP_TIMEOUT = 10.0


async def runs(redis: Redis, prefix: str, job_id: str) -> list[str]:
    """Who started which attempt of a job, in order ("<worker id>:<attempt>")."""
    raw = await redis.lrange(runs_key(prefix, job_id), 0, -1)
    return [r.decode() if isinstance(r, bytes) else r for r in raw]


async def open_gate(gate: Path) -> None:
    """Let jobs waiting on the gate file ``gate`` finish."""
    await asyncio.to_thread(gate.touch)


def helper_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() in HELPER_TASKS and not t.done()]


async def cancel_until_done(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel tasks again and again until they end (a single cancel can be lost)."""
    for task in tasks:
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)


def start_in_loop(worker: Worker, redis_url: str) -> tuple[asyncio.Task[None], Redis]:
    """Run ``worker`` in this event loop on a client of its own; see :func:`stop_in_loop`."""
    client = connect(redis_url)
    return asyncio.create_task(worker.run(client, handle_signals=False)), client


async def stop_in_loop(
    worker: Worker, task: asyncio.Task[None], client: Redis, strict: frozenset[str] = frozenset()
) -> None:
    """Stop a worker started by :func:`start_in_loop` and clean up after it.

    Fails if ``run()`` has not returned STOP_TIMEOUT seconds after ``stop()``,
    or if a helper task named in ``strict`` outlives it. Any helper that does
    is cancelled, and the client closed, so that nothing leaks into later tests.
    """
    worker.stop()
    done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT)
    leftovers = sorted(t.get_name() for t in helper_tasks() if t.get_name() in strict)
    await cancel_until_done([task, *helper_tasks()])
    await client.aclose()
    assert done, f"{worker.worker_id}: run() still going {STOP_TIMEOUT}s after stop()"
    assert not leftovers, f"{worker.worker_id}: run() returned but left {leftovers} running"
    task.result()


@contextlib.asynccontextmanager
async def serving(worker: Worker, redis_url: str) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``worker`` in this event loop for the block, then stop it.

    Unlike conftest's ``running`` (whose ``wait_for`` can return normally after
    timing out), a stop that does not end ``run()`` within STOP_TIMEOUT seconds
    fails the test. Helpers that outlive ``run()`` are only cleaned up here;
    test_shutdown.py checks for them on purpose.
    """
    task, client = start_in_loop(worker, redis_url)
    try:
        yield task
    finally:
        await stop_in_loop(worker, task, client)


class WorkerProc:
    """One ``sluice worker`` process (the supervisor, with ``--processes`` > 1)."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path, worker_id: str) -> None:
        self.popen = popen
        self.log_path = log_path
        self.worker_id = worker_id
        self.seen_children: dict[int, psutil.Process] = {}

    @property
    def pid(self) -> int:
        return self.popen.pid

    def send(self, sig: signal.Signals) -> None:
        self.popen.send_signal(sig)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[psutil.Process]:
        """The live child processes now (and remember them, to kill them at the end)."""
        try:
            found = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for child in found:
            self.seen_children.setdefault(child.pid, child)
        return found

    async def wait_log(self, text: str, count: int = 1, timeout: float = 15.0) -> None:
        """Wait until ``text`` appears ``count`` times in the log."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.log().count(text) < count:
            if loop.time() > deadline:
                raise AssertionError(f"{text!r} not logged {count} times in {timeout}s:\n{self.log()}")
            await asyncio.sleep(0.02)

    async def wait_exit(self, timeout: float = 15.0) -> int:
        """Wait for the process to exit and return its exit code."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (code := self.popen.poll()) is None:
            if loop.time() > deadline:
                raise AssertionError(f"worker {self.worker_id} still running after {timeout}s:\n{self.log()}")
            await asyncio.sleep(0.02)
        return code

    def kill(self) -> None:
        procs = [*self.children(), *self.seen_children.values()]
        if self.popen.poll() is None:
            procs.append(psutil.Process(self.pid))
        for proc in procs:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(sig)
        self.popen.wait(timeout=10)
        psutil.wait_procs([p for p in procs if p.pid != self.pid], timeout=10)


class WorkerProcs:
    """Starts worker processes for one test; a context manager that cleans them up."""

    def __init__(self, redis_url: str, prefix: str, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.log_dir = log_dir
        self.procs: list[WorkerProc] = []

    def start(
        self,
        worker_id: str,
        *,
        lease: float = 1.0,
        grace: float = 30.0,
        reap_interval: float = 0.2,
        concurrency: int = 1,
        processes: int = 1,
    ) -> WorkerProc:
        env = {
            "SLUICE_TEST_LEASE": str(lease),
            "SLUICE_TEST_GRACE": str(grace),
            "SLUICE_TEST_REAP": str(reap_interval),
        }
        options = ["--concurrency", str(concurrency), "--processes", str(processes)]
        return self.launch(worker_id, TARGET, *options, env=env)

    def launch(
        self, worker_id: str, target: str, *options: str, env: dict[str, str] | None = None
    ) -> WorkerProc:
        """``sluice worker TARGET`` on queue "q" as ``worker_id``, with the test's Redis and
        prefix in its environment (``SLUICE_TEST_REDIS``, ``SLUICE_TEST_PREFIX``) and ``env``."""
        full_env = {
            **os.environ,
            "SLUICE_TEST_REDIS": self.redis_url,
            "SLUICE_TEST_PREFIX": self.prefix,
            "SLUICE_LOG_LEVEL": "info",
            **(env or {}),
        }
        argv = [sys.executable, "-m", "sluice", "worker", target, "--redis", self.redis_url]
        argv += ["--queue", "q", "--worker-id", worker_id, *options]
        log_path = self.log_dir / f"worker-{worker_id}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(argv, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        proc = WorkerProc(popen, log_path, worker_id)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            print(f"----- log of worker {proc.worker_id} (pid {proc.pid}, exit {proc.popen.returncode})")
            print(proc.log())

    def __enter__(self) -> WorkerProcs:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
