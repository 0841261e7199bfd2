"""The FastAPI application: ``create_app(settings)``.

At start it connects to Redis and PostgreSQL, applies the store's missing
migrations, and (unless ``sink=False``) runs the transition sink, the
reconciler and the ledger's copier beside the routes, so one ``sluice serve`` process is a complete
service. Several API processes may run at once: they share the sink's
consumer group and the migrations' lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse
from pydantic import BaseModel

from sluice import tracing
from sluice.engine.queue import Queue
from sluice.errors import RedisUnavailable
from sluice.llm import tokens
from sluice.llm.cache import SemanticCache
from sluice.llm.embedder import LocalEmbedder
from sluice.service import errors, live
from sluice.service.config import ServiceSettings
from sluice.service.context import Services, ServicesDep
from sluice.service.dashboard import create_dashboard
from sluice.service.fastlane import FastLane
from sluice.service.metrics import Instrument
from sluice.service.middleware import BodyLimit, RequestId
from sluice.service.pressure import PressureGauge
from sluice.service.ratelimit import RateLimiter
from sluice.service.routes_admin import router as admin_router
from sluice.service.routes_arqueue import router as arqueue_router
from sluice.service.routes_compat import router as compat_router
from sluice.service.routes_failures import arqueue_router as arqueue_failures_router
from sluice.service.routes_failures import router as failures_router
from sluice.service.routes_live import router as live_router
from sluice.service.routes_stats import router as stats_router
from sluice.service.routes_v1 import router as v1_router
from sluice.service.submit import Intake, enqueue
from sluice.store.collector import PatternCollector
from sluice.store.database import Database
from sluice.store.jobs import JobStore
from sluice.store.keys import KeyStore
from sluice.store.ledger import BudgetLedger
from sluice.store.reconcile import Reconciler
from sluice.store.sink import TransitionSink

log = logging.getLogger("sluice.service")

VERSION = "0.1.0"


class ReadyOut(BaseModel):
    """``/readyz``: ready or not, and each dependency's answer."""

    status: str
    checks: dict[str, str]


def create_app(
    settings: ServiceSettings, *, auth: bool = True, fast_lane: bool = True, freeze: bool = False
) -> FastAPI:
    """The service; it connects when it starts (ASGI lifespan) and closes when it stops.

    ``auth=False`` (``sluice dev`` only): no API key is asked for, and every caller is the
    default tenant's admin. ``fast_lane=False`` serves every submission through FastAPI's
    routes (the tests compare the two; ``fastlane.py``). ``freeze``: the objects start-up made
    are moved out of the garbage collector's way once it is done (a process of its own: the
    ASGI entry point; not a test's process, whose objects would never be collected).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        queue = Queue.from_url(
            settings.redis_url, settings.queue, prefix=settings.prefix, events_maxlen=settings.events_maxlen
        )
        db = Database(settings.database_url)
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            await db.migrate()
            await _provider_limits(queue, settings)
            store = JobStore(db)
            gauge = PressureGauge(
                queue, max_backlog_seconds=settings.max_backlog_seconds, max_depth=settings.max_depth
            )
            limiter = RateLimiter(
                queue.redis, settings.prefix, rate=settings.rate_limit, burst=settings.rate_burst
            )
            ledger = BudgetLedger(queue, db, interval=settings.budget_copy_interval)
            intake = Intake(
                queue,
                store,
                ledger,
                analysis_budget=settings.analysis_budget,
                token_rate_limit=settings.llm_tpm,
            )
            app.state.services = Services(
                settings, auth, queue, db, store, KeyStore(db), gauge, limiter, ledger, intake
            )
            services: Services = app.state.services
            tasks = _background(services, stop) if settings.sink else []
            # Budgets' burn rates (the dashboard, GET /v1/budgets): sampled in every process.
            tasks.append(
                asyncio.create_task(
                    services.burn.run(functools.partial(live.budget_states, services), stop),
                    name="sluice-burn-rates",
                )
            )
            # The tokenizer that counts llm-inference reservations loads in a thread, not on the
            # first submission's event loop (up to half a second).
            tasks.append(asyncio.create_task(_preload_tokenizer(settings), name="sluice-tokenizer"))
            # What start-up made (modules, routes, models: most of the objects there are) lives
            # as long as the process: out of the collector's way, so that its full collections,
            # which walk every object it tracks, stay short while requests wait.
            if freeze:
                gc.freeze()
            yield
        finally:
            stop.set()
            await _stop(tasks, app.state.services)
            app.state.services = None
            await queue.close()
            await db.close()

    app = FastAPI(
        title="Sluice",
        version=VERSION,
        description="A budget-aware job queue for LLM workloads: jobs, budgets and queues over HTTP.",
        lifespan=lifespan,
        # FastAPI's native OpenTelemetry looks up its providers on every request (a few percent of
        # the API's CPU at full load) even when none is configured: on only for request spans, and
        # only when tracing is (sluice.tracing); metrics are Prometheus's.
        telemetry=tracing.fastapi_telemetry(),
        responses=errors.responses(413),
    )
    errors.install(app)
    for router in (
        v1_router,
        compat_router,
        arqueue_router,
        admin_router,
        failures_router,
        arqueue_failures_router,
        stats_router,
        live_router,
    ):
        app.include_router(router)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process is up (it answers); says nothing of Redis or PostgreSQL."""
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
        response_model=ReadyOut,
        responses={503: {"model": ReadyOut, "description": "a dependency is unreachable"}},
    )
    async def readyz(svc: ServicesDep) -> Any:
        """Redis and PostgreSQL both answer: ready for traffic."""
        checks: dict[str, str] = {}
        for name, probe in (("redis", svc.queue.redis.ping()), ("postgres", svc.db.ping())):
            try:
                async with asyncio.timeout(2):
                    await probe
                checks[name] = "ok"
            except Exception as exc:  # noqa: BLE001 - reported, not raised: that is the answer
                checks[name] = f"unreachable: {type(exc).__name__}"
        ready = all(v == "ok" for v in checks.values())
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "checks": checks}, 200 if ready else 503
        )

    _dashboard(app, auth=auth)
    _middleware(app, settings, fast_lane=fast_lane)
    app.state.services = None
    return app


