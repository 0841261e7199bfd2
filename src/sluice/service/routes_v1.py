"""Our own routes, under ``/v1``: jobs (create one or many, get, list, cancel)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from sluice.engine.backoff import DEFAULT_BACKOFF
from sluice.service.context import AdmittedDep, Caller, CallerDep, Services, ServicesDep
from sluice.service.errors import ENGINE_ERRORS, ApiError, engine_error, responses
from sluice.service.schemas import AttemptOut, JobIn, JobOut, JobsIn, JobsOut
from sluice.service.submit import backoff_json
from sluice.store.job import FINAL, STATUSES, NewJob, StoredJob

router = APIRouter(prefix="/v1", tags=["jobs"], responses=responses(401, 404, 413, 422, 429, 503))


def job_out(job: StoredJob, *, created: bool | None = None, attempts: bool = False) -> JobOut:
    return JobOut(
        id=str(job.id),
        type=job.type,
        status=job.status,
        queue=job.queue,
        priority=job.priority,
        attempts=job.attempts,
        max_attempts=job.max_attempts,
        payload=job.payload,
        result=job.result,
        error=job.error,
        idempotency_key=job.idempotency_key,
        correlation_id=job.correlation_id,
        tokens=job.tokens,
        budget=job.budget,
        spent=job.spent,
        created_at=job.created_at,
        updated_at=job.updated_at,
        processed_at=job.processed_at,
        completed_at=job.completed_at,
        created=created,
        attempt_list=[AttemptOut.model_validate(a, from_attributes=True) for a in job.attempt_list]
        if attempts
        else None,
    )


def parse_id(job_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(job_id)
    except ValueError:
        raise ApiError(404, f"no job {job_id!r} (job ids are UUIDs)", field="id") from None


def new_job(body: JobIn, tenant: str, queue: str, correlation_id: str | None) -> NewJob:
    return NewJob(
        tenant=tenant,
        queue=queue,
        type=body.type,
        payload=body.payload,
        priority=body.priority,
        max_attempts=body.max_attempts,
        backoff=backoff_json(DEFAULT_BACKOFF),
        delay_ms=body.delay_ms,
        idempotency_key=body.idempotency_key,
        correlation_id=correlation_id,
        tokens=body.tokens,
        budget=body.budget,
    )


@router.post(
    "/jobs",
    status_code=201,
    response_model=JobOut,
    response_model_exclude_none=False,
    responses={200: {"model": JobOut, "description": "The earlier job with this idempotency key"}},
)
async def create_job(
    body: JobIn,
    request: Request,
    response: Response,
    svc: ServicesDep,
    who: CallerDep,
    _admitted: AdmittedDep,
) -> JobOut:
    """Accept one job: stored, then enqueued. The same idempotency key again returns the first
    job (``created: false``), with 200."""
    out = await accept_job(svc, who, body, request.state.request_id)
    if not out.created:
        response.status_code = 200
    return out


async def accept_job(svc: Services, who: Caller, body: JobIn, request_id: str) -> JobOut:
    """``POST /v1/jobs`` once the caller is known and admitted (the route's and the fast lane's)."""
    stored, created = await svc.intake.submit(new_job(body, who.tenant, svc.settings.queue, request_id))
    return job_out(stored, created=created)


@router.post("/jobs/batch", status_code=201, response_model=JobsOut)
async def create_jobs(
    body: JobsIn, request: Request, svc: ServicesDep, who: CallerDep, _admitted: AdmittedDep
) -> JobsOut:
    """Accept many jobs, each as ``POST /v1/jobs`` would (in order; a failing one stops the rest
    and says which)."""
    correlation = request.state.request_id
    out = []
    for i, item in enumerate(body.jobs):
        try:
            stored, created = await svc.intake.submit(
                new_job(item, who.tenant, svc.settings.queue, correlation)
            )
        except ENGINE_ERRORS as exc:
            # The status POST /v1/jobs would answer for this job; the message says which it was.
            err = engine_error(exc)
            field = f"jobs.{i}.{err.field}" if err.field else f"jobs.{i}"
            message = f"jobs[{i}]: {err.message}; the jobs before it were accepted"
            raise ApiError(err.status, message, code=err.code, field=field, headers=err.headers) from exc
        out.append(job_out(stored, created=created))
    return JobsOut(jobs=out, next_cursor=None)


@router.get("/jobs/{job_id}", response_model=JobOut)
async def get_job(job_id: str, svc: ServicesDep, who: CallerDep) -> JobOut:
    """One job, with its attempts."""
    job = await svc.store.get(parse_id(job_id), tenant=who.tenant, attempts=True)
    if job is None:
        raise ApiError(404, f"no job {job_id!r}")
    return job_out(job, attempts=True)


@router.get("/jobs", response_model=JobsOut)
async def list_jobs(
    svc: ServicesDep,
    who: CallerDep,
    status: Annotated[str | None, Query(description=f"One of {', '.join(STATUSES)}")] = None,
    type: Annotated[str | None, Query(max_length=100)] = None,
    queue: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
) -> JobsOut:
    """The caller's jobs, newest first; pass ``next_cursor`` back as ``cursor`` for the next page."""
    if status is not None and status not in STATUSES:
        raise ApiError(422, f"status must be one of {', '.join(STATUSES)}, got {status!r}", field="status")
    page = await svc.store.list_jobs(
        who.tenant, status=status, type=type, queue=queue, limit=limit, cursor=cursor
    )
    return JobsOut(jobs=[job_out(j) for j in page.jobs], next_cursor=page.next_cursor)


@router.post("/jobs/{job_id}/cancel", response_model=JobOut, responses=responses(409))
async def cancel_job(job_id: str, svc: ServicesDep, who: CallerDep) -> JobOut:
    """Cancel a job: at once if it waits, at its next lease renewal if it runs. A finished job
    is a 409."""
    job = await svc.store.get(parse_id(job_id), tenant=who.tenant)
    if job is None:
        raise ApiError(404, f"no job {job_id!r}")
    if job.status in FINAL:
        raise ApiError(409, f"job {job_id} is {job.status}; only an unfinished job can be cancelled")
    engine_id = await svc.store.engine_id(job.id)
    # Ahead: a job stored but not enqueued yet (its batch is on its way to Redis, or Redis lost
    # it) is cancelled before its add, which then adds nothing.
    await svc.queue.cancel(engine_id, ahead=engine_id == str(job.id))
    return job_out(job)
