"""docs/using.md runs as written: its library snippet, its systemd unit and its Dockerfile.

The unit and the Dockerfile cannot be given to systemd or Docker here, so the
test does what they would: it reads the unit's ExecStart, Environment and
stop settings (and the Dockerfile's CMD, ENV and STOPSIGNAL), starts that very
command line against a test Redis with an application module like the one
the page assumes, and stops it the way systemd (KillMode=mixed: the signal
to the main process only) and Docker (to PID 1) do. The workers must finish
the job they are running and exit 0 within the stop timeout.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import io
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import psutil
import pytest
from redis.asyncio import Redis

from sluice import JobContext, JobState, Queue, Worker, current_job
from sluice.testing import running_worker
from tests.cli.test_cli import invoke
from tests.conftest import eventually
from tests.harness.proc_harness import REPO

DOC = REPO / "docs" / "using.md"

APP = textwrap.dedent(
    """
    import asyncio

    from sluice import JobContext, Worker

    worker = Worker("default")


    @worker.handler
    async def summarize(job: JobContext) -> dict[str, str]:
        await asyncio.sleep(job.payload.get("seconds", 0))
        return {"summary": job.payload["text"][:10]}
    """
)


def block(tag: str) -> str:
    """The fenced code block that follows ``<!-- test: tag -->`` in docs/using.md."""
    match = re.search(rf"<!-- test: {tag} -->\n```[a-z]*\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/using.md has no block tagged {tag}"
    return match.group(1)


def python_block() -> str:
    match = re.search(r"## The library in your code\n.*?```python\n(.*?)```", DOC.read_text(), re.S)
    assert match
    return match.group(1)


async def test_the_retention_examples(redis_url: str, redis: Redis, prefix: str) -> None:
    where = ["--prefix", prefix, "--redis", redis_url]
    for line in block("retention-cli").strip().splitlines():
        command = shlex.split(line)
        assert command[0] == "sluice", line
        await invoke(*command[1:], *where)
    queue = Queue("llm", redis=redis, prefix=prefix)
    kept = await queue.retention()
    assert (kept["completed"].age, kept["completed"].count) == (6 * 3600, 200_000)
    namespace: dict[str, object] = {"Queue": Queue}
    exec(compile(block("retention-python"), "docs/using.md", "exec"), namespace)  # noqa: S102
    other = Queue("llm2", redis=redis, prefix=prefix)
    await namespace["keep_results_for_six_hours"](other)  # type: ignore[operator]
    kept = await other.retention()
    assert (kept["completed"].age, kept["completed"].count, kept["dead"].age) == (6 * 3600, 200_000, None)


async def test_the_provider_limits_examples(redis_url: str, redis: Redis, prefix: str) -> None:
    expected = [
        ("requests", 500, 60.0, True),
        ("requests", 10_000, 86_400.0, False),
        ("tokens", 30_000, 60.0, True),
        ("tokens", 1_000_000, 86_400.0, False),
    ]
    namespace: dict[str, object] = {"Queue": Queue}
    exec(compile(block("provider-limits"), "docs/using.md", "exec"), namespace)  # noqa: S102
    queue = Queue("llm", redis=redis, prefix=prefix)
    await namespace["use_the_providers_limits"](queue)  # type: ignore[operator]
    flow = await queue.flow()
    assert [(w.kind, w.limit, w.per_seconds, w.paced) for w in flow.windows] == expected
    await queue.set_limits(requests={}, tokens={})
    command = shlex.split(block("provider-limits-cli"))
    assert command[0] == "sluice"
    await invoke(*command[1:], "--prefix", prefix, "--redis", redis_url)
    flow = await queue.flow()
    assert [(w.kind, w.limit, w.per_seconds, w.paced) for w in flow.windows] == expected


async def test_the_job_log_filter_example(redis_url: str, redis: Redis, prefix: str) -> None:
    """The doc's handler set-up, then a job that logs (from a sync handler's thread too)."""
    app_log = logging.getLogger("app")
    app_log.setLevel(logging.INFO)
    before = list(app_log.handlers)
    exec(compile(block("job-log-filter"), "docs/using.md", "exec"), {})  # noqa: S102
    (handler,) = [h for h in app_log.handlers if h not in before]
    stream = io.StringIO()
    handler.setStream(stream)  # type: ignore[attr-defined]
    seen: list[str | None] = []
    worker = Worker("logged", prefix=prefix)

    @worker.handler(name="async")
    async def in_loop(job: JobContext) -> None:
        app_log.info("working")
        seen.append(getattr(current_job(), "correlation_id", None))

    @worker.handler(name="sync")
    def in_thread(job: JobContext) -> None:
        app_log.info("working in a thread")

    try:
        async with Queue("logged", redis=redis, prefix=prefix) as queue, running_worker(worker, redis_url):
            a = await queue.add("async", correlation_id="req-42")
            b = await queue.add("sync")
            await a.result(timeout=10)
            await b.result(timeout=10)
        app_log.info("outside any job")
    finally:
        app_log.removeHandler(handler)
    assert stream.getvalue().splitlines() == [
        f"INFO job={a.id} request=req-42 working",
        f"INFO job={b.id} request=- working in a thread",
        "INFO job=- request=- outside any job",
    ]
    assert seen == ["req-42"] and current_job() is None


async def test_the_worker_hooks_example(redis: Redis, prefix: str) -> None:
    namespace: dict[str, object] = {}
    exec(compile(block("worker-hooks"), "docs/using.md", "exec"), namespace)  # noqa: S102 - the doc's code
    worker = namespace["worker"]
    assert isinstance(worker, Worker)
    worker.configure(prefix=prefix)
    # The client lives as long as the worker runs, in its state, and is closed after
    queue = Queue(worker.queue_name, redis=redis, prefix=prefix)
    async with running_worker(worker, redis):
        # Stopped once it serves (its heartbeat is written), not while its connections open.
        await eventually(queue.workers, timeout=10, interval=0.02)
        client = worker.state["http"]
        assert not client.is_closed
    assert "http" not in worker.state
    assert client.is_closed


async def test_the_library_snippet(
    redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    namespace: dict[str, object] = {}
    exec(compile(python_block(), "docs/using.md", "exec"), namespace)  # noqa: S102 - the doc's own code
    monkeypatch.setenv("SLUICE_REDIS_URL", redis_url)
    enqueue = namespace["enqueue_summary"]
    job_id = await enqueue("a long text")  # type: ignore[operator]
    again = await enqueue("a long text")  # type: ignore[operator]
    assert job_id == again  # the idempotency key held
    queue = Queue("llm", redis=redis)
    assert await queue.job_state(job_id) is JobState.WAITING
    await queue.redis.delete(*[k async for k in redis.scan_iter(match=queue.keys.base + "*")])


def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "tasks.py").write_text(APP)
    return tmp_path


def sluice_command(argv: list[str]) -> list[str]:
    """The doc's command with `sluice` (a path or on PATH) replaced by this interpreter's."""
    assert Path(argv[0]).name == "sluice", argv
    return [sys.executable, "-m", "sluice", *argv[1:]]


async def run_like_a_service_manager(
    argv: list[str],
    env: dict[str, str],
    cwd: Path,
    stop_signal: signal.Signals,
    stop_timeout: float,
    redis: Redis,
) -> None:
    """Start the workers, give them a job that takes 1.5 s, stop them while it runs."""
    # Their logs go to a file, not a pipe: a pipe nobody reads until the end fills up on a
    # busy machine (every process logs there), and a worker blocked writing never exits.
    log = (cwd / "workers.log").open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - a service manager's child, waited for below
        sluice_command(argv), cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log
    )
    children: list[psutil.Process] = []
    queue = Queue("default", redis=redis)
    try:
        job = await queue.add("summarize", {"text": "hello there, workers", "seconds": 1.5})
        deadline = time.monotonic() + 30
        while await queue.job_state(job.id) is not JobState.ACTIVE:
            assert proc.poll() is None, (cwd / "workers.log").read_text()
            assert time.monotonic() < deadline, "the job never started"
            await asyncio.sleep(0.05)
        children = psutil.Process(proc.pid).children(recursive=True)
        # When the service manager stops the unit: its stop signal, to the main process only
        t0 = time.monotonic()
        proc.send_signal(stop_signal)
        code = await asyncio.to_thread(proc.wait, stop_timeout)
        # Then every process ends cleanly within the stop timeout, and the running job completed
        stderr = (cwd / "workers.log").read_text()
        assert code == 0, stderr
        assert time.monotonic() - t0 < stop_timeout
        assert await job.result(timeout=1) == {"summary": "hello ther"}
        assert (await queue.counts())["released"] == 0, "a second signal reached the workers"
    finally:
        # A failed stop must not leave workers behind (they run in sessions of their own,
        # as a service manager's cgroup would hold them) to take later tests' jobs.
        for process in [psutil.Process(proc.pid), *children] if proc.poll() is None else children:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        if proc.poll() is None:
            proc.wait(5)
        log.close()
        await queue.close()


def _seconds(value: str) -> float:
    return float(value.removesuffix("s"))


@pytest.mark.slow
async def test_the_systemd_unit(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(block("systemd"))
    service = unit["Service"]
    assert service["KillMode"] == "mixed", "SIGTERM must reach the supervisor only: it passes it on once"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLUICE_REDIS_URL": redis_url}
    for line in block("systemd").splitlines():
        if line.startswith("Environment="):
            key, _, value = line.removeprefix("Environment=").partition("=")
            env[key] = value
    await run_like_a_service_manager(
        shlex.split(service["ExecStart"]),
        env,
        app_dir(tmp_path),
        signal.Signals[service["KillSignal"]],
        _seconds(service["TimeoutStopSec"]),
        redis,
    )


@pytest.mark.slow
async def test_the_dockerfile(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    lines = block("dockerfile").splitlines()
    cmd = json.loads(next(line.removeprefix("CMD ") for line in lines if line.startswith("CMD ")))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLUICE_REDIS_URL": redis_url}
    for line in lines:
        if line.startswith("ENV "):
            key, _, value = line.removeprefix("ENV ").partition("=")
            env[key] = value
    stop = next(line.split()[1] for line in lines if line.startswith("STOPSIGNAL"))
    # What it installs is this project, by its distribution name, with extras that exist
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    installs = re.findall(
        rf"pip install [^&\n]*?\b{re.escape(project['name'])}(\[[a-z,]+\])?", block("dockerfile")
    )
    assert installs, "the Dockerfile does not pip install " + project["name"]
    for extras in installs:
        assert set(extras.strip("[]").split(",")) - {""} <= set(project["optional-dependencies"])
    # The page's `docker run --stop-timeout 40`
    timeout = float(re.search(r"--stop-timeout (\d+)", DOC.read_text()).group(1))  # type: ignore[union-attr]
    await run_like_a_service_manager(cmd, env, app_dir(tmp_path), signal.Signals[stop], timeout, redis)


def test_the_dashboard_mounts_in_an_app_of_your_own() -> None:
    """The mount snippet runs as written, and the page it serves points at that API."""
    from starlette.testclient import TestClient

    namespace: dict[str, object] = {}
    exec(compile(block("dashboard-mount"), "docs/using.md", "exec"), namespace)  # noqa: S102
    with TestClient(namespace["app"]) as client:  # type: ignore[arg-type]
        page = client.get("/sluice/")
        assert page.status_code == 200
        assert '<meta name="sluice-api" content="https://jobs.example.com">' in page.text
        assert '<meta name="sluice-auth" content="required">' in page.text
        assert "connect-src 'self' https://jobs.example.com;" in page.headers["content-security-policy"]
        assert client.get("/sluice/static/app.js").status_code == 200
