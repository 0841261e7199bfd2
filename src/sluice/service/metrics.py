"""Prometheus exposition from the API: ``GET /metrics`` with a scraper's ``Accept``.

Two kinds of series, from two places:

* **Queue-level** (``sluice_queue_*``, ``sluice_budget_*``, ``sluice_reservations_held``):
  read from Redis when a scrape comes (``queue_snapshot``), so every API process answers
  the same figures and no worker repeats them. A few concurrent reads, none of them a scan
  over jobs: the live states' sizes and the cumulative ``stats`` hash (``Queue.counts``),
  the flow gates (``Queue.flow``), the workers' heartbeats, the held-reservations index's
  size, the pressure gauge's last reading, and at most ``live.MAX_BUDGETS`` budgets (the ones
  the store's ledger copies; their names are read from PostgreSQL once a minute). Also
  the refusals by gate the dispatch script counts (``Queue.refusals``) and the latency
  histograms folded from every worker's cumulative bins (``Queue.latency_totals``,
  ``sketch.histogram``).
* **Per-process** (``sluice_api_*``): requests by route and status, their latency,
  submissions by outcome and the intake's batches, counted by :class:`Instrument` (an
  ASGI middleware outside everything else: FastAPI's routes and the fast lane alike).
  Under ``sluice serve -p N`` these use prometheus-client's multiprocess mode:
  ``sluice serve`` gives its uvicorn workers a fresh ``PROMETHEUS_MULTIPROC_DIR`` (and
  removes it at exit), every process writes its values there, and the process that
  answers a scrape adds them all up (``MultiProcessCollector``). ``sluice dev`` sets it
  too, and hands the same directory to its workers, so their series (worker_metrics.py)
  appear here as well. Without that variable (one process: ``sluice serve -p 1``, tests)
  they live in an ordinary registry of the process.

prometheus-client decides between the two when it is first imported, from the
environment; this module is imported with the app, after ``sluice serve`` set it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sluice.engine.sketch import histogram
from sluice.errors import SluiceError
from sluice.service.context import REFUSED
from sluice.service.live import budget_names
from sluice.service.multiproc import MULTIPROC_ENV, merged

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from sluice.engine.flow import FlowState
    from sluice.service.context import Services

log = logging.getLogger("sluice.service")

#: The routes that submit jobs (``sluice_api_submissions_total``).
SUBMISSION_PATHS = frozenset({"/jobs", "/v1/jobs", "/v1/jobs/batch", "/enqueue"})

_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
_LIVE_STATES = ("waiting", "delayed", "parked", "active", "dead")

# ---- the process's own metrics ---------------------------------------------------------------------


def multiprocess_dir() -> str | None:
    """The multiprocess directory this process writes to, or None (an ordinary registry)."""
    return os.environ.get(MULTIPROC_ENV) or None


#: Where the process's own metrics live when there is one process. Under multiprocess mode
#: their values are in files instead, and this registry is never collected.
LOCAL = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "sluice_api_requests",
    "HTTP requests answered, by method, route template and status.",
    ["method", "route", "status"],
    registry=LOCAL,
)
LATENCY = Histogram(
    "sluice_api_request_duration_seconds",
    "Time from a request's arrival to its answer's end, by method and route template.",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=LOCAL,
)
SUBMISSIONS = Counter(
    "sluice_api_submissions",
    "Submissions (POST /jobs, /v1/jobs, /v1/jobs/batch, /enqueue) by route and outcome: accepted, "
    "backpressure (429, the queue too far behind), rate_limited (429, the key's rate), too_large "
    "(413), invalid (400, 415, 422), unauthorized (401, 403), error (anything else).",
    ["route", "outcome"],
    registry=LOCAL,
)
INTAKE_BATCHES = Counter(
    "sluice_api_intake_batches",
    "Batches the intake wrote to the store (jobs / batches: the mean batch size).",
    registry=LOCAL,
)
INTAKE_JOBS = Counter("sluice_api_intake_jobs", "Jobs in the intake's batches.", registry=LOCAL)
PROCESSES = Gauge(
    "sluice_api_processes",
    "API processes alive (each sets 1; a dead process's value is dropped at the next scrape).",
    multiprocess_mode="livesum",
    registry=LOCAL,
)


def _outcome(status: int, state: dict[str, Any] | None) -> str:
    if status < 300:
        return "accepted"
    if status == 429:
        return "rate_limited" if state is not None and state.get(REFUSED) == "rate_limit" else "backpressure"
    if status == 413:
        return "too_large"
    if status in (400, 415, 422):
        return "invalid"
    if status in (401, 403):
        return "unauthorized"
    return "error"


class Instrument:
    """ASGI middleware, the outermost: counts and times every HTTP request.

    Per request: two clock reads, a closure for ``send``, and one counter increment and
    one histogram observation on children looked up once per (method, route, status).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._children: dict[tuple[str, str, int], tuple[Any, Any, dict[str, Any] | None]] = {}
        self._intake_seen: tuple[int, int] = (0, 0)
        PROCESSES.set(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self._record(scope, status, time.perf_counter() - start)

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        method = scope["method"]
        route = scope.get("route")
        template: str | None = getattr(route, "path", None)
        path = scope["path"]
        if template is None:  # the fast lane, the body limit, or no route (404)
            template = path if path in SUBMISSION_PATHS else "other"
        key = (method, template, status)
        children = self._children.get(key)
        if children is None:
            label = method if method in _METHODS else "other"
            submission = method == "POST" and path in SUBMISSION_PATHS
            children = (
                REQUESTS.labels(label, template, str(status)),
                LATENCY.labels(label, template),
                {} if submission else None,
            )
            if len(self._children) < 10_000:
                self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        outcomes = children[2]
        if outcomes is not None:
            outcome = _outcome(status, scope.get("state"))
            counter = outcomes.get(outcome)
            if counter is None:
                counter = outcomes[outcome] = SUBMISSIONS.labels(template, outcome)
            counter.inc()
            self._count_intake(scope)

    def _count_intake(self, scope: Scope) -> None:
        svc = getattr(scope["app"].state, "services", None) if "app" in scope else None
        intake = getattr(svc, "intake", None)
        if intake is None:
            return
        batches, jobs = intake.batches, intake.jobs
        seen_batches, seen_jobs = self._intake_seen
        if batches < seen_batches or jobs < seen_jobs:  # another intake (the app restarted)
            seen_batches, seen_jobs = 0, 0
        if batches > seen_batches:
            INTAKE_BATCHES.inc(batches - seen_batches)
        if jobs > seen_jobs:
            INTAKE_JOBS.inc(jobs - seen_jobs)
        self._intake_seen = (batches, jobs)


# ---- the queue's metrics, read from Redis at scrape time -------------------------------------------


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _window_families(qn: str, flow: FlowState) -> list[Metric]:
    """Every window of the rate limits (the caps of set_limits included): its limit and count."""
    if not flow.windows:
        return []
    labels = ["queue", "kind", "window_seconds"]
    limits = _gauge("sluice_queue_window_limit", "Each rate window's limit: starts or tokens.", labels)
    counted = _gauge(
        "sluice_queue_window_count", "What each rate window counts now: starts or estimated tokens.", labels
    )
    for w in flow.windows:
        limits.add_metric([qn, w.kind, f"{w.per_seconds:g}"], w.limit)
        counted.add_metric([qn, w.kind, f"{w.per_seconds:g}"], w.in_window)
    return [limits, counted]


async def queue_snapshot(svc: Services) -> list[Metric]:
    """The queue-level metric families, read now (Redis; the budget names may come from the
    store). Without Redis: ``sluice_redis_up 0`` alone."""
    q = svc.queue
    qn = q.name
    started = time.perf_counter()
    up = GaugeMetricFamily(
        "sluice_redis_up", "1 when the scrape could read the queue from Redis.", labels=["queue"]
    )
    try:
        names = await budget_names(svc)
    except Exception:  # the store down: the queue's figures without budgets
        log.warning("metrics: the budgets' names could not be read from the store", exc_info=True)
        names = []
    try:
        (counts, flow, workers, held, pressure, budgets), (refusals, latency) = await asyncio.gather(
            asyncio.gather(
                q.counts(),
                q.flow(),
                q.workers(),
                q.redis.zcard(q.keys.held),
                svc.pressure.read(),
                q.budgets.get_many(names) if names else _none(),
            ),
            asyncio.gather(q.refusals(), q.latency_totals()),
        )
    except (SluiceError, OSError, ConnectionError) as exc:
        log.warning("metrics: the queue could not be read (%s)", exc)
        up.add_metric([qn], 0)
        return [up]
    up.add_metric([qn], 1)
    out: list[Metric] = [up]

    jobs = _gauge("sluice_queue_jobs", "Jobs in each live state now.", ["queue", "state"])
    for state in _LIVE_STATES:
        jobs.add_metric([qn, state], counts[state])
    outcomes = CounterMetricFamily(
        "sluice_queue_outcomes",
        "The engine's cumulative counters (the queue's stats hash), by outcome: added, completed, "
        "failed (attempts), retried, stalled (lease expiries), cancelled, released, dead, "
        "stale_refused (answers from workers that had lost their lease), orphaned, throttled, "
        "rejected, exhausted, unknown_outcome, overrun.",
        labels=["queue", "outcome"],
    )
    for name, value in counts.items():
        if name in _LIVE_STATES:
            continue
        outcomes.add_metric([qn, "dead" if name == "dead_total" else name], value)
    out += [jobs, outcomes, _refusals_family(qn, refusals), *_latency_families(qn, latency)]

    def one(name: str, doc: str, value: float | None) -> None:
        if value is not None:
            family = _gauge(name, doc, ["queue"])
            family.add_metric([qn], value)
            out.append(family)

    one("sluice_queue_paused", "1 while the queue is paused.", 1 if flow.paused else 0)
    one(
        "sluice_queue_throttled_until_seconds",
        "Unix time until which a provider throttle holds dispatch (0: not throttled).",
        (flow.throttled_until_ms or 0) / 1000,
    )
    one(
        "sluice_queue_concurrency_limit", "The queue-wide concurrency limit (absent: none).", flow.concurrency
    )
    one(
        "sluice_queue_rate_limit_starts",
        "Starts the rate gate allows per window (absent: none).",
        flow.rate_max,
    )
    one("sluice_queue_rate_window_seconds", "The rate gate's window.", flow.rate_per_seconds)
    one(
        "sluice_queue_rate_window_starts",
        "Starts in the rate gate's current window.",
        flow.starts_in_window if flow.rate_max is not None else None,
    )
    one(
        "sluice_queue_token_limit",
        "Tokens the token-rate gate allows per window (absent: none).",
        flow.token_limit,
    )
    one("sluice_queue_token_window_seconds", "The token-rate gate's window.", flow.token_per_seconds)
    one(
        "sluice_queue_token_window_tokens",
        "Tokens charged in the token-rate gate's current window.",
        flow.tokens_in_window if flow.token_limit is not None else None,
    )
    out += _window_families(qn, flow)
    one("sluice_queue_workers", "Workers whose heartbeat is live.", len(workers))
    one(
        "sluice_queue_worker_slots",
        "Jobs the live workers may run at once.",
        sum(w.concurrency or 0 for w in workers),
    )
    one(
        "sluice_queue_pressure",
        "Backpressure score: the backlog against its limits (above 1 submissions get 429).",
        pressure.score,
    )
    one(
        "sluice_queue_refusing",
        "1 while submissions are refused for backpressure.",
        1 if pressure.refusing else 0,
    )
    one(
        "sluice_queue_drain_rate",
        "Jobs finished per second (the pressure gauge's average).",
        pressure.drain_rate,
    )
    one(
        "sluice_queue_backlog_seconds",
        "Time the backlog would take to drain at that rate.",
        pressure.backlog_seconds,
    )
    one(
        "sluice_reservations_held",
        "Callers' budget reservations still held (the index; settled ones leave it at the next sweep).",
        held,
    )
    out += _budget_families(qn, [b for b in budgets if b is not None])
    duration = _gauge("sluice_scrape_duration_seconds", "Time this scrape took to read the queue.", ["queue"])
    duration.add_metric([qn], round(time.perf_counter() - started, 6))
    out.append(duration)
    return out


def _refusals_family(qn: str, refusals: dict[str, int]) -> Metric:
    refused = CounterMetricFamily(
        "sluice_queue_refusals",
        "Dispatch calls a gate refused (counted in the dispatch script, once per gate per call, "
        "for every worker): paused, throttled, concurrency, rate, token_rate, budget.",
        labels=["queue", "gate"],
    )
    for gate, n in refusals.items():
        refused.add_metric([qn, gate], n)
    return refused


#: The latency histograms, by the sketch's metric names (engine/sketch.py).
LATENCY_FAMILIES = {
    "queue_wait": (
        "sluice_job_queue_wait_seconds",
        "From when an attempt could run (created, or its delay or backoff over) to its dispatch.",
    ),
    "processing": ("sluice_job_processing_seconds", "From an attempt's dispatch to its outcome."),
    "end_to_end": (
        "sluice_job_end_to_end_seconds",
        "From a job's creation to the outcome that ended it (completed or dead).",
    ),
}


def _latency_families(qn: str, totals: dict[str, dict[str, dict[str, int]]]) -> list[Metric]:
    """The workers' cumulative latency bins (all of them, from Redis) as histograms per
    priority (the first 32 a queue saw; later ones as ``other``). A sample within 2 % below
    an edge may be counted in the next bucket (sketch.histogram)."""
    out: list[Metric] = []
    for metric, (name, doc) in LATENCY_FAMILIES.items():
        family = HistogramMetricFamily(
            name, doc + " All workers, from Redis; per priority.", labels=["queue", "priority"]
        )
        for priority, bins in totals.get(metric, {}).items():
            h = histogram(bins)
            buckets = [(floatToGoString(edge), count) for edge, count in h.buckets]  # type: ignore[no-untyped-call]
            family.add_metric([qn, priority], buckets, round(h.sum, 6))
        out.append(family)
    return out


async def _none() -> list[Any]:
    return []


def _budget_families(qn: str, budgets: Iterable[Any]) -> list[Metric]:
    labels = ["queue", "budget"]
    gauges = {
        "limit": _gauge("sluice_budget_limit_tokens", "The budget's standing limit per window.", labels),
        "credit": _gauge("sluice_budget_credit_tokens", "One-off credit of the current window.", labels),
        "used": _gauge(
            "sluice_budget_used_tokens",
            "Tokens charged in the current window: held reservations and committed usage.",
            labels,
        ),
        "remaining": _gauge("sluice_budget_remaining_tokens", "limit + credit - used, at least 0.", labels),
        "overspent": _gauge("sluice_budget_overspent_tokens", "used beyond limit + credit.", labels),
        "parked": _gauge("sluice_budget_parked_jobs", "Jobs parked waiting for this budget.", labels),
    }
    counters = {
        "accepted": CounterMetricFamily(
            "sluice_budget_accepted", "Reservations the budget admitted.", labels=labels
        ),
        "rejected": CounterMetricFamily(
            "sluice_budget_rejected", "Reservations the budget refused.", labels=labels
        ),
        "unknown_outcomes": CounterMetricFamily(
            "sluice_budget_unknown_outcomes",
            "Reservations kept charged: their outcome unknown.",
            labels=labels,
        ),
        "beyond_estimates": CounterMetricFamily(
            "sluice_budget_beyond_estimates_tokens",
            "Tokens charged beyond reservations' estimates.",
            labels=labels,
        ),
        "charged": CounterMetricFamily(
            "sluice_budget_charged_tokens",
            "Tokens of every settled reservation since the budget was made, whatever its "
            "windows: what it spent (its rate() is the burn rate; it restarts at 0 when a "
            "budget is restored after Redis lost it).",
            labels=labels,
        ),
    }
    for b in budgets:
        for field, family in gauges.items():
            family.add_metric([qn, b.name], getattr(b, field))
        for field, counter in counters.items():
            counter.add_metric([qn, b.name], getattr(b, field))
    return [*gauges.values(), *counters.values()]


# ---- the scrape ------------------------------------------------------------------------------------


class _Scrape(Collector):
    """What one scrape exposes: the process metrics (all processes' in multiprocess mode)
    and the queue's families read for it."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        path = multiprocess_dir()
        if path is None:
            yield from LOCAL.collect()
        else:
            yield from merged(path)
        yield from self.families


def wants_prometheus(accept: str | None) -> bool:
    """True when ``Accept`` prefers a Prometheus format (``text/plain`` or
    ``application/openmetrics-text``) to JSON; no Accept, ``*/*`` or JSON: False."""
    if not accept:
        return False
    best_prom = 0.0
    best_json = 0.0
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        media = media.lower()
        if media in ("text/plain", "application/openmetrics-text"):
            best_prom = max(best_prom, q)
        elif media == "application/json":
            best_json = max(best_json, q)
    return best_prom > 0 and best_prom >= best_json


async def exposition(svc: Services, accept: str) -> tuple[bytes, str]:
    """The scrape's body and content type (OpenMetrics when ``accept`` asks for it)."""
    families = await queue_snapshot(svc)
    encoder, content_type = choose_encoder(accept)
    # The multiprocess files are read and merged here: off the event loop.
    body = await asyncio.to_thread(encoder, _Scrape(families))
    return body, content_type
