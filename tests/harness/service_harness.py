"""Running the service in the test's event loop: the ASGI app with its lifespan, an httpx
client on it, and the service's parts for looking behind the API (store, queue).

Real Redis and a real PostgreSQL database per test; the app's own sink and
reconciler are off unless a test turns them on, so a test steps them itself
and sees each step's effect.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from sluice.service.app import create_app
from sluice.service.config import ServiceSettings
from sluice.service.context import Services
from sluice.service.submit import enqueue
from sluice.store.reconcile import Reconciler
from sluice.store.sink import TransitionSink


@dataclass
class Running:
    app: FastAPI
    client: httpx.AsyncClient
    svc: Services
    sink: TransitionSink
    reconciler: Reconciler

    async def drain_events(self) -> int:
        """Apply every event the sink has not applied yet."""
        total = 0
        while True:
            n = await self.sink.step()
            total += n
            if n == 0:
                return total


@contextlib.asynccontextmanager
async def running_service(
    redis_url: str,
    database_url: str,
    prefix: str,
    *,
    auth: bool = False,
    fast_lane: bool = True,
    **overrides: Any,
) -> AsyncIterator[Running]:
    options: dict[str, Any] = {
        "redis_url": redis_url,
        "database_url": database_url,
        "prefix": prefix,
        "sink": False,
    }
    options.update(overrides)
    settings = ServiceSettings(**options)
    app = create_app(settings, auth=auth, fast_lane=fast_lane)
    async with app.router.lifespan_context(app):
        svc: Services = app.state.services
        sink = TransitionSink(svc.queue, svc.db, consumer="test", block_ms=10)
        reconciler = Reconciler(
            svc.queue, svc.store, enqueue, grace=settings.reconcile_grace, ledger=svc.ledger
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sluice.test") as client:
            yield Running(app, client, svc, sink, reconciler)
