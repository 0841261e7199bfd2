"""``sluice worker``: run a Worker defined in your code, in one or more processes."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated

import structlog
import typer

from sluice import tracing
from sluice.cli.errors import CliFailure, debug_flag
from sluice.cli.options import CONNECTION, RedisOpt, at_least, checked_name
from sluice.cli.output import stderr
from sluice.cli.runtime import run
from sluice.cli.server import redis_url
from sluice.engine.hooks import FreezeAfterStartup
from sluice.engine.watchdog import EXIT_HARD_STOPPED
from sluice.engine.worker import Worker
from sluice.errors import ConfigurationError, MissingExtra
from sluice.extras import require
from sluice.settings import ENV_METRICS_PORT, ENV_REDIS_URL, Settings
from sluice.settings import ENV_WORKER_METRICS_DIR as ENV_HANDOFF

#: prometheus-client's multiprocess directory (service/multiproc.py).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

if TYPE_CHECKING:
    from sluice.service.worker_metrics import Collected, WorkerMetrics
SETTINGS = "Worker settings (default: as the Worker object in your code sets them)"


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
    except Exception as exc:
        # The user's module failed at import: say so, rather than "internal error".
        raise ConfigurationError(
            f"importing {module_name!r} raised {type(exc).__name__}: {exc} (--debug shows the traceback)"
        ) from exc
    if not hasattr(module, attr):
        raise ConfigurationError(
            f"module {module_name!r} has no {attr!r}; name the Worker, e.g. {module_name}:worker"
        )
    obj = getattr(module, attr)
    if not isinstance(obj, Worker):
        raise ConfigurationError(f"{target} is {type(obj).__name__}, not a sluice.Worker")
    return obj


def worker(
    ctx: typer.Context,
    target: Annotated[
        str, typer.Argument(help="Your Worker object, as package.module:attribute (e.g. app.tasks:worker).")
    ],
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency", "-c", min=1, help="Jobs at once per process.", rich_help_panel=SETTINGS
        ),
    ] = None,
    processes: Annotated[
        int, typer.Option("--processes", "-p", min=1, max=256, help="Worker processes to run.")
    ] = 1,
    lease: Annotated[
        float | None,
        typer.Option(
            callback=at_least(0.1, "the lease must be at least 0.1 seconds"),
            help="Seconds a job stays leased without renewal (renewed every third of it); a dead "
            "worker's jobs run again after it. At least 0.1.",
            rich_help_panel=SETTINGS,
        ),
    ] = None,
    shutdown_grace: Annotated[
        float | None,
        typer.Option(
            callback=at_least(0.001, "the shutdown grace must be more than 0 seconds"),
            help="Seconds running jobs get to finish after SIGTERM/Ctrl-C before they go back to waiting.",
            rich_help_panel=SETTINGS,
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            callback=at_least(0.001, "the timeout must be more than 0 seconds"),
            help="Seconds one attempt may run, for jobs that set none.",
            rich_help_panel=SETTINGS,
        ),
    ] = None,
    hard_grace: Annotated[
        float | None,
        typer.Option(
            callback=at_least(0.001, "the hard grace must be more than 0 seconds"),
            help="Seconds an attempt may go on past its timeout (blocking the event loop, ignoring "
            "its cancellation, or in a thread that does not return) before its process is ended; "
            "the job is retried, and --processes starts a new process.",
            rich_help_panel=SETTINGS,
        ),
    ] = None,
    worker_id: Annotated[
        str | None,
        typer.Option(
            help="Name of this worker (default host:pid:random; -1, -2... per process).",
            rich_help_panel=SETTINGS,
        ),
    ] = None,
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue",
            "-q",
            callback=checked_name("queue name"),
            help="Serve this queue instead of the Worker's.",
            rich_help_panel=CONNECTION,
        ),
    ] = None,
    prefix: Annotated[
        str | None,
        typer.Option(
            callback=checked_name("key prefix"),
            help="Key prefix of the queue, instead of the Worker's.",
            rich_help_panel=CONNECTION,
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            envvar=ENV_METRICS_PORT,
            show_envvar=False,
            help="Serve this process's metrics (all processes' with --processes N, added up) "
            f"for Prometheus on 0.0.0.0:PORT. Off by default; also {ENV_METRICS_PORT}.",
        ),
    ] = None,
    redis: RedisOpt = None,
) -> None:
    """Run a Worker: take jobs, run their handlers, report outcomes.

    SIGTERM or Ctrl-C stops taking jobs and lets running ones finish within the
    shutdown grace; a second signal releases them back to waiting at once.
    With --processes N, this process supervises N worker processes, passes
    signals on to them, and starts a new one in place of any that its watchdog
    ended (exit code 75: a handler overran its timeout by the hard grace).
    """
    # Stopped before it serves: nothing runs yet, so that is a clean stop (exit 0), which is
    # what a service manager stopping a unit that is still starting should see.
    signal.signal(signal.SIGTERM, _stopped_before_start)
    # Before the Worker's module is imported: prometheus-client picks its mode when first
    # imported (by that module too, if it uses it), from PROMETHEUS_MULTIPROC_DIR.
    handoff = _metrics_mode(metrics_port, processes)
    try:
        w = load_worker(target)
    except ConfigurationError as exc:
        raise typer.BadParameter(str(exc), param_hint="TARGET") from exc
    settings = {
        "--concurrency": concurrency,
        "--lease": lease,
        "--shutdown-grace": shutdown_grace,
        "--timeout": timeout,
        "--hard-grace": hard_grace,
        "--queue": queue,
        "--prefix": prefix,
    }
    # Checked here, in the supervisor too, so that a bad value fails once, not in every child.
    w.configure(
        queue=queue,
        prefix=prefix,
        concurrency=concurrency,
        lease=lease,
        shutdown_grace=shutdown_grace,
        timeout=timeout,
        hard_grace=hard_grace,
    )
    with redis_url(redis, stderr()) as url:
        if processes > 1:
            code = _supervise(target, processes, url, settings, worker_id, debug_flag(ctx), metrics_port)
            raise typer.Exit(code)
        if worker_id is not None:
            w.configure(worker_id=worker_id)
        if metrics_port is not None or handoff is not None:
            _count_attempts(w, _metrics(metrics_port, handoff))
        # Each worker process exports its own spans (a supervisor makes none).
        if tracing.configure(Settings.from_env()):
            _trace_attempts(w)
        # This process is the worker's: what its start-up made stays out of the collector's way.
        w.add_hook(FreezeAfterStartup())
        structlog.get_logger("sluice.cli").info(
            "worker process",
            pid=os.getpid(),
            target=target,
            queue=w.queue_name,
            prefix=w.prefix,
            worker_id=w.worker_id,
        )
        run(w.run(url))


def _trace_attempts(w: Worker) -> None:
    """Give the worker its attempts' spans, around its other hooks (unless its code did)."""
    if not any(isinstance(hook, tracing.AttemptSpans) for hook in w.hooks):
        w.add_hook(tracing.AttemptSpans(), outermost=True)


