"""Request and response bodies (pydantic), for our ``/v1`` routes and the compatibility routes.

Every request model forbids fields it does not know: a typo is a 422 that
names the field, not a setting silently ignored. ``/v1`` uses snake_case and
the engine's meaning of priority (0 runs first); the compatibility models
keep the reference designs' names, defaults and priorities exactly.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from sluice.engine.job import MAX_ATTEMPTS, MAX_PRIORITY, MAX_TOKENS

JobType = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,100}$")]
BudgetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,100}$")]
IdempotencyKey = Annotated[str, StringConstraints(min_length=1, max_length=200)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- /v1 ---------------------------------------------------------------------------------------------
class JobIn(_Strict):
    """A job to run."""

    type: JobType = Field(description="The handler that runs it (e.g. generic, email, llm-inference)")
    payload: dict[str, Any] = Field(default_factory=dict, description="Handed to the handler as JSON")
    priority: int = Field(0, ge=0, le=MAX_PRIORITY, description="0 runs first; FIFO among equals")
    max_attempts: int = Field(3, ge=1, le=MAX_ATTEMPTS)
    delay_ms: int = Field(0, ge=0, le=366 * 86_400_000, description="Run no sooner than this from now")
    idempotency_key: IdempotencyKey | None = Field(
        None, description="A second job with this key (same tenant) returns the first"
    )
    tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="Token estimate (prompt + max output)")
    budget: BudgetName | None = Field(None, description="The budget it spends from (needs tokens >= 1)")


class JobsIn(_Strict):
    jobs: list[JobIn] = Field(min_length=1, max_length=1000)


class AttemptOut(BaseModel):
    token: int
    attempt: int
    worker: str | None
    started_at: datetime
    finished_at: datetime | None
    outcome: str | None
    error: str | None


class JobOut(BaseModel):
    id: str
    type: str
    status: str
    queue: str
    priority: int
    attempts: int
    max_attempts: int
    payload: Any
    result: Any
    error: str | None
    idempotency_key: str | None
    correlation_id: str | None
    tokens: int
    budget: str | None
    spent: int
    created_at: datetime
    updated_at: datetime
    processed_at: datetime | None
    completed_at: datetime | None
    #: whether this call created it (False: its idempotency key named an earlier job)
    created: bool | None = None
    attempt_list: list[AttemptOut] | None = None


class JobsOut(BaseModel):
    jobs: list[JobOut]
    next_cursor: str | None


class ErrorDetail(BaseModel):
    status: int
    code: str
    message: str
    field: str | None = None


class ErrorOut(BaseModel):
    statusCode: int  # noqa: N815 - the NestJS design's name
    message: str
    error: ErrorDetail


# ---- the NestJS job service (POST /jobs, GET /jobs/{id}) -----------------------------------------------
#: Its priority names and numbers: a lower number runs first.
NEST_PRIORITIES = {1: "CRITICAL", 5: "HIGH", 10: "NORMAL", 20: "LOW"}


class NestJobIn(_Strict):
    type: JobType
    payload: dict[str, Any]
    idempotencyKey: IdempotencyKey | None = None  # noqa: N815
    priority: Literal[1, 5, 10, 20] = 10
    maxAttempts: int = Field(10, ge=1, le=MAX_ATTEMPTS)  # noqa: N815
    delay: int = Field(0, ge=0, le=366 * 86_400_000, description="ms")


class NestJobOut(BaseModel):
    id: str
    type: str
    status: str
    priority: int
    attempts: int
    maxAttempts: int  # noqa: N815
    payload: Any
    idempotencyKey: str | None  # noqa: N815
    createdAt: datetime  # noqa: N815
    updatedAt: datetime  # noqa: N815
    processedAt: datetime | None  # noqa: N815
    completedAt: datetime | None  # noqa: N815
    error: str | None
    result: Any


# ---- ArQueue (POST /enqueue) ------------------------------------------------------------------------------
class ArqTaskIn(_Strict):
    type: JobType
    payload: dict[str, Any]
    maxRetries: int = Field(3, ge=0, le=10)  # noqa: N815
    idempotencyKey: IdempotencyKey | None = None  # noqa: N815
