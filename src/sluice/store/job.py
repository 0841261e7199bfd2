"""Jobs as the store holds them: what the API accepted (NewJob), and its rows (StoredJob).

A stored job is two rows, ``jobs`` (as it was submitted, written once) and
``job_states`` (where it stands, which the sink moves), and a row per attempt
in ``job_attempts``; :class:`StoredJob` is the two joined, with its attempts
when they are asked for. :class:`JobStore` (``store/jobs.py``) writes and
reads them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from sluice.store.schema import JobRow, JobStateRow

#: The statuses the API shows, in lifecycle order.
STATUSES = (
    "QUEUED",
    "PARKED",
    "PROCESSING",
    "FAILED",
    "COMPLETED",
    "DEAD_LETTER",
    "CANCELLED",
    "REJECTED",
    "EXHAUSTED",
)
#: Statuses after which a job never changes again.
FINAL = frozenset({"COMPLETED", "DEAD_LETTER", "CANCELLED", "REJECTED", "EXHAUSTED"})
#: The integers the engine's JSON (orjson) carries: int64 and uint64.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _as_sent(value: Any) -> Any:
    """A JSON value read back from jsonb, with its big numbers as they were sent.

    jsonb keeps a number's value, not its spelling: ``4.5e23`` comes back as
    ``450000000000000000000000``, an integer no 64-bit type holds, which the
    engine cannot encode (the job would be stored and never enqueued). The API
    takes no integer that large, so such a number was a float, and is one again.
    Unchanged values are returned as they are (no copy).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value if _INT_MIN <= value <= _INT_MAX else float(value)
    if isinstance(value, dict):
        items = {k: _as_sent(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, list):
        elements = [_as_sent(v) for v in value]
        return value if all(a is b for a, b in zip(elements, value, strict=True)) else elements
    return value


@dataclass(frozen=True, slots=True)
class NewJob:
    """What the API accepted, before it is stored."""

    tenant: str
    queue: str
    type: str
    payload: Any
    priority: int
    max_attempts: int
    backoff: list[Any]
    delay_ms: int = 0
    idempotency_key: str | None = None
    correlation_id: str | None = None
    tokens: int = 0
    budget: str | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    token: int
    attempt: int
    worker: str | None
    started_at: datetime
    finished_at: datetime | None
    outcome: str | None
    error: str | None


@dataclass(frozen=True, slots=True)
class JobRef:
    """A job's id and last update: what the reconciler pages through."""

    id: uuid.UUID
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class StoredJob:
    """A job as the store holds it."""

    id: uuid.UUID
    tenant: str
    queue: str
    type: str
    status: str
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
    delay_ms: int
    backoff: list[Any]
    created_at: datetime
    updated_at: datetime
    processed_at: datetime | None
    completed_at: datetime | None
    attempt_list: tuple[Attempt, ...] = field(default=())

    @classmethod
    def of(cls, row: JobRow, state: JobStateRow, attempts: tuple[Attempt, ...] = ()) -> StoredJob:
        """A job from its two rows: as submitted, and where it stands."""
        return cls(
            id=row.id,
            tenant=row.tenant,
            queue=row.queue,
            type=row.type,
            status=state.status,
            priority=row.priority,
            attempts=state.attempts,
            max_attempts=row.max_attempts,
            payload=_as_sent(row.payload),
            result=_as_sent(state.result),
            error=state.error,
            idempotency_key=row.idempotency_key,
            correlation_id=row.correlation_id,
            tokens=row.tokens,
            budget=row.budget,
            spent=row.spent,
            delay_ms=row.delay_ms,
            backoff=row.backoff,
            created_at=row.created_at,
            updated_at=state.updated_at,
            processed_at=state.processed_at,
            completed_at=state.completed_at,
            attempt_list=attempts,
        )


def new_stored(job_id: uuid.UUID, n: NewJob, at: datetime) -> StoredJob:
    """The row ``JobStore.create_many`` just wrote, without reading it back."""
    return StoredJob(
        id=job_id,
        tenant=n.tenant,
        queue=n.queue,
        type=n.type,
        status="QUEUED",
        priority=n.priority,
        attempts=0,
        max_attempts=n.max_attempts,
        payload=n.payload,
        result=None,
        error=None,
        idempotency_key=n.idempotency_key,
        correlation_id=n.correlation_id,
        tokens=n.tokens,
        budget=n.budget,
        spent=0,
        delay_ms=n.delay_ms,
        backoff=n.backoff,
        created_at=at,
        updated_at=at,
        processed_at=None,
        completed_at=None,
    )


def _json(value: Any) -> Any:
    """A jsonb column from a raw asyncpg record: text, unless the connection decodes it (the
    SQLAlchemy dialect registers a decoder on its connections)."""
    return orjson.loads(value) if isinstance(value, str | bytes) else value


def stored_from_record(r: Any) -> StoredJob:
    """A job from an asyncpg record of its row in ``jobs`` and its state's columns (as
    ``store/jobs.py``'s ``_BY_KEYS`` reads them)."""
    return StoredJob(
        id=r["id"],
        tenant=r["tenant"],
        queue=r["queue"],
        type=r["type"],
        status=r["status"],
        priority=r["priority"],
        attempts=r["attempts"],
        max_attempts=r["max_attempts"],
        payload=_as_sent(_json(r["payload"])),
        result=_as_sent(_json(r["result"])),
        error=r["error"],
        idempotency_key=r["idempotency_key"],
        correlation_id=r["correlation_id"],
        tokens=r["tokens"],
        budget=r["budget"],
        spent=r["spent"],
        delay_ms=r["delay_ms"],
        backoff=_json(r["backoff"]),
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        processed_at=r["processed_at"],
        completed_at=r["completed_at"],
    )
