"""Drop the attempts' foreign key to jobs: its check cost more than the rest of an attempt's write.

Each attempt the transition sink inserts made PostgreSQL look up its job and
lock it (FOR KEY SHARE) to check the key, although the same transaction had
just updated that row: measured with ``benchmarks/store_writes.py`` (100,000
jobs, medians of three), a drained job cost PostgreSQL 44.4 µs of CPU with the
key and 38.5 µs without it on the 2-core machine. Nothing
deletes jobs (the store keeps their history), so the ``ON DELETE CASCADE`` it
carried never ran; and the sink writes attempts only for jobs the API stored
(their engine idempotency keys name them). Without it, one batch naming a job
whose row is missing writes an orphan attempt instead of failing again and
again with every event after it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_constraint("fk_job_attempts_job_id_jobs", "job_attempts", type_="foreignkey")


def downgrade() -> None:
    # Orphans (attempts of jobs that are not there) would make the key refuse to return.
    op.execute("DELETE FROM job_attempts a WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = a.job_id)")
    op.create_foreign_key(
        "fk_job_attempts_job_id_jobs", "job_attempts", "jobs", ["job_id"], ["id"], ondelete="CASCADE"
    )
