"""The semantic cache: answers by tenant, scope and prompt, with their embeddings (pgvector).

Needs the pgvector extension (the embedded PostgreSQL has it); a server
without it fails here with what to install, rather than later at a lookup.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from pgvector.sqlalchemy import Vector
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DIMENSIONS = 384


def upgrade() -> None:
    bind = op.get_bind()
    available = bind.execute(sa.text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")).first()
    if available is None:
        raise RuntimeError(
            "the store needs the pgvector extension for the semantic cache, and this PostgreSQL "
            "server does not have it: install pgvector (https://github.com/pgvector/pgvector#installation, "
            "or the postgresql-16-pgvector package), or let `sluice dev` run its embedded PostgreSQL"
        )
    op.execute("CREATE EXTENSION IF NOT EXISTS vector")
    op.create_table(
        "llm_cache",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("prompt_hash", sa.Text(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("embedder", sa.Text(), nullable=False),
        sa.Column("embedding", Vector(DIMENSIONS), nullable=False),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_llm_cache"),
        sa.UniqueConstraint("tenant", "scope", "prompt_hash", name="uq_llm_cache_tenant_scope_prompt_hash"),
    )
    op.create_index(
        "ix_llm_cache_embedding",
        "llm_cache",
        ["embedding"],
        postgresql_using="hnsw",
        postgresql_with={"m": 16, "ef_construction": 64},
        postgresql_ops={"embedding": "vector_cosine_ops"},
    )
    op.create_index("ix_llm_cache_expires_at", "llm_cache", ["expires_at"])


def downgrade() -> None:
    op.drop_table("llm_cache")
