"""A worker process's own metrics: ``sluice worker --metrics-port PORT``.

What one process did, reported through :mod:`sluice.probes` (the engine and the LLM layer
import no metrics library): busy slots, handler durations, provider calls, tokens, cost
and semantic-cache lookups. What must be exact for the whole queue (limiter refusals,
latency histograms, lease expiries) is counted in Redis instead and exported once, by the
API (``service/metrics.py``), so that N workers do not repeat it.

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
from typing import Any

from sluice.probes import Probe, install

#: prometheus-client's variable (as multiproc.py names it; not imported from there, since
#: importing it imports prometheus-client, before the mode is chosen).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Distinct (provider, model) pairs a process labels; later ones are counted as model "other".
MAX_MODELS = 50


def _metrics() -> ModuleType:
    """The prometheus-client objects, made on first use (after the mode was chosen)."""
    return importlib.import_module("sluice.service.worker_series")


class PrometheusProbe(Probe):
    """Counts what :mod:`sluice.probes` reports into the worker series."""

    def __init__(self) -> None:
        m = _metrics()
        self.m = m
        self._models: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # sync handlers report from their threads
        m.PROCESSES.set(1)

    def _model(self, provider: str, model: str) -> str:
        key = (provider, model)
        if key in self._models:
            return model
        with self._lock:
            if len(self._models) < MAX_MODELS:
                self._models.add(key)
                return model
        return "other"

    def attempt_started(self, job_type: str) -> None:
        self.m.BUSY.inc()

    def attempt_ended(self, job_type: str, outcome: str, seconds: float) -> None:
        self.m.BUSY.dec()
        self.m.HANDLER.labels(job_type, outcome).observe(seconds)

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


def enable(port: int | None, handoff: str | None) -> Any:
    """Start counting in this worker process. ``handoff``: a directory a supervisor (or
    ``sluice dev``) collects, written to in multiprocess mode; else ``port``: served here
    from an ordinary registry. Returns the HTTP server (or None)."""
    if handoff:
        os.environ[MULTIPROC_ENV] = handoff
        install(PrometheusProbe())
        return None
    os.environ.pop(MULTIPROC_ENV, None)
    install(PrometheusProbe())
    if port is None:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, registry=_metrics().REGISTRY)
    return server


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
