"""``sluice worker``: run a Worker defined in your code, in one or more processes."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from typing import Annotated

import structlog
import typer
from rich.console import Console

from sluice.cli.runtime import run
from sluice.cli.server import ENV_URL, redis_url
from sluice.engine.worker import Worker
from sluice.errors import ConfigurationError

console = Console(stderr=True)


def load_worker(target: str) -> Worker:
    """Import ``module:attribute`` and check that it is a Worker."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"worker target {target!r} must look like 'package.module:worker'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import {module_name!r} ({exc}); run from your project folder or install it"
        ) from exc
    obj = getattr(module, attr, None)
    if not isinstance(obj, Worker):
        raise ConfigurationError(f"{target} is {type(obj).__name__}, not a sluice.Worker")
    return obj


def worker(
    target: Annotated[str, typer.Argument(help="Your Worker object, as package.module:attribute.")],
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", "-c", min=1, help="Jobs at once per process.")
    ] = None,
    processes: Annotated[int, typer.Option("--processes", "-p", min=1, help="Worker processes.")] = 1,
    queue: Annotated[str | None, typer.Option(help="Serve this queue instead of the Worker's.")] = None,
    worker_id: Annotated[str | None, typer.Option(help="Name of this worker (default host:pid).")] = None,
    redis: Annotated[str | None, typer.Option(help=f"Redis URL (default ${ENV_URL}, else embedded).")] = None,
) -> None:
    """Run a Worker: take jobs, run their handlers, report outcomes.

    SIGTERM or Ctrl-C stops taking jobs and lets running ones finish within the
    worker's shutdown_grace; a second signal releases them back to waiting.
    """
    try:
        w = load_worker(target)
    except ConfigurationError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    if concurrency is not None:
        w.concurrency = concurrency
    if queue is not None:
        w.queue_name = queue
    with redis_url(redis, console) as url:
        if processes == 1:
            if worker_id is not None:
                w.worker_id = worker_id
            structlog.get_logger("sluice.cli").info("worker process", pid=os.getpid(), target=target)
            run(w.run(url))
            return
        raise typer.Exit(_supervise(target, processes, url, concurrency, queue, worker_id))


def _supervise(
    target: str, processes: int, url: str, concurrency: int | None, queue: str | None, worker_id: str | None
) -> int:
    """Start N single-process workers and pass signals on to them."""
    children: list[subprocess.Popen[bytes]] = []
    for i in range(processes):
        argv = [sys.executable, "-m", "sluice", "worker", target, "--processes", "1", "--redis", url]
        if concurrency is not None:
            argv += ["--concurrency", str(concurrency)]
        if queue is not None:
            argv += ["--queue", queue]
        if worker_id is not None:
            argv += ["--worker-id", f"{worker_id}-{i + 1}"]
        # A session of their own: a Ctrl-C reaches them once, through forward(), not twice.
        children.append(subprocess.Popen(argv, start_new_session=True))  # noqa: S603 - our own CLI

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    return max(codes, default=0)
