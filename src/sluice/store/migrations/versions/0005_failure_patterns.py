"""Failure patterns: dead-lettered jobs grouped by a fingerprint of their error.

``failure_patterns`` holds one row per (tenant, queue, fingerprint) with its
counts, first/last seen, category and the cached LLM analysis;
``failure_pattern_jobs`` remembers which job was counted into which pattern
and at which lease, so that the collector counts each death once across
restarts (and lets a pattern list its jobs) without a column on ``jobs``;
``ix_jobs_failed``, a partial index of the jobs that ended badly, is the
collector's page (without it each pass would scan every job).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "failure_patterns",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("job_type", sa.Text(), nullable=False),
        sa.Column("error_type", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("category", sa.Text(), nullable=False),
        sa.Column("count", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sample_job", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("sample_error", sa.Text(), nullable=True),
        sa.Column("analysis", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("analysis_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("analysis_job", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("analysis_error", sa.Text(), nullable=True),
        sa.Column("analysis_tries", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "queue", "id", name="pk_failure_patterns"),
    )
    op.create_index(
        "ix_failure_patterns_analysis_job",
        "failure_patterns",
        ["analysis_job"],
        postgresql_where=sa.text("analysis_job IS NOT NULL"),
    )
    op.create_table(
        "failure_pattern_jobs",
        sa.Column("job_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("pattern", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("token", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("deaths", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("dead_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name="fk_failure_pattern_jobs_job_id_jobs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", name="pk_failure_pattern_jobs"),
    )
    op.create_index(
        "ix_failure_pattern_jobs_pattern",
        "failure_pattern_jobs",
        ["tenant", "queue", "pattern", sa.text("dead_at DESC"), sa.text("job_id DESC")],
    )
    op.create_index("ix_failure_pattern_jobs_dead_at", "failure_pattern_jobs", ["dead_at"])
    # The collector's page: jobs that ended badly, in the order they did (a partial index: a few
    # rows per failure, nothing for the jobs that completed).
    op.create_index(
        "ix_jobs_failed",
        "jobs",
        ["updated_at", "id"],
        postgresql_where=sa.text("status IN ('DEAD_LETTER', 'REJECTED', 'EXHAUSTED')"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_failed", table_name="jobs")
    op.drop_index("ix_failure_pattern_jobs_dead_at", table_name="failure_pattern_jobs")
    op.drop_index("ix_failure_pattern_jobs_pattern", table_name="failure_pattern_jobs")
    op.drop_table("failure_pattern_jobs")
    op.drop_index("ix_failure_patterns_analysis_job", table_name="failure_patterns")
    op.drop_table("failure_patterns")
