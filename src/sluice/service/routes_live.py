"""Routes the dashboard reads (and anyone may): who am I, the queue live, latency over time,
budgets with their burn rate.

``GET /v1/live`` is a Server-Sent Events stream of :func:`live.snapshot`, one
``snapshot`` event per interval; a stream ends after :data:`STREAM_SECONDS` (a
client reconnects), so no connection outlives a deploy for long. The queue's
figures are open to any key, as ``GET /v1/queue`` is; budgets only to an admin.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from sluice.errors import SluiceError
from sluice.service import live
from sluice.service.context import AdminDep, Caller, CallerDep, Services, ServicesDep, caller_again
from sluice.service.errors import ApiError, responses

log = logging.getLogger("sluice.service")

router = APIRouter(prefix="/v1", tags=["operations"], responses=responses(401, 429, 503))

#: How long one live stream lasts before the server ends it (the client reconnects).
STREAM_SECONDS = 300.0
#: How often a stream checks its key again (a key revoked or no longer admin ends it).
RECHECK_SECONDS = 30.0
#: Live streams one API process serves at once; more get 429.
MAX_STREAMS = 200


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
    request: Request, svc: Services, who: Caller, interval: float, seconds: float
) -> AsyncIterator[bytes]:
    previous: dict[str, Any] | None = None
    started = time.monotonic()
    checked = started
    svc.live_streams += 1
    try:
        yield b"retry: 2000\n\n"
        while time.monotonic() - started < seconds and not await request.is_disconnected():
            if time.monotonic() - checked >= RECHECK_SECONDS:
                checked = time.monotonic()
                try:
                    again = await caller_again(request, svc)
                except ApiError:
                    return  # revoked, or past its rate limit: the client reconnects and is told
                if again != who:
                    return
            try:
                previous = await live.snapshot(svc, who, previous)
                yield _event("snapshot", {k: v for k, v in previous.items() if not k.startswith("_")})
            except (SluiceError, OSError, ConnectionError) as exc:
                previous = None
                log.warning("live: the queue could not be read (%s)", exc)
                yield _event("unavailable", {"message": "the queue's Redis is unavailable; retrying"})
            await asyncio.sleep(interval)
    finally:
        svc.live_streams -= 1


@router.get(
    "/live",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "snapshot events"}},
)
async def live_stream(
    request: Request,
    svc: ServicesDep,
    who: CallerDep,
    interval: Annotated[float, Query(ge=0.5, le=60, description="Seconds between snapshots")] = 1.0,
    seconds: Annotated[
        float, Query(gt=0, le=STREAM_SECONDS, description="How long the stream lasts")
    ] = STREAM_SECONDS,
) -> StreamingResponse:
    """The queue live, as Server-Sent Events: a ``snapshot`` event every ``interval`` with the
    jobs per state, cumulative totals and their rates per second, the flow gates, pressure,
    workers and (admin) budgets with burn rates; ``unavailable`` while Redis cannot be read.
    A key revoked meanwhile ends the stream within RECHECK_SECONDS."""
    if svc.live_streams >= MAX_STREAMS:
        raise ApiError(
            429, f"this API process serves {MAX_STREAMS} live streams already", headers={"Retry-After": "5"}
        )
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
    charged per minute over the last minute) and, at that rate, when it runs out (admin)."""
    return {"budgets": await live.sample_budgets(svc)}
