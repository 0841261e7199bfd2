"""The reference designs' routes, with their field names, defaults and status codes.

The NestJS job service: ``POST /jobs`` (201 with the record; the same
``idempotencyKey`` again returns the first job, also 201, as that design
does) and ``GET /jobs/{id}``. Its priorities are 1 (CRITICAL), 5 (HIGH), 10
(NORMAL, the default) and 20 (LOW), lower first, which is the engine's order
too; its retries wait 1000 * 2^attempt ms.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from sluice.service.context import AdmittedDep, Caller, CallerDep, Services, ServicesDep
from sluice.service.errors import ApiError, responses
from sluice.service.routes_v1 import parse_id
from sluice.service.schemas import NestJobIn, NestJobOut
from sluice.service.submit import NEST_BACKOFF, backoff_json
from sluice.store.job import NewJob, StoredJob

NEST_BACKOFF_JSON = backoff_json(NEST_BACKOFF)

router = APIRouter(tags=["compatibility: NestJS job service"], responses=responses(401, 413, 422, 429, 503))


def nest_out(job: StoredJob) -> NestJobOut:
    return NestJobOut(
        id=str(job.id),
        type=job.type,
        status=job.status,
        priority=job.priority,
        attempts=job.attempts,
        maxAttempts=job.max_attempts,
        payload=job.payload,
        idempotencyKey=job.idempotency_key,
        createdAt=job.created_at,
        updatedAt=job.updated_at,
        processedAt=job.processed_at,
        completedAt=job.completed_at,
        error=job.error,
        result=job.result,
    )


@router.post("/jobs", status_code=201, response_model=NestJobOut)
async def nest_create(
    body: NestJobIn, request: Request, svc: ServicesDep, who: CallerDep, _admitted: AdmittedDep
) -> NestJobOut:
    """Create a job (NestJS design). A repeated ``idempotencyKey`` returns the first job, with 201."""
    return await accept_nest(svc, who, body, request.state.request_id)


async def accept_nest(svc: Services, who: Caller, body: NestJobIn, request_id: str) -> NestJobOut:
    """``POST /jobs`` once the caller is known and admitted (the route's and the fast lane's)."""
    new = NewJob(
        tenant=who.tenant,
        queue=svc.settings.queue,
        type=body.type,
        payload=body.payload,
        priority=body.priority,
        max_attempts=body.maxAttempts,
        backoff=NEST_BACKOFF_JSON,
        delay_ms=body.delay,
        idempotency_key=body.idempotencyKey,
        correlation_id=request_id,
    )
    stored, _ = await svc.intake.submit(new)
    return nest_out(stored)


@router.get("/jobs/{job_id}", response_model=NestJobOut, responses=responses(404))
async def nest_get(job_id: str, svc: ServicesDep, who: CallerDep) -> NestJobOut:
    """A job by id (NestJS design): 404 if it does not exist or is another tenant's."""
    job = await svc.store.get(parse_id(job_id), tenant=who.tenant)
    if job is None:
        raise ApiError(404, f"Job {job_id} not found")
    return nest_out(job)
