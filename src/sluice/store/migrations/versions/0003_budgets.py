"""The ledger's copy: budgets.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("limit", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("used", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("win", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("win_ms", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("parent", sa.Text(), nullable=True),
        sa.Column("credit", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("credit_p", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("snapshot_ms", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("restored_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("queue", "name", name="pk_budgets"),
    )


def downgrade() -> None:
    op.drop_table("budgets")
