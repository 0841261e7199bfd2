"""Alembic's entry point: runs the migrations on the connection it is handed.

Sluice runs migrations itself (:func:`sluice.store.database.migrate`, at
service start and in tests) on a connection of its own engine, under an
advisory lock, so there is no ``alembic.ini`` and no URL read here. A
developer making a new revision passes one: ``alembic -x url=... revision
--autogenerate`` with ``script_location = sluice.store:migrations``.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from sluice.store.schema import Base

config = context.config


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("pass the database URL: alembic -x url=postgresql://... <command>")

    async def _main(url: str) -> None:
        engine = create_async_engine(url)
        async with engine.connect() as conn:
            await conn.run_sync(_run)
        await engine.dispose()

    asyncio.run(_main(url))
