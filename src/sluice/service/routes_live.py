"""Routes the dashboard reads (and anyone may): who am I, the queue live, latency over time,
budgets with their burn rate.

``GET /v1/live`` is a Server-Sent Events stream of :func:`live.snapshot`, one
``snapshot`` event per interval; a stream ends after :data:`STREAM_SECONDS` (a
client reconnects), so no connection outlives a deploy for long. The queue's
figures are open to any key, as ``GET /v1/queue`` is; budgets only to an admin.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from sluice.errors import SluiceError
from sluice.service import live
from sluice.service.context import AdminDep, CallerDep, Services, ServicesDep
from sluice.service.errors import responses

router = APIRouter(prefix="/v1", tags=["operations"], responses=responses(401, 429, 503))

#: How long one live stream lasts before the server ends it (the client reconnects).
STREAM_SECONDS = 300.0


class MeOut(BaseModel):
    tenant: str
    admin: bool
    #: False under ``sluice dev``: no key is asked for
    auth: bool


@router.get("/me", response_model=MeOut)
async def me(svc: ServicesDep, who: CallerDep) -> MeOut:
    """The caller's tenant and whether its key may administer."""
    return MeOut(tenant=who.tenant, admin=who.admin, auth=svc.auth)


def _event(name: str, data: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def _stream(
    request: Request, svc: Services, who: Any, interval: float, seconds: float
) -> AsyncIterator[bytes]:
    previous: dict[str, Any] | None = None
    end = time.monotonic() + seconds
    yield b"retry: 2000\n\n"
    while time.monotonic() < end and not await request.is_disconnected():
        try:
            previous = await live.snapshot(svc, who, previous)
            yield _event("snapshot", previous)
        except (SluiceError, OSError, ConnectionError) as exc:
            previous = None
            yield _event("unavailable", {"message": f"the queue cannot be read now: {exc}"})
        await asyncio.sleep(interval)


@router.get(
    "/live",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "snapshot events"}},
)
async def live_stream(
    request: Request,
    svc: ServicesDep,
    who: CallerDep,
    interval: Annotated[float, Query(ge=0.2, le=60, description="Seconds between snapshots")] = 1.0,
    seconds: Annotated[
        float, Query(gt=0, le=STREAM_SECONDS, description="How long the stream lasts")
    ] = STREAM_SECONDS,
) -> StreamingResponse:
    """The queue live, as Server-Sent Events: a ``snapshot`` event every ``interval`` with the
    jobs per state, cumulative totals and their rates per second, the flow gates, pressure,
    workers and (admin) budgets with burn rates; ``unavailable`` while Redis cannot be read."""
    return StreamingResponse(
        _stream(request, svc, who, interval, seconds),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/stats/series", responses=responses(422))
async def stats_series(
    svc: ServicesDep,
    who: CallerDep,
    window: Annotated[
        float, Query(ge=10, le=3600, description="Seconds back: 10 s points up to 360, 1 min above")
    ] = 300,
) -> dict[str, Any]:
    """Queue wait, processing and end-to-end p50/p95/p99 per time bucket: the tail over time."""
    series = await svc.queue.latency_series(window)
    return {"queue": svc.queue.name, **series.to_dict()}


@router.get("/budgets", responses=responses(403))
async def budgets(svc: ServicesDep, who: AdminDep) -> dict[str, Any]:
    """Every budget the store knows (at most 100), as it stands, with its burn rate (tokens
    charged per minute over the last minute this API process watched) and, at that rate,
    when it runs out (admin)."""
    return {"budgets": await live.read_budgets(svc)}
