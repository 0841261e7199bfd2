"""Jobs and their attempts.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("engine_id", sa.BigInteger(), nullable=True),
        sa.Column("epoch", sa.Text(), nullable=True),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("correlation_id", sa.Text(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("budget", sa.Text(), nullable=True),
        sa.Column("spent", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("cost", sa.Numeric(18, 8), nullable=True),
        sa.Column("delay_ms", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("backoff", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("ev_ms", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("ev_seq", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )
    op.create_index("ix_jobs_queue_engine_id", "jobs", ["queue", "engine_id"])
    op.create_index(
        "ix_jobs_tenant_created", "jobs", ["tenant", sa.text("created_at DESC"), sa.text("id DESC")]
    )
    op.create_index(
        "ix_jobs_tenant_status_created",
        "jobs",
        ["tenant", "status", sa.text("created_at DESC"), sa.text("id DESC")],
    )
    op.create_index(
        "ix_jobs_tenant_type_created",
        "jobs",
        ["tenant", "type", sa.text("created_at DESC"), sa.text("id DESC")],
    )
    op.create_index(
        "ix_jobs_unfinished",
        "jobs",
        ["queue", "updated_at"],
        postgresql_where=sa.text("status IN ('QUEUED', 'PROCESSING', 'FAILED', 'PARKED')"),
    )
    op.create_table(
        "job_attempts",
        sa.Column("job_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name="fk_job_attempts_job_id_jobs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "token", name="pk_job_attempts"),
    )


def downgrade() -> None:
    op.drop_table("job_attempts")
    op.drop_index("ix_jobs_unfinished", table_name="jobs")
    op.drop_index("ix_jobs_tenant_type_created", table_name="jobs")
    op.drop_index("ix_jobs_tenant_status_created", table_name="jobs")
    op.drop_index("ix_jobs_tenant_created", table_name="jobs")
    op.drop_index("ix_jobs_queue_engine_id", table_name="jobs")
    op.drop_table("jobs")