def _background(svc: Services, stop: asyncio.Event) -> list[asyncio.Task[None]]:
    """The transition sink, the reconciler, the ledger's copier, the failure collector and the
    cache's purge (the last three in the process whose sink leads)."""
    settings, queue, db = svc.settings, svc.queue, svc.db
    sink = TransitionSink(queue, db, consumer=f"{socket.gethostname()}:{os.getpid()}")
    reconciler = Reconciler(
        queue,
        svc.store,
        enqueue,
        grace=settings.reconcile_grace,
        interval=settings.reconcile_interval,
        ledger=svc.ledger,
        lead=sink.lead,
    )
    collector = PatternCollector(db, interval=settings.failure_collect_interval, lead=sink.lead)
    purge = SemanticCache(db, LocalEmbedder()).run_purge(
        stop, interval=settings.cache_purge_interval, lead=sink.lead
    )
    return [
        asyncio.create_task(sink.run(stop), name="sluice-sink"),
        asyncio.create_task(reconciler.run(stop), name="sluice-reconciler"),
        asyncio.create_task(svc.ledger.run(stop), name="sluice-ledger"),
        asyncio.create_task(collector.run(stop), name="sluice-failure-patterns"),
        asyncio.create_task(purge, name="sluice-cache-purge"),
    ]


def _dashboard(app: FastAPI, *, auth: bool) -> None:
    """The dashboard at /dashboard/ (and / leads there)."""

    @app.get("/", include_in_schema=False)
    @app.get("/dashboard", include_in_schema=False)
    async def to_dashboard() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    app.mount("/dashboard", create_dashboard(auth=auth), name="dashboard")


def _middleware(app: FastAPI, settings: ServiceSettings, *, fast_lane: bool) -> None:
    """Outermost first: the request metrics, the request id, the body limit, then the
    submissions' fast lane."""
    if fast_lane:
        app.add_middleware(FastLane)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestId)
    app.add_middleware(Instrument)


async def _stop(tasks: list[asyncio.Task[None]], services: Services | None) -> None:
    """The background tasks cancelled and awaited; the intake's connection given back."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if services is not None:
        await services.intake.close()


async def _preload_tokenizer(settings: ServiceSettings) -> None:
    with contextlib.suppress(Exception):  # counted at the first submission instead (or estimated)
        name = tokens.encoding_name(settings.llm_provider or "offline", settings.llm_model or "")
        if name is not None:
            await asyncio.to_thread(tokens.preload, name)


async def _provider_limits(queue: Queue, settings: ServiceSettings) -> None:
    """The provider's per-minute limits as the queue's shared gates: every worker process, on
    every machine, counts against the same windows (a per-process limiter multiplies the
    limit by the number of processes). Set at each start, so a Redis that lost its data gets
    them back with the service; the token gate counts each job's reservation, then its usage."""
    try:
        if settings.llm_rpm is not None:
            await queue.set_rate_limit(settings.llm_rpm, per=60.0)
        if settings.llm_tpm is not None:
            await queue.set_token_rate_limit(settings.llm_tpm, per=60.0)
    except RedisUnavailable:  # the service starts without Redis (submissions are stored)
        log.warning("service: Redis is down; the provider's limits were not set on the queue")
