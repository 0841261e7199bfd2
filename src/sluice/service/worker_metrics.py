"""A worker process's own metrics: ``sluice worker --metrics-port PORT``.

What one process did: busy slots and handler durations, counted by a worker hook
(:class:`WorkerMetrics`, which the command adds to the Worker), and provider calls, tokens,
cost and semantic-cache lookups, which the LLM layer reports to the probe the hook attaches
for each attempt (:mod:`sluice.probes`; the engine and the LLM layer import no metrics
library). What must be exact for the whole queue (limiter refusals, latency histograms,
lease expiries) is counted in Redis instead and exported once, by the API
(``service/metrics.py``), so that N workers do not repeat it.

How a scrape reaches them:

* ``sluice worker --metrics-port P`` (one process): an ordinary registry, served on ``P``
  by a thread of the process.
* ``sluice worker --metrics-port P -p N``: the supervisor makes a private directory, gives
  it to its children (``SLUICE_WORKER_METRICS_DIR``), and serves their files added up on ``P``
  (prometheus-client's multiprocess mode); a child that ends has its live gauges dropped
  (``mark_process_dead``); the directory is removed at exit.
* ``sluice dev``: the API and the workers share one such directory, so the API's
  ``GET /metrics`` shows the workers' series too (no second port).

prometheus-client picks its mode when first imported, from ``PROMETHEUS_MULTIPROC_DIR``:
:func:`enable` sets or clears it before importing this module's metrics.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sluice.engine.hooks import Hook
from sluice.probes import Probe, attach, detach

if TYPE_CHECKING:
    from sluice.engine.context import JobContext
    from sluice.engine.hooks import AttemptEnd

#: prometheus-client's variable (as multiproc.py names it; not imported from there, since
#: importing it imports prometheus-client, before the mode is chosen).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Distinct (provider, model) pairs a process labels; later ones are counted as model "other".
MAX_MODELS = 50

#: The outcomes the handler histogram labels; any other is "other" (each value is a series).
HANDLER_OUTCOMES = (
    "completed",
    "failed",
    "dead",
    "timed_out",
    "released",
    "cancelled",
    "throttled",
    "lease_lost",
)
#: The job type of a job whose name has no handler here: a producer may send any name.
UNREGISTERED = "unregistered"


def _metrics() -> ModuleType:
    """The prometheus-client objects, made on first use (after the mode was chosen)."""
    return importlib.import_module("sluice.service.worker_series")


def outcome_label(end: AttemptEnd) -> str:
    """An attempt's outcome as the handler histogram labels it: a timeout as ``timed_out``
    (retried or dead: the timeout is what an operator looks for), a failure that will be
    retried as ``failed``, the others as the hooks name them."""
    if end.timed_out and end.outcome in ("retry", "dead"):
        return "timed_out"
    label = "failed" if end.outcome == "retry" else end.outcome
    return label if label in HANDLER_OUTCOMES else "other"


class WorkerMetrics(Hook):
    """Counts a worker's attempts into the worker series, and attaches its probe to each.

    A slot is busy from before_attempt to after_attempt, which always pair on the attempt's
    task (engine/hooks.py), so the gauge cannot drift: an attempt stopped before its task
    ran is in neither (it held no handler), and an after whose before failed gives back
    nothing. The job type is the job's name only when the worker has a handler for it
    (``AttemptEnd.registered``), else ``unregistered``: a producer may send any name, and
    each label value is a series of its own.
    """

    def __init__(self) -> None:
        self.m = _metrics()
        #: what the attempts' LLM calls report to (attached on each attempt's task)
        self.probe = PrometheusProbe()
        #: the HTTP server that serves the series (:func:`enable` starts it), or None
        self.server: Any = None
        self.m.PROCESSES.set(1)

    def before_attempt(self, job: JobContext) -> Any:
        token = attach(self.probe)
        self.m.BUSY.inc()
        return token  # after_attempt frees the slot only when the before got this far

    def after_attempt(self, job: JobContext, end: AttemptEnd, before: Any) -> None:
        if before is None:
            return
        m = self.m
        m.BUSY.dec()
        job_type = job.name if end.registered else UNREGISTERED
        m.HANDLER.labels(job_type, outcome_label(end)).observe(end.seconds)
        detach(before)


class PrometheusProbe(Probe):
    """Counts what the LLM layer reports (:mod:`sluice.probes`) into the worker series."""

    def __init__(self) -> None:
        self.m = _metrics()
        self._models: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # sync handlers report from their threads

    def _model(self, provider: str, model: str) -> str:
        key = (provider, model)
        if key in self._models:
            return model
        with self._lock:
            if len(self._models) < MAX_MODELS:
                self._models.add(key)
                return model
        return "other"

    def provider_call(self, provider: str, model: str, outcome: str) -> None:
        self.m.CALLS.labels(provider, self._model(provider, model), outcome).inc()

    def tokens(self, provider: str, model: str, kind: str, count: int) -> None:
        if count > 0:
            self.m.TOKENS.labels(provider, self._model(provider, model), kind).inc(count)

    def cost(self, provider: str, model: str, usd: float) -> None:
        if usd > 0:
            self.m.COST.labels(provider, self._model(provider, model)).inc(usd)

    def cache_lookup(self, result: str) -> None:
        self.m.CACHE.labels(result).inc()


def enable(port: int | None, handoff: str | None) -> WorkerMetrics:
    """Start counting in this worker process; returns the hook to add to its Worker.
    ``handoff``: a directory a supervisor (or ``sluice dev``) collects, written to in
    multiprocess mode; else ``port``: served here from an ordinary registry (the hook's
    ``server``)."""
    if handoff:
        os.environ[MULTIPROC_ENV] = handoff
        return WorkerMetrics()
    os.environ.pop(MULTIPROC_ENV, None)
    hook = WorkerMetrics()
    if port is not None:
        from prometheus_client import start_http_server

        hook.server, _thread = start_http_server(port, registry=_metrics().REGISTRY)
    return hook


@dataclass
class Collected:
    """The supervisor's side: the children's directory and the server that adds them up."""

    port: int
    path: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="sluice-worker-metrics-"))
    server: Any = None

    def start(self) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        from sluice.service.multiproc import Merged

        registry = CollectorRegistry(auto_describe=False)
        registry.register(Merged(self.path))
        try:
            self.server, _thread = start_http_server(self.port, registry=registry)
        except OSError:
            self.close()
            raise

    def ended(self, pid: int) -> None:
        """A child ended: its live gauges (busy slots, processes) stop counting."""
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self.path)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        shutil.rmtree(self.path, ignore_errors=True)
