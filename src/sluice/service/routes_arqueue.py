"""ArQueue's routes, with its field names and status codes.

``POST /enqueue`` takes ``type``, ``payload`` (an object), ``maxRetries``
(0 to 10, default 3) and ``idempotencyKey``, and answers 201 with
``{taskId, queueLength, requestId}``; a body that breaks the schema is a 400
and one that is not JSON a 415, as in that design (in our one error shape).
Its retries wait 2 s * 2^(retry - 1), at most 60 s, with 10 % jitter.
``GET /dead_letter?limit=`` lists dead-lettered tasks in its shape;
``GET /pressure`` says how far behind the queue is (our addition: that
design refused by request rate only). ``GET /metrics`` answers its JSON
counters, with latency percentiles added; to a Prometheus scraper (by
``Accept``), the exposition of ``metrics.py``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError

from sluice.engine.backoff import Backoff
from sluice.errors import InvalidJobError, RedisUnavailable
from sluice.service.context import AdmittedDep, Caller, CallerDep, Services, ServicesDep
from sluice.service.errors import ApiError, responses
from sluice.service.metrics import exposition, wants_prometheus
from sluice.service.schemas import ArqDeadTask, ArqEnqueued, ArqTaskIn, MetricsOut, PressureOut
from sluice.service.submit import backoff_json
from sluice.store.job import NewJob

router = APIRouter(tags=["compatibility: ArQueue"], responses=responses(401, 429, 503))

#: ArQueue's retry delay: 2 s doubling, at most 60 s, +-10 %.
ARQ_BACKOFF = Backoff("exponential", 2.0, 60.0, 0.1)
ARQ_BACKOFF_JSON = backoff_json(ARQ_BACKOFF)

#: The route reads its body itself (to answer 400 and 415 as ArQueue does, not 422), so
#: FastAPI cannot see it: /openapi.json gets it from here.
_ENQUEUE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ArqTaskIn.model_json_schema()}},
    }
}


@router.post(
    "/enqueue",
    status_code=201,
    response_model=ArqEnqueued,
    openapi_extra=_ENQUEUE_BODY,
    responses=responses(400, 413, 415),
)
async def arq_enqueue(
    request: Request, svc: ServicesDep, who: CallerDep, _admitted: AdmittedDep
) -> ArqEnqueued:
    """Enqueue a task (ArQueue design): 201 ``{taskId, queueLength, requestId}``."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "Unsupported Media Type: use application/json")
    try:
        body = ArqTaskIn.model_validate_json(await request.body())
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "body"
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {field!r}"
        else:
            message = f"{field}: {first.get('msg', 'invalid')}"
        raise ApiError(400, message, field=field) from None
    return await accept_arq(svc, who, body, request.state.request_id)


async def accept_arq(svc: Services, who: Caller, body: ArqTaskIn, request_id: str) -> ArqEnqueued:
    """``POST /enqueue`` once the caller is known and admitted (the route's and the fast lane's)."""
    new = NewJob(
        tenant=who.tenant,
        queue=svc.settings.queue,
        type=body.type,
        payload=body.payload,
        priority=0,
        max_attempts=body.maxRetries + 1,
        backoff=ARQ_BACKOFF_JSON,
        idempotency_key=body.idempotencyKey,
        correlation_id=request_id,
    )
    try:
        stored, _ = await svc.intake.submit(new)
    except InvalidJobError as exc:  # a payload its job type refuses: ArQueue answers those 400
        raise ApiError(400, str(exc)) from None
    try:
        depth = (await svc.queue.counts())["waiting"]
    except RedisUnavailable:  # the task is stored (and enqueued when Redis is back): still a 201
        depth = (await svc.pressure.read()).depth
    return ArqEnqueued(taskId=str(stored.id), queueLength=depth, requestId=request_id)


