"""One job id: the engine takes the store's id, so ``job_states.engine_id`` goes.

A job enqueued by an earlier version has an engine id of its own (the queue's
sequence number) for as long as the engine holds it. The migration keeps that
id for the jobs that are not finished, in ``job_legacy_ids``, which nothing
adds to: the reconciler and the routes that reach into the engine (cancel,
redrive) look a job up there first while it is not empty. Downgrading puts the
ids kept there back on their rows; jobs enqueued since have none (the earlier
version then finds them by their engine idempotency key, ``job:<uuid>``).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_legacy_ids",
        sa.Column("job_id", UUID(as_uuid=True), primary_key=True),
        sa.Column("engine_id", sa.BigInteger(), nullable=False),
    )
    op.execute(
        "INSERT INTO job_legacy_ids (job_id, engine_id) SELECT id, engine_id FROM job_states "
        "WHERE engine_id IS NOT NULL AND status IN ('QUEUED', 'PROCESSING', 'FAILED', 'PARKED')"
    )
    op.drop_column("job_states", "engine_id")


def downgrade() -> None:
    op.add_column("job_states", sa.Column("engine_id", sa.BigInteger(), nullable=True))
    op.execute("UPDATE job_states s SET engine_id = l.engine_id FROM job_legacy_ids l WHERE l.job_id = s.id")
    op.drop_table("job_legacy_ids")
