"""``GET /v1/stats``: latency percentiles of the service's queue over sliding windows.

The same numbers, in the same shape, as ``sluice stats --json``: queue wait,
processing and end-to-end time (ms), p50/p95/p99, a count and an upper bound
of the max, over the last 1 min, 5 min and 1 h, merged from the latency bins
every worker flushes (engine/sketch.py). Each percentile is within
``accuracy`` (1 %, relative) of the exact value at rank ``floor(q * (n - 1))``.
Any valid key may read it: it tells nothing of a tenant's jobs.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from sluice.engine.stats import latency_report
from sluice.service.context import CallerDep, ServicesDep
from sluice.service.errors import responses

router = APIRouter(prefix="/v1", tags=["operations"], responses=responses(401, 429, 503))


class PercentilesOut(BaseModel):
    """One metric over one window, in ms; null without samples."""

    count: int
    p50: float | None
    p95: float | None
    p99: float | None
    #: the upper bound of the highest bin that holds a sample
    max: float | None


class MetricsOut(BaseModel):
    #: from when the attempt became runnable (creation, or the end of its delay or backoff)
    #: to its dispatch; one sample per attempt
    queue_wait: PercentilesOut
    #: dispatch to outcome; one sample per attempt (completed, retried or dead-lettered)
    processing: PercentilesOut
    #: creation to the outcome that ended the job (completed or dead); one sample per job
    end_to_end: PercentilesOut


class WindowOut(BaseModel):
    #: the window's length; it covers up to one bucket more (10 s, or 1 min for 1 h)
    seconds: float
    metrics: MetricsOut


class StatsOut(BaseModel):
    queue: str
    #: every percentile is within this (relative) of the exact one
    accuracy: float
    #: Redis's clock when the windows were read (ms)
    now_ms: int
    #: "1m", "5m" and "1h"
    windows: dict[str, WindowOut]


@router.get("/stats", response_model=StatsOut)
async def stats(svc: ServicesDep, who: CallerDep) -> StatsOut:
    """Queue wait, processing and end-to-end percentiles of the service's queue over the last
    1 min, 5 min and 1 h (samples reach Redis about a second after their attempts end)."""
    return StatsOut.model_validate(await latency_report(svc.queue))
