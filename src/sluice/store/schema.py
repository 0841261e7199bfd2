"""The tables of the system of record, as SQLAlchemy 2 models.

The store holds what must outlive Redis: every job the API accepted, every
attempt a worker made, the idempotency keys, and (later) the ledger's copy.
Redis stays the engine; rows here are written by the API (a job, before it is
enqueued) and by the transition sink (what the engine did, from its events
stream), so a job's row may trail Redis by a batch but never loses a step.

Schema changes are Alembic migrations (``store/migrations``); these models
are what the migrations build, and a test compares the two.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pgvector.sqlalchemy import Vector
from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Numeric,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: Dimensions of the semantic cache's vectors (the local embedder's; provider embedders are asked
#: for as many).
CACHE_DIMENSIONS = 384

#: Constraint names spelled out, so that migrations and models name them alike.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class JobRow(Base):
    """One job the service accepted, as it was submitted: written once, never updated.

    What changes as the job runs is in :class:`JobStateRow`, a narrow row of
    its own. A transition used to rewrite this whole row and add an entry to
    each of its indexes, none of whose keys it changed (PostgreSQL cannot
    update a row in place when an indexed column, here ``status``, changes),
    a cost per transition that grows with the row and its indexes
    (``benchmarks/store_writes.py``; migration 0008 and docs/decisions/0012
    have the figures).
    """

    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    tenant: Mapped[str] = mapped_column(Text, nullable=False)
    queue: Mapped[str] = mapped_column(Text, nullable=False)
    epoch: Mapped[str | None] = mapped_column(Text)
    type: Mapped[str] = mapped_column(Text, nullable=False)
    priority: Mapped[int] = mapped_column(Integer, nullable=False)
    max_attempts: Mapped[int] = mapped_column(Integer, nullable=False)
    payload: Mapped[Any] = mapped_column(JSONB, nullable=False)
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    correlation_id: Mapped[str | None] = mapped_column(Text)
    tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    budget: Mapped[str | None] = mapped_column(Text)
    spent: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    cost: Mapped[float | None] = mapped_column(Numeric(18, 8))
    delay_ms: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    backoff: Mapped[Any] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)

    __table_args__ = (
        # One job per key and tenant: concurrent duplicates all receive the winner.
        UniqueConstraint("tenant", "idempotency_key"),
        # The list queries: a tenant's jobs newest first, all of them or by type (by status:
        # ix_job_states_tenant_status_created).
        Index("ix_jobs_tenant_created", "tenant", text("created_at DESC"), text("id DESC")),
        Index("ix_jobs_tenant_type_created", "tenant", "type", text("created_at DESC"), text("id DESC")),
    )


class JobStateRow(Base):
    """Where a job stands: what its transitions change, one row per job (``id`` is the job's).

    ``status`` is the API's view (QUEUED, PROCESSING, COMPLETED, FAILED,
    DEAD_LETTER, CANCELLED, REJECTED, EXHAUSTED, PARKED); the engine knows the
    job by the same id, in ``queue``. ``ev_ms``/``ev_seq`` is the last
    event applied (its stream id): the sink applies an event only if it is
    newer, so redelivered or reordered batches cannot move a job backwards.
    ``tenant``, ``queue`` and ``created_at`` are the job's, copied so that the
    indexes by status need no other table.
    """

    __tablename__ = "job_states"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    tenant: Mapped[str] = mapped_column(Text, nullable=False)
    queue: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    result: Mapped[Any | None] = mapped_column(JSONB)
    error: Mapped[str | None] = mapped_column(Text)
    ev_ms: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    ev_seq: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    processed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        # A tenant's jobs in one status, newest first.
        Index(
            "ix_job_states_tenant_status_created",
            "tenant",
            "status",
            text("created_at DESC"),
            text("id DESC"),
        ),
        # The reconciler's question: which jobs does the store think are not finished?
        Index(
            "ix_job_states_unfinished",
            "queue",
            "updated_at",
            postgresql_where=text("status IN ('QUEUED', 'PROCESSING', 'FAILED', 'PARKED')"),
        ),
    )


class LegacyIdRow(Base):
    """The engine id of a job that an earlier version enqueued under a number of its own and
    that had not finished when the store was migrated (migration 0009); nothing adds rows."""

    __tablename__ = "job_legacy_ids"

    job_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    engine_id: Mapped[int] = mapped_column(BigInteger, nullable=False)


class AttemptRow(Base):
    """One attempt of a job: a lease (``token`` grows with every lease, ``attempt`` is what the
    handler saw), its worker, when it started and ended, and how."""

    __tablename__ = "job_attempts"

    #: the job's id in ``jobs``; not a foreign key, whose check cost more than the rest of
    #: each attempt the sink writes (migration 0007 has the figures); nothing deletes jobs
    job_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    token: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    worker: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: completed, failed, retrying, dead, throttled, released, stalled, cancelled
    outcome: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)


class BudgetRow(Base):
    """The store's copy of one budget of the engine's ledger: its definition and, as of
    ``snapshot_ms`` (Redis's clock), what its window had used.

    Together with the attempts the store records since, this is what a budget
    is rebuilt from when Redis comes back without it (``store/ledger.py``).
    A row with ``snapshot_ms`` 0 is a budget that jobs named but that has not
    been read yet.
    """

    __tablename__ = "budgets"

    queue: Mapped[str] = mapped_column(Text, primary_key=True)
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    limit: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    used: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    #: '' (none), 'day', 'month' or 'roll' (then ``win_ms`` long)
    win: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    win_ms: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    parent: Mapped[str | None] = mapped_column(Text)
    credit: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    #: the window the credit belongs to, as the engine stores it (period, end ms, or 0)
    credit_p: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    snapshot_ms: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    restored_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class CacheEntryRow(Base):
    """One answer of the semantic cache (``llm/cache.py``).

    ``scope`` is a hash of everything besides the prompt that shapes an answer
    (provider, model, generation parameters, the conversation before the last
    message): an entry is found only within its tenant and scope, so no hit
    crosses a tenant or a model. ``prompt_hash`` serves repeats exactly, before
    any embedding; ``embedding`` (unit length, by ``embedder``) the neighbours.
    """

    __tablename__ = "llm_cache"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    tenant: Mapped[str] = mapped_column(Text, nullable=False)
    scope: Mapped[str] = mapped_column(Text, nullable=False)
    prompt_hash: Mapped[str] = mapped_column(Text, nullable=False)
    prompt: Mapped[str] = mapped_column(Text, nullable=False)
    embedder: Mapped[str] = mapped_column(Text, nullable=False)
    embedding: Mapped[Any] = mapped_column(Vector(CACHE_DIMENSIONS), nullable=False)
    response: Mapped[Any] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)

    __table_args__ = (
        # The exact path, and a partition's rows for a scan when it is small.
        UniqueConstraint("tenant", "scope", "prompt_hash"),
        # Nearest neighbours by cosine distance: HNSW, not IVFFlat, because IVFFlat's lists are
        # fixed when the index is built (on an empty table at migration time, so all rows would
        # fall in one list) while HNSW stays accurate as entries come and go.
        Index(
            "ix_llm_cache_embedding",
            "embedding",
            postgresql_using="hnsw",
            postgresql_with={"m": 16, "ef_construction": 64},
            postgresql_ops={"embedding": "vector_cosine_ops"},
        ),
        # The purge: expired entries, oldest first.
        Index("ix_llm_cache_expires_at", "expires_at"),
    )


class ApiKeyRow(Base):
    """An API key: only its SHA-256 is stored (keys are 256 random bits, so a fast hash is
    enough: there is nothing to guess). ``prefix`` is the start of the key, shown in lists so
    that an operator can tell keys apart without seeing them."""

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    tenant: Mapped[str] = mapped_column(Text, nullable=False)
    admin: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    name: Mapped[str | None] = mapped_column(Text)
    prefix: Mapped[str] = mapped_column(Text, nullable=False)
    digest: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


# ---- failure analysis (store/patterns.py, store/collector.py) ----------------------------------------------
class FailurePatternRow(Base):
    """One failure pattern: the jobs of one tenant and queue that ended badly (dead-lettered,
    rejected, exhausted) with the same fingerprint (job type, error type, normalized message).

    ``count`` counts deaths, not jobs (a redriven job that dies again counts again);
    ``sample_job``/``sample_error`` are the latest one's. ``analysis`` is the cached LLM
    explanation (None: none yet), ``analysis_job`` the analysis job while it is pending,
    ``analysis_error`` why the last one failed and ``analysis_tries`` how many did (part of
    the next one's idempotency key, so that asking again after a failure makes a new job).
    """

    __tablename__ = "failure_patterns"

    tenant: Mapped[str] = mapped_column(Text, primary_key=True)
    queue: Mapped[str] = mapped_column(Text, primary_key=True)
    id: Mapped[str] = mapped_column(Text, primary_key=True)
    job_type: Mapped[str] = mapped_column(Text, nullable=False)
    error_type: Mapped[str] = mapped_column(Text, nullable=False)
    message: Mapped[str] = mapped_column(Text, nullable=False)
    category: Mapped[str] = mapped_column(Text, nullable=False)
    count: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    sample_job: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    sample_error: Mapped[str | None] = mapped_column(Text)
    analysis: Mapped[Any | None] = mapped_column(JSONB)
    analysis_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    analysis_job: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    analysis_error: Mapped[str | None] = mapped_column(Text)
    analysis_tries: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))

    __table_args__ = (
        # The pending analyses, which each collector pass settles: few rows, found without a scan.
        Index(
            "ix_failure_patterns_analysis_job",
            "analysis_job",
            postgresql_where=text("analysis_job IS NOT NULL"),
        ),
    )


class FailurePatternJobRow(Base):
    """Which pattern a job was counted into, at which lease (``token``, the highest of its
    attempts then): the collector's proof that a death was counted, so that no job is counted
    twice across passes and restarts, while a redriven job that dies again (a new lease) is.
    ``dead_at`` is the job's ``updated_at`` when counted (where a restarted collector goes on)."""

    __tablename__ = "failure_pattern_jobs"

    job_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    tenant: Mapped[str] = mapped_column(Text, nullable=False)
    queue: Mapped[str] = mapped_column(Text, nullable=False)
    pattern: Mapped[str] = mapped_column(Text, nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False)
    token: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    deaths: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("1"))
    dead_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)

    __table_args__ = (
        # A pattern's jobs, latest death first.
        Index(
            "ix_failure_pattern_jobs_pattern",
            "tenant",
            "queue",
            "pattern",
            text("dead_at DESC"),
            text("job_id DESC"),
        ),
        # Where a collector that starts (or takes the lead) goes on from.
        Index("ix_failure_pattern_jobs_dead_at", "dead_at"),
    )


#: The collector's page over ``job_states``: the jobs that ended badly, in the order they did.
#: Partial, so it holds a few rows per failure and nothing for the jobs that completed. (Declared
#: here, not in ``JobStateRow``, to keep the failure analysis's schema in one place.)
Index(
    "ix_job_states_failed",
    JobStateRow.updated_at,
    JobStateRow.id,
    postgresql_where=text("status IN ('DEAD_LETTER', 'REJECTED', 'EXHAUSTED')"),
)
