"""Drop ix_jobs_queue_engine_id: no query looks jobs up by engine id.

The sink finds rows by primary key (it maps engine ids to store ids through
the engine's own records) and the reconciler pages by ``ix_jobs_unfinished``;
the index only cost an entry per submission and another per job's first
transition.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index("ix_jobs_queue_engine_id", table_name="jobs")


def downgrade() -> None:
    op.create_index("ix_jobs_queue_engine_id", "jobs", ["queue", "engine_id"])
