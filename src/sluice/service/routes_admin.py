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
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, BeforeValidator, Field

from sluice.engine.budget_state import MAX_ROLLING_SECONDS, BudgetState
from sluice.engine.flow import FlowState
from sluice.errors import BudgetExists
from sluice.service.context import AdminDep, CallerDep, ServicesDep
from sluice.service.errors import ApiError, responses
from sluice.service.routes_v1 import job_out
from sluice.service.schemas import BUDGET_NAME, BudgetName, Float, Int, JobsOut, _Strict, json_number
from sluice.store.job import StoredJob
from sluice.store.jobs import MAX_PAGE

router = APIRouter(prefix="/v1", tags=["operations"], responses=responses(401, 403, 413, 429, 503))

#: The engine's pattern for an operation id (budgets' op_id).
_OP_ID = r"^[A-Za-z0-9_.:-]{1,200}$"
BudgetPath = Annotated[str, Path(pattern=BUDGET_NAME, description="The budget's name")]
#: (The bounds before the validator: after it, they are left out of the JSON schema.)
RollingSeconds = Annotated[float, Field(ge=1, le=MAX_ROLLING_SECONDS), BeforeValidator(json_number)]


class IdsIn(_Strict):
    ids: list[str] | None = Field(
        None, max_length=10_000, description="Job ids; none: every dead job of yours"
    )


class ThrottleIn(_Strict):
    seconds: Float = Field(ge=0, le=86_400, description="Dispatch nothing for this long; 0 lifts it")


class BudgetIn(_Strict):
    name: BudgetName
    limit: Int = Field(ge=0, le=10**12)
    window: Literal["day", "month"] | RollingSeconds | None = Field(
        None, description='"day", "month" (UTC calendar), a rolling number of seconds, or none'
    )
    parent: BudgetName | None = Field(None, description="An existing budget, not this one")


class CreditIn(_Strict):
    tokens: Int = Field(ge=1, le=10**12)
    op_id: str | None = Field(
        None, pattern=_OP_ID, description="Send the same one on every retry: applied once"
    )


class QueueOut(BaseModel):
    queue: str
    #: jobs per state now, and counters since the queue began
    counts: dict[str, int]
    flow: FlowState


class CreditOut(BaseModel):
    budget: str
    limit: int
    credit: int
    #: False: this op_id was applied before, and nothing changed now
    applied: bool
    state: BudgetState


@router.get("/dead-letters", response_model=JobsOut, responses=responses(422))
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
    legacy = await svc.store.legacy_engine_ids([j.id for j in jobs])
    engine_ids = [legacy.get(j.id, str(j.id)) for j in jobs]
    found = await svc.queue.get_jobs(engine_ids)
    return [r.id for r in found if r is not None and r.state.value == "dead"]


@router.post("/dead-letters/redrive", responses=responses(404, 409, 422))
async def redrive(body: IdsIn, svc: ServicesDep, who: AdminDep) -> dict[str, int]:
    """Run dead jobs again from their first attempt (admin)."""
    ids = await _dead_engine_ids(svc, who.tenant, body.ids)
    return {"redriven": await svc.queue.redrive(ids) if ids else 0}


@router.post("/dead-letters/purge", responses=responses(404, 409, 422))
async def purge(body: IdsIn, svc: ServicesDep, who: AdminDep) -> dict[str, int]:
    """Delete dead jobs from the queue for good (admin); the store keeps their history."""
    ids = await _dead_engine_ids(svc, who.tenant, body.ids)
    return {"purged": await svc.queue.purge_dead(ids) if ids else 0}


@router.get("/queue", response_model=QueueOut)
async def queue_state(svc: ServicesDep, who: CallerDep) -> QueueOut:
    """The queue's counts (jobs per state, counters since it began) and its flow controls."""
    return QueueOut(queue=svc.queue.name, counts=await svc.queue.counts(), flow=await svc.queue.flow())


@router.post("/queue/pause", response_model=FlowState)
async def pause(svc: ServicesDep, who: AdminDep) -> FlowState:
    """Dispatch nothing until resumed; running jobs go on (admin)."""
    await svc.queue.pause()
    return await svc.queue.flow()


@router.post("/queue/resume", response_model=FlowState)
async def resume(svc: ServicesDep, who: AdminDep) -> FlowState:
    """Undo a pause (admin)."""
    await svc.queue.resume()
    return await svc.queue.flow()


@router.post("/queue/throttle", response_model=FlowState, responses=responses(422))
async def throttle(body: ThrottleIn, svc: ServicesDep, who: AdminDep) -> FlowState:
    """Dispatch nothing for ``seconds`` (admin); 0 lifts the throttle."""
    await svc.queue.throttle(body.seconds)
    return await svc.queue.flow()


@router.get("/budgets/{name}", response_model=BudgetState, responses=responses(404, 422))
async def budget(name: BudgetPath, svc: ServicesDep, who: AdminDep) -> BudgetState:
    """A budget as it stands now (admin)."""
    return await svc.queue.budgets.get(name)


@router.post("/budgets", status_code=201, response_model=BudgetState, responses=responses(404, 409, 422))
async def create_budget(body: BudgetIn, svc: ServicesDep, who: AdminDep) -> BudgetState:
    """Create a budget (admin); 409 if it exists, 404 if its parent does not. The store keeps
    a copy of it from now on (rebuilt from there if Redis loses it)."""
    try:
        made = await svc.queue.budgets.create(body.name, body.limit, window=body.window, parent=body.parent)
    except BudgetExists as exc:
        raise ApiError(409, str(exc), field="name") from None
    await svc.ledger.remember(body.name)
    svc.metrics_cache.pop("budgets", None)  # the list of names (live.py, metrics.py) has one more
    return made


@router.post("/budgets/{name}/credit", response_model=CreditOut, responses=responses(404, 422))
async def credit_budget(name: BudgetPath, body: CreditIn, svc: ServicesDep, who: AdminDep) -> CreditOut:
    """A one-off credit to the budget's current window (admin); ``op_id`` makes a retry safe."""
    change = await svc.queue.budgets.credit(name, body.tokens, op_id=body.op_id)
    return CreditOut(**dataclasses.asdict(change), state=await svc.queue.budgets.get(name))