def _metrics_mode(port: int | None, processes: int) -> str | None:
    """Choose prometheus-client's mode for this process, and check that it is installed;
    returns the directory a supervisor or ``sluice dev`` handed over (None: none)."""
    handoff = os.environ.get(ENV_HANDOFF) or None
    if port is None and handoff is None:
        return None
    if handoff is not None and processes == 1:
        os.environ[MULTIPROC_ENV] = handoff  # a child: its values go to the shared folder
    else:
        os.environ.pop(MULTIPROC_ENV, None)  # a supervisor, or one process: in memory
    try:
        require("service", "--metrics-port", "prometheus_client")
    except MissingExtra as exc:
        raise CliFailure(str(exc)) from None
    return handoff


def _metrics(port: int | None, handoff: str | None) -> WorkerMetrics:
    """Count this process's metrics: into the directory a supervisor or ``sluice dev``
    handed over, else in memory, served on ``port``; the hook that counts the attempts."""
    from sluice.service.worker_metrics import enable

    try:
        hook = enable(port, handoff)
    except OSError as exc:
        raise CliFailure(
            f"cannot serve metrics on port {port} ({exc.strerror or exc}); pick another --metrics-port"
        ) from None
    if port is not None and handoff is None:
        structlog.get_logger("sluice.cli").info(f"metrics on http://0.0.0.0:{port}/metrics", port=port)
    return hook


def _count_attempts(w: Worker, hook: WorkerMetrics) -> None:
    """Give the worker the metrics hook (unless its code added one: each would count)."""
    from sluice.service.worker_metrics import WorkerMetrics

    if not any(isinstance(h, WorkerMetrics) for h in w.hooks):
        w.add_hook(hook)


