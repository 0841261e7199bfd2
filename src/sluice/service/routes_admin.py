"""Operators' routes under ``/v1``: the dead-letter queue, the queue's gates, budgets.

Reading the queue's counts is open to any key; everything that changes the
queue (redrive, purge, pause, resume, throttle) or reads and changes budgets
needs an admin key. Dead-letter routes act on the caller's tenant's jobs
only: a redrive or purge without ids means "all of my dead jobs", never
another tenant's.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import Field

from sluice.errors import BudgetExists
from sluice.service.context import AdminDep, CallerDep, ServicesDep
from sluice.service.errors import ApiError
from sluice.service.routes_v1 import job_out
from sluice.service.schemas import BudgetName, ErrorOut, JobsOut, _Strict
from sluice.store.jobs import MAX_PAGE, StoredJob
from sluice.store.sink import engine_key

router = APIRouter(prefix="/v1", tags=["operations"], responses={403: {"model": ErrorOut}})


class IdsIn(_Strict):
    ids: list[str] | None = Field(
        None, max_length=10_000, description="Job ids; none: every dead job of yours"
    )


class ThrottleIn(_Strict):
    seconds: float = Field(ge=0, le=86_400, description="Dispatch nothing for this long; 0 lifts it")


class BudgetIn(_Strict):
    name: BudgetName
    limit: int = Field(ge=0, le=10**12)
    window: str | float | None = Field(
        None, description='"day", "month", a rolling number of seconds, or none'
    )
    parent: BudgetName | None = None


class CreditIn(_Strict):
    tokens: int = Field(ge=1, le=10**12)
    op_id: str | None = Field(
        None, max_length=200, description="Send the same one on every retry: applied once"
    )


@router.get("/dead-letters", response_model=JobsOut)
async def dead_letters(
    svc: ServicesDep,
    who: CallerDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
) -> JobsOut:
    """Your dead-lettered jobs, newest first (each with its last error; GET /v1/jobs/{id} has
    every attempt)."""
    page = await svc.store.list_jobs(who.tenant, status="DEAD_LETTER", limit=limit, cursor=cursor)
    return JobsOut(jobs=[job_out(j) for j in page.jobs], next_cursor=page.next_cursor)


async def _dead_engine_ids(svc: Any, tenant: str, ids: list[str] | None) -> list[str]:
    """Engine ids of the tenant's dead jobs (the ones named, which must all be theirs and dead)."""
    jobs: list[StoredJob] = []
    if ids is None:
        cursor = None
        while True:
            page = await svc.store.list_jobs(tenant, status="DEAD_LETTER", limit=MAX_PAGE, cursor=cursor)
            jobs += page.jobs
            cursor = page.next_cursor
            if cursor is None:
                break
    else:
        for raw in ids:
            try:
                job = await svc.store.get(uuid.UUID(raw), tenant=tenant)
            except ValueError:
                job = None
            if job is None:
                raise ApiError(404, f"no job {raw!r}", field="ids")
            if job.status != "DEAD_LETTER":
                raise ApiError(409, f"job {raw} is {job.status}; only dead-lettered jobs can be", field="ids")
            jobs.append(job)
    found = await svc.queue.get_jobs([str(j.engine_id) for j in jobs if j.engine_id is not None])
    records = {r.id: r for r in found if r is not None}
    out = []
    for job in jobs:
        record = records.get(str(job.engine_id))
        if (
            record is not None
            and record.idempotency_key == engine_key(job.id)
            and record.state.value == "dead"
        ):
            out.append(record.id)
    return out


@router.post("/dead-letters/redrive")
async def redrive(body: IdsIn, svc: ServicesDep, who: AdminDep) -> dict[str, int]:
    """Run dead jobs again from their first attempt (admin)."""
    ids = await _dead_engine_ids(svc, who.tenant, body.ids)
    return {"redriven": await svc.queue.redrive(ids) if ids else 0}


@router.post("/dead-letters/purge")
async def purge(body: IdsIn, svc: ServicesDep, who: AdminDep) -> dict[str, int]:
    """Delete dead jobs from the queue for good (admin); the store keeps their history."""
    ids = await _dead_engine_ids(svc, who.tenant, body.ids)
    return {"purged": await svc.queue.purge_dead(ids) if ids else 0}


@router.get("/queue")
async def queue_state(svc: ServicesDep, who: CallerDep) -> dict[str, Any]:
    """The queue's counts (jobs per state, counters since it began) and its flow controls."""
    return {
        "queue": svc.queue.name,
        "counts": await svc.queue.counts(),
        "flow": dataclasses.asdict(await svc.queue.flow()),
    }


@router.post("/queue/pause")
async def pause(svc: ServicesDep, who: AdminDep) -> dict[str, Any]:
    """Dispatch nothing until resumed; running jobs go on (admin)."""
    await svc.queue.pause()
    return dataclasses.asdict(await svc.queue.flow())


@router.post("/queue/resume")
async def resume(svc: ServicesDep, who: AdminDep) -> dict[str, Any]:
    """Undo a pause (admin)."""
    await svc.queue.resume()
    return dataclasses.asdict(await svc.queue.flow())


@router.post("/queue/throttle")
async def throttle(body: ThrottleIn, svc: ServicesDep, who: AdminDep) -> dict[str, Any]:
    """Dispatch nothing for ``seconds`` (admin); 0 lifts the throttle."""
    await svc.queue.throttle(body.seconds)
    return dataclasses.asdict(await svc.queue.flow())


@router.get("/budgets/{name}")
async def budget(name: str, svc: ServicesDep, who: AdminDep) -> dict[str, Any]:
    """A budget as it stands now (admin)."""
    return dataclasses.asdict(await svc.queue.budgets.get(name))


@router.post("/budgets", status_code=201)
async def create_budget(body: BudgetIn, svc: ServicesDep, who: AdminDep) -> dict[str, Any]:
    """Create a budget (admin); 409 if it exists."""
    try:
        state = await svc.queue.budgets.create(body.name, body.limit, window=body.window, parent=body.parent)
    except BudgetExists as exc:
        raise ApiError(409, str(exc), field="name") from None
    return dataclasses.asdict(state)


@router.post("/budgets/{name}/credit")
async def credit_budget(name: str, body: CreditIn, svc: ServicesDep, who: AdminDep) -> dict[str, Any]:
    """A one-off credit to the budget's current window (admin); ``op_id`` makes a retry safe."""
    change = await svc.queue.budgets.credit(name, body.tokens, op_id=body.op_id)
    return dataclasses.asdict(change) | {"state": dataclasses.asdict(await svc.queue.budgets.get(name))}
