"""Where a job stands moves to a narrow table of its own, ``job_states``; ``jobs`` is written once.

Every transition the sink applied rewrote the job's whole row (payload,
backoff, keys and all) and, because ``status`` is indexed, added an entry to
each of the table's five indexes, although it changed the key of none but
one. Measured with ``benchmarks/store_writes.py`` (the sink's statements on
the 2-core machine), PostgreSQL spent per drained job:

- 38.5 µs of CPU at 100,000 jobs and 67.1 µs at 1,000,000 (the table and
  its dead row versions outgrew PostgreSQL's buffers);
- 21.5 µs and 26.7 µs with the state in a narrow row (status, attempts,
  result, error, times, the last event applied, the engine id, with copies of
  the tenant, queue and creation time for the indexes by status).

Readers of a job join the two tables by primary key. The data is copied, so
an upgrade keeps every job where it stood; a downgrade copies it back.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNFINISHED = "status IN ('QUEUED', 'PROCESSING', 'FAILED', 'PARKED')"
_FAILED = "status IN ('DEAD_LETTER', 'REJECTED', 'EXHAUSTED')"
#: The columns that move.
_MOVED = (
    "status", "engine_id", "attempts", "result", "error", "ev_ms", "ev_seq", "updated_at", "processed_at",
    "completed_at",
)  # fmt: skip


def upgrade() -> None:
    op.create_table(
        "job_states",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("engine_id", sa.BigInteger(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("result", postgresql.JSONB(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("ev_ms", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("ev_seq", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_job_states"),
    )
    op.execute(
        """
        INSERT INTO job_states (id, tenant, queue, created_at, status, engine_id, attempts, result,
                                error, ev_ms, ev_seq, updated_at, processed_at, completed_at)
        SELECT id, tenant, queue, created_at, status, engine_id, attempts, result,
               error, ev_ms, ev_seq, updated_at, processed_at, completed_at
        FROM jobs
        """
    )
    op.create_index(
        "ix_job_states_tenant_status_created",
        "job_states",
        ["tenant", "status", sa.text("created_at DESC"), sa.text("id DESC")],
    )
    op.create_index(
        "ix_job_states_unfinished",
        "job_states",
        ["queue", "updated_at"],
        postgresql_where=sa.text(_UNFINISHED),
    )
    op.create_index(
        "ix_job_states_failed", "job_states", ["updated_at", "id"], postgresql_where=sa.text(_FAILED)
    )
    # The indexes on these columns go with them.
    for column in _MOVED:
        op.drop_column("jobs", column)


def downgrade() -> None:
    op.add_column("jobs", sa.Column("status", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("engine_id", sa.BigInteger(), nullable=True))
    op.add_column("jobs", sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.add_column("jobs", sa.Column("result", postgresql.JSONB(), nullable=True))
    op.add_column("jobs", sa.Column("error", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("ev_ms", sa.BigInteger(), server_default=sa.text("0"), nullable=False))
    op.add_column("jobs", sa.Column("ev_seq", sa.BigInteger(), server_default=sa.text("0"), nullable=False))
    op.add_column("jobs", sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("processed_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(
        """
        UPDATE jobs AS j SET (status, engine_id, attempts, result, error, ev_ms, ev_seq, updated_at,
                              processed_at, completed_at)
            = (s.status, s.engine_id, s.attempts, s.result, s.error, s.ev_ms, s.ev_seq, s.updated_at,
               s.processed_at, s.completed_at)
        FROM job_states s WHERE s.id = j.id
        """
    )
    # A job without a state row (none should be) reads as queued, as it was stored.
    op.execute("UPDATE jobs SET status = 'QUEUED' WHERE status IS NULL")
    op.execute("UPDATE jobs SET updated_at = created_at WHERE updated_at IS NULL")
    op.alter_column("jobs", "status", nullable=False)
    op.alter_column("jobs", "updated_at", nullable=False)
    op.create_index(
        "ix_jobs_tenant_status_created",
        "jobs",
        ["tenant", "status", sa.text("created_at DESC"), sa.text("id DESC")],
    )
    unfinished = sa.text(_UNFINISHED)
    op.create_index("ix_jobs_unfinished", "jobs", ["queue", "updated_at"], postgresql_where=unfinished)
    op.create_index("ix_jobs_failed", "jobs", ["updated_at", "id"], postgresql_where=sa.text(_FAILED))
    op.drop_table("job_states")