def _supervise(
    target: str,
    processes: int,
    url: str,
    settings: Mapping[str, object],
    worker_id: str | None,
    debug: bool,
    metrics_port: int | None = None,
) -> int:
    """Start N single-process workers with the same settings and pass signals on to them."""
    argv = [sys.executable, "-m", "sluice", *(["--debug"] if debug else []), "worker", target]
    for option, value in settings.items():
        if value is not None:
            argv += [option, str(value)]
    # The URL goes in the environment, not on the command line, where `ps` would show its password.
    env = {**os.environ, ENV_REDIS_URL: url}
    metrics = None
    if metrics_port is not None:
        from sluice.service.worker_metrics import Collected

        metrics = Collected(metrics_port)
        try:
            metrics.start()
        except OSError as exc:
            raise CliFailure(
                f"cannot serve metrics on port {metrics_port} ({exc.strerror or exc}); "
                "pick another --metrics-port"
            ) from None
        env[ENV_HANDOFF] = metrics.path
        env[MULTIPROC_ENV] = metrics.path
        env.pop(ENV_METRICS_PORT, None)  # the children write files; only this process serves
        structlog.get_logger("sluice.cli").info(
            f"metrics of {processes} worker processes on http://0.0.0.0:{metrics_port}/metrics",
            port=metrics_port,
        )
    try:
        supervisor = _Supervisor(argv, env, worker_id, metrics)
        # Before the first child starts: a signal in between must reach the children, not end us.
        signal.signal(signal.SIGTERM, supervisor.forward)
        signal.signal(signal.SIGINT, supervisor.forward)
        for slot in range(processes):
            if supervisor.forwarded:
                break  # told to stop while starting: start no more
            supervisor.start(slot)
        return supervisor.wait()
    finally:
        if metrics is not None:
            metrics.close()


class _Supervisor:
    """The worker processes of ``sluice worker --processes N``, one per slot.

    A child that its watchdog ended (exit code 75: a handler overran its
    timeout by the hard grace, and nothing short of that could stop it) is
    replaced at once unless a stop was asked for: the overrunning job was
    reported and the child's other jobs released before it exited, so the new
    process can take them. A child that exits otherwise is not replaced (a
    crash at start would crash again): it is logged, and the others go on.
    """

    def __init__(
        self, argv: list[str], env: dict[str, str], worker_id: str | None, metrics: Collected | None = None
    ) -> None:
        self.argv = argv
        self.env = env
        self.worker_id = worker_id
        #: the children's metrics directory and its server (--metrics-port), or None
        self.metrics = metrics
        #: the current process of each slot (slot i runs worker id <worker_id>-<i + 1>)
        self.children: list[subprocess.Popen[bytes]] = []
        #: every signal passed on, in order; and how many of them each child has been sent
        self.forwarded: list[int] = []
        self.sent: dict[int, int] = {}
        #: exit code of each slot whose last process ended and was not replaced
        self.codes: dict[int, int] = {}
        self.log = structlog.get_logger("sluice.cli")

    def start(self, slot: int) -> subprocess.Popen[bytes]:
        argv = [*self.argv]
        if self.worker_id is not None:
            argv += ["--worker-id", f"{self.worker_id}-{slot + 1}"]
        # A session of their own: a Ctrl-C reaches them once, through forward(), not twice.
        child = subprocess.Popen(argv, env=self.env, start_new_session=True)  # noqa: S603 - our own CLI
        if slot < len(self.children):
            self.children[slot] = child
        else:
            self.children.append(child)
        self.catch_up(child)  # a signal that came while it was being started, exactly once
        return child

    def catch_up(self, child: subprocess.Popen[bytes]) -> None:
        for signum in self.forwarded[self.sent.get(child.pid, 0) :]:
            if child.poll() is None:
                child.send_signal(signum)
        self.sent[child.pid] = len(self.forwarded)

    def forward(self, signum: int, _frame: object) -> None:
        self.forwarded.append(signum)
        for child in self.children:
            self.catch_up(child)

    def wait(self) -> int:
        """Wait for every slot to end (replacing children stopped hard); the exit code."""
        while len(self.codes) < len(self.children):
            time.sleep(0.1)
            for slot, child in enumerate(self.children):
                code = None if slot in self.codes else child.poll()
                if code is not None:
                    self._ended(slot, child, code)
        # A child that the signal we passed on ended while it was still starting (killed by it,
        # or exiting 128 + its number) stopped as asked; any other signal or code is a failure.
        stopped = {-s for s in self.forwarded} | {128 + s for s in self.forwarded}
        codes = self.codes.values()
        return max((0 if code in stopped else 128 - code if code < 0 else code for code in codes), default=0)

    def _ended(self, slot: int, child: subprocess.Popen[bytes], code: int) -> None:
        if self.metrics is not None:
            self.metrics.ended(child.pid)
        if code == EXIT_HARD_STOPPED and not self.forwarded:
            new = self.start(slot)
            self.log.warning(
                f"worker process {child.pid} was ended by its watchdog (a handler overran its "
                f"timeout by the hard grace); process {new.pid} takes its place",
                pid=child.pid,
                exit_code=code,
                new_pid=new.pid,
            )
            return
        self.codes[slot] = code
        if code != 0 and not self.forwarded:
            self.log.error(
                f"worker process {child.pid} exited with code {code}; it is not replaced, and the "
                f"other {len(self.children) - len(self.codes)} go on",
                pid=child.pid,
                exit_code=code,
            )


def _stopped_before_start(signum: int, _frame: object) -> None:
    raise SystemExit(0)
