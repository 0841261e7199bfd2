"""``sluice dev``: the whole service on one machine, in one command.

Redis and PostgreSQL are the folder's embedded servers unless
``SLUICE_REDIS_URL`` / ``SLUICE_DATABASE_URL`` name others; their data stays
in ``$SLUICE_HOME`` (``./.sluice``), so a second ``sluice dev`` finds its
jobs again. The API runs in this process without authentication (it says so
on start), beside worker processes for the built-in job types. Ctrl-C stops
the workers (they finish or hand back what they run), then the API, then the
servers this command started.

The API and the workers share one prometheus-client multiprocess directory (a
fresh one, removed at exit), so the API's ``GET /metrics`` shows the workers'
series too: one address to scrape, no port per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.markup import escape

from sluice import tracing
from sluice.cli.errors import CliFailure
from sluice.cli.output import stderr, stdout
from sluice.cli.serve_cmd import STOP_GRACE_SECONDS
from sluice.cli.server import command_label, redis_url
from sluice.engine.connection import redact
from sluice.settings import (
    ENV_DATABASE_URL,
    ENV_METRICS_PORT,
    ENV_REDIS_URL,
    ENV_WORKER_METRICS_DIR,
    Settings,
)

WORKER_TARGET = "sluice.service.handlers:worker"
#: prometheus-client's multiprocess directory (service/multiproc.py).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def database_url() -> Iterator[str]:
    """SLUICE_DATABASE_URL, or the folder's shared PostgreSQL (started if none runs)."""
    url = os.environ.get(ENV_DATABASE_URL)
    if url:
        yield url
        return
    try:
        from sluice.local.shared_postgres import SharedPostgres
    except ImportError as exc:
        raise CliFailure(
            f"the embedded PostgreSQL needs the 'service' extra ({exc.name} is missing): "
            f"pip install 'sluice-queue[service]', or set {ENV_DATABASE_URL}"
        ) from None
    settings = Settings.from_env()
    shared = SharedPostgres(settings.home, label=command_label())
    with shared as found:
        if shared.started:
            stderr().print(f"started the embedded PostgreSQL in {settings.home}/postgres", style="dim")
        yield found


def _workers(
    url: str, database: str, processes: int, queue: str, metrics_dir: str
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env[ENV_REDIS_URL] = url
    env[ENV_WORKER_METRICS_DIR] = metrics_dir  # their series in the API's GET /metrics
    env.pop(ENV_METRICS_PORT, None)  # (a port of their own would take the series from there)
    env[ENV_DATABASE_URL] = database  # llm-inference's semantic cache lives in the store
    argv = [sys.executable, "-m", "sluice", "worker", WORKER_TARGET, "--processes", str(processes)]
    if queue != "jobs":
        raise CliFailure("sluice dev runs the built-in worker on the queue 'jobs'")
    return subprocess.Popen(argv, env=env, start_new_session=True)  # noqa: S603 - our own command


def _stop(proc: subprocess.Popen[bytes], timeout: float = 40.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def dev(
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the API on 127.0.0.1.")] = 8000,
    workers: Annotated[
        int,
        typer.Option("--workers", "-w", min=0, max=64, help="Worker processes for the built-in job types."),
    ] = 2,
) -> None:
    """Run the service locally: embedded Redis and PostgreSQL, the API on 127.0.0.1, and workers.

    No authentication: every caller is the default tenant's admin. Do not
    expose this port; `sluice serve` is for anything else. Built-in job types:
    generic, email (send_email), llm-inference (the provider SLUICE_LLM_PROVIDER names,
    else an offline stand-in model; with the semantic cache). Ctrl-C stops it all.

    GET /metrics with Accept: text/plain shows the API's and the workers' Prometheus series.
    """
    # One metrics directory for the API (this process) and the workers: GET /metrics shows
    # both. Set before prometheus-client is first imported (with the app), which reads it then.
    metrics_dir = tempfile.mkdtemp(prefix="sluice-dev-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    try:
        _dev(port, workers, metrics_dir)
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _dev(port: int, workers: int, metrics_dir: str) -> None:
    try:
        import uvicorn

        from sluice.service.app import create_app
        from sluice.service.config import ServiceSettings
    except ImportError as exc:
        raise CliFailure(
            f"sluice dev needs the 'service' extra ({exc.name} is missing): "
            "pip install 'sluice-queue[service]'"
        ) from None
    out = stdout()
    with redis_url(None, stderr()) as rurl, database_url() as durl:
        options: dict[str, object] = {"redis_url": rurl, "database_url": durl}
        settings = ServiceSettings(**options)  # type: ignore[arg-type]
        tracing.configure(Settings.from_env())  # the workers (sluice worker) read it too
        app = create_app(settings, auth=False)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=STOP_GRACE_SECONDS,
        )
        server = uvicorn.Server(config)
        base = f"http://127.0.0.1:{port}"
        stderr().print(
            "[bold red]sluice dev: NO AUTHENTICATION[/] - every request is the default tenant's admin; "
            "listening on 127.0.0.1 only. Use `sluice serve` with API keys anywhere else."
        )
        body = '{"type": "generic", "payload": {"hello": "world"}}'
        curl = f"curl -s -X POST {base}/jobs -H 'content-type: application/json' -d {shlex.quote(body)}"
        for label, value in (
            ("API", f"{base}  (docs {base}/docs, OpenAPI {base}/openapi.json)"),
            ("dashboard", f"{base}/dashboard/"),
            ("metrics", f"{base}/metrics  (Accept: text/plain; the API's and the workers' series)"),
            ("Redis", redact(rurl)),
            ("Postgres", _redact_db(durl)),
            ("try", curl),
        ):
            out.print(escape(f"{label + ':':<11}{value}"), soft_wrap=True)
        proc = _workers(rurl, durl, workers, settings.queue, metrics_dir) if workers else None
        try:
            # uvicorn handles Ctrl-C (a graceful stop), then raises it again: that is our exit.
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(server.serve())
        finally:
            if proc is not None:
                _stop(proc)
        stderr().print("sluice dev stopped: the API, the workers and the servers it started", style="dim")
        if not server.started:
            raise CliFailure(
                f"the API could not start on 127.0.0.1:{port} (in use?); pick another with --port"
            )


def _redact_db(url: str) -> str:
    from sluice.store.database import redact_url

    return redact_url(url)
