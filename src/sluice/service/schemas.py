"""Request and response bodies (pydantic), for our ``/v1`` routes and the compatibility routes.

Every request model forbids fields it does not know: a typo is a 422 that
names the field, not a setting silently ignored. A number field takes JSON
numbers only: ``true`` or ``"5"`` is a 422 too, not taken for 1 or 5, so the
service takes what /openapi.json describes and nothing else. ``/v1`` uses snake_case and
the engine's meaning of priority (0 runs first); the compatibility models
keep the reference designs' names, defaults and priorities exactly.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints
from pydantic_core import PydanticCustomError

from sluice.engine.codec import encode
from sluice.engine.job import MAX_ATTEMPTS, MAX_PRIORITY, MAX_TOKENS
from sluice.errors import PayloadNotSerializable


def json_number(value: object) -> object:
    """Pydantic's lax mode takes ``true`` for 1 and ``"5"`` for 5; JSON Schema's numbers do not
    (and its integers include 5.0, which strict mode refuses, so lax mode with this check)."""
    if isinstance(value, bool | str):
        got = "a boolean" if isinstance(value, bool) else "a string"
        raise PydanticCustomError("number_type", "Input should be a number, not {got}", {"got": got})
    return value


def _carried(payload: dict[str, Any]) -> dict[str, Any]:
    """A payload the queue can carry and the store can keep, checked before the job is stored.

    JSON allows what the engine (integers past 64 bits, lone surrogates) or PostgreSQL (NUL in
    a string) cannot take. Refused only when it was enqueued, the job was stored all the same:
    QUEUED for good, and the reconciler's passes failed at it again and again.
    """
    try:
        encode(payload)
    except PayloadNotSerializable as exc:
        raise PydanticCustomError(
            "payload_type",
            "Input should be JSON the queue can carry ({reason}); integers may have 64 bits at most",
            {"reason": str(exc.__cause__ or exc)},
        ) from None
    if _holds_nul(payload):
        raise PydanticCustomError("payload_nul", "Input should hold no NUL character (\\u0000)")
    return payload


def _holds_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any("\x00" in k or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(v) for v in value)
    return False


#: Integers and numbers as JSON Schema means them.
Int = Annotated[int, BeforeValidator(json_number)]
Float = Annotated[float, BeforeValidator(json_number)]
Payload = Annotated[
    dict[str, Any],
    AfterValidator(_carried),
    Field(description="Handed to the handler as JSON (integers of 64 bits at most, no NUL in strings)"),
]

JobType = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,100}$")]
#: A budget's name, as the engine takes it (the pattern for a path parameter too).
BUDGET_NAME = r"^[A-Za-z0-9_.:-]{1,100}$"
BudgetName = Annotated[str, StringConstraints(pattern=BUDGET_NAME)]
#: Any text but NUL, which PostgreSQL cannot keep.
IdempotencyKey = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\u0000]*$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- /v1 ---------------------------------------------------------------------------------------------
class JobIn(_Strict):
    """A job to run."""

    # The engine's rule, in the schema too: a job that spends from a budget brings an estimate.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"required": ["budget"], "properties": {"budget": {"type": "string"}}},
            "then": {"required": ["tokens"], "properties": {"tokens": {"minimum": 1}}},
        }
    )

    type: JobType = Field(description="The handler that runs it (e.g. generic, email, llm-inference)")
    payload: Payload = Field(default_factory=dict)
    priority: Int = Field(0, ge=0, le=MAX_PRIORITY, description="0 runs first; FIFO among equals")
    max_attempts: Int = Field(3, ge=1, le=MAX_ATTEMPTS)
    delay_ms: Int = Field(0, ge=0, le=366 * 86_400_000, description="Run no sooner than this from now")
    idempotency_key: IdempotencyKey | None = Field(
        None, description="A second job with this key (same tenant) returns the first"
    )
    tokens: Int = Field(0, ge=0, le=MAX_TOKENS, description="Token estimate (prompt + max output)")
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


class FieldError(BaseModel):
    field: str
    message: str
    type: str


class ErrorDetail(BaseModel):
    status: int
    code: str
    message: str
    field: str | None = None
    #: every invalid field (422 for a body or parameter that breaks the schema)
    details: list[FieldError] | None = None


class ErrorOut(BaseModel):
    statusCode: int  # noqa: N815 - the NestJS design's name
    message: str
    error: ErrorDetail


# ---- the NestJS job service (POST /jobs, GET /jobs/{id}) -----------------------------------------------
#: Its priority names and numbers: a lower number runs first.
NEST_PRIORITIES = {1: "CRITICAL", 5: "HIGH", 10: "NORMAL", 20: "LOW"}


class NestJobIn(_Strict):
    type: JobType
    payload: Payload
    idempotencyKey: IdempotencyKey | None = None  # noqa: N815
    priority: Annotated[Literal[1, 5, 10, 20], BeforeValidator(json_number)] = 10
    maxAttempts: Int = Field(10, ge=1, le=MAX_ATTEMPTS)  # noqa: N815
    delay: Int = Field(0, ge=0, le=366 * 86_400_000, description="ms")


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
    payload: Payload
    maxRetries: Int = Field(3, ge=0, le=10)  # noqa: N815
    idempotencyKey: IdempotencyKey | None = None  # noqa: N815


class ArqEnqueued(BaseModel):
    taskId: str  # noqa: N815
    #: jobs waiting in the queue now
    queueLength: int  # noqa: N815
    requestId: str  # noqa: N815


class ArqDeadTask(BaseModel):
    id: str
    type: str
    payload: Any
    retries: int
    maxRetries: int  # noqa: N815
    lastError: str | None  # noqa: N815
    #: Unix ms
    createdAt: int  # noqa: N815
    startedAt: int | None  # noqa: N815


class PressureOut(BaseModel):
    score: float
    refusing: bool
    depth: int
    drainRatePerSecond: float  # noqa: N815
    backlogSeconds: float | None  # noqa: N815
    maxBacklogSeconds: float  # noqa: N815
    maxDepth: int  # noqa: N815
    retryAfterSeconds: int | None  # noqa: N815


class MetricsOut(BaseModel):
    concurrency: int
    active_loops: int
    total_jobs_in_queue: int
    jobs_done: int
    jobs_failed: int
    jobs_retried: int
    queue_pending: int
    queue_processing: int
    queue_dead_letter: int
    queue_delayed: int
    #: queue_wait, processing, end_to_end: {p50, p95, p99} in ms; sample: {jobs}
    latency_ms: dict[str, dict[str, float | None]]
