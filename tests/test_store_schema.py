"""The store's migrations build exactly the tables its models describe."""

from __future__ import annotations

from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from sluice.store.database import Database
from sluice.store.schema import Base


async def test_the_migrations_build_what_the_models_describe(sluice_database_url: str) -> None:
    db = Database(sluice_database_url)
    try:
        await db.migrate()

        def diff(connection: Any) -> list[Any]:
            context = MigrationContext.configure(connection, opts={"compare_server_default": True})
            return [
                d
                for d in compare_metadata(context, Base.metadata)
                if d[0] != "remove_table" or d[1].name != "alembic_version"
            ]

        async with db.engine.connect() as conn:
            differences = await conn.run_sync(diff)
        assert differences == []
    finally:
        await db.close()