@router.get("/dead_letter", response_model=list[ArqDeadTask], responses=responses(422))
async def arq_dead_letter(
    svc: ServicesDep, who: CallerDep, limit: Annotated[int, Query(ge=1)] = 50
) -> list[ArqDeadTask]:
    """Dead-lettered tasks, newest first (at most 100), in ArQueue's shape."""
    page = await svc.store.list_jobs(who.tenant, status="DEAD_LETTER", limit=min(limit, 100))
    return [
        ArqDeadTask(
            id=str(j.id),
            type=j.type,
            payload=j.payload,
            retries=max(j.attempts - 1, 0),
            maxRetries=j.max_attempts - 1,
            lastError=j.error,
            createdAt=int(j.created_at.timestamp() * 1000),
            startedAt=int(j.processed_at.timestamp() * 1000) if j.processed_at else None,
        )
        for j in page.jobs
    ]


@router.get("/pressure", response_model=PressureOut)
async def pressure(svc: ServicesDep, who: CallerDep) -> PressureOut:
    """The backlog against its limits: ``score`` above 1 means submissions get 429."""
    p = await svc.pressure.read()
    return PressureOut(
        score=p.score,
        refusing=p.refusing,
        depth=p.depth,
        drainRatePerSecond=p.drain_rate,
        backlogSeconds=p.backlog_seconds,
        maxBacklogSeconds=svc.pressure.max_backlog_seconds,
        maxDepth=svc.pressure.max_depth,
        retryAfterSeconds=p.retry_after if p.refusing else None,
    )


#: /openapi.json: the one path answers JSON or a Prometheus exposition (by ``Accept``).
_METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "ArQueue's JSON counters; or, to a Prometheus scraper, its exposition",
        "content": {
            "text/plain; version=0.0.4": {"schema": {"type": "string"}},
            "application/openmetrics-text; version=1.0.0": {"schema": {"type": "string"}},
        },
    },
    **responses(403),
}


@router.get("/metrics", response_model=MetricsOut, responses=_METRICS_RESPONSES)
async def metrics(request: Request, response: Response, svc: ServicesDep, who: CallerDep) -> Any:
    """Queue counters in ArQueue's names, and p50/p95/p99 (ms) of queue wait, processing and
    end-to-end time over the last 1,000 jobs the store saw complete.

    **Prometheus**: the same path answers a scraper in its own format, chosen by ``Accept``:
    ``text/plain`` (the text format, version 0.0.4 unless a later one is asked for) or
    ``application/openmetrics-text`` (OpenMetrics). No ``Accept``, ``*/*`` or
    ``application/json`` keeps this JSON answer. The exposition needs an **admin** key
    (``Authorization: Bearer`` in the scrape config): its queue-level series (depths by
    state, the engine's counters, flow gates, pressure, every budget) are not one tenant's.
    It adds this API's own series (requests, latency, submissions by outcome), summed over
    all processes of ``sluice serve -p N``. See docs/architecture.md, Metrics."""
    response.headers["Vary"] = "Accept"
    accept = request.headers.get("accept")
    if wants_prometheus(accept):
        if not who.admin:
            raise ApiError(403, "the Prometheus exposition needs an admin key (sluice keys create --admin)")
        body, content_type = await exposition(svc, accept or "")
        return Response(body, media_type=content_type, headers={"Vary": "Accept"})
    c = await svc.queue.counts()
    workers = await svc.queue.workers()
    latency = await svc.store.latency_percentiles(who.tenant, last=1000)
    return MetricsOut(
        concurrency=sum(w.concurrency or 0 for w in workers),
        active_loops=c["active"],
        total_jobs_in_queue=c["waiting"],
        jobs_done=c["completed"],
        jobs_failed=c["failed"],
        jobs_retried=c["retried"],
        queue_pending=c["waiting"],
        queue_processing=c["active"],
        queue_dead_letter=c["dead"],
        queue_delayed=c["delayed"],
        latency_ms=latency,
    )
