"""Connecting to PostgreSQL and bringing its schema up to date.

One :class:`Database` per process: an async SQLAlchemy engine (asyncpg) with a
pool. :meth:`Database.migrate` runs the Alembic migrations that are missing,
under a PostgreSQL advisory lock, so several API processes starting at once
migrate once and the others wait for it, not race it.
"""

from __future__ import annotations

import asyncio
import logging
from importlib import resources
from typing import TYPE_CHECKING, Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from sluice.errors import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.ext.asyncio import AsyncSession

log = logging.getLogger("sluice.store")

#: Any fixed number: the advisory lock every migrating process takes.
_MIGRATION_LOCK = 0x51_1CE_0001


def async_url(url: str) -> str:
    """``postgresql://`` (or ``postgres://``) as SQLAlchemy's asyncpg URL; anything else is refused."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigurationError(
            f"database URL {redact_url(url)!r} does not parse; use postgresql://user:password@host:5432/db"
        ) from None
    if parsed.drivername in ("postgresql", "postgres", "postgresql+asyncpg"):
        return parsed.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    raise ConfigurationError(
        f"database URL {redact_url(url)!r} is not PostgreSQL; use postgresql://user:password@host:5432/db"
    )


def redact_url(url: str) -> str:
    """The URL with its password replaced, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparsable URL>"


def _alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("sluice.store").joinpath("migrations")))
    return cfg


def head_revision() -> str:
    """The newest migration this Sluice ships."""
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


#: HNSW candidates a nearest-neighbour search examines on the raw pool's connections
#: (``llm/cache.py`` says why 100).
HNSW_EF_SEARCH = 100


class Database:
    """The store's connection pool. Close it with :meth:`close` (or ``async with``)."""

    def __init__(self, url: str, *, pool_size: int = 10, echo: bool = False) -> None:
        self.url = async_url(url)
        self.engine: AsyncEngine = create_async_engine(
            self.url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True, echo=echo
        )
        self.sessions: async_sessionmaker[AsyncSession] = async_sessionmaker(
            self.engine, expire_on_commit=False
        )
        self._raw: Any = None
        self._raw_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"Database({redact_url(self.url)!r})"

    async def migrate(self, target: str = "head") -> str:
        """Apply the migrations that are missing (up to ``target``, a revision: the benchmarks
        build earlier schemas to compare); returns the revision the database is at."""

        def upgrade(connection: Connection) -> None:
            # Alembic says what it runs at INFO; the service says it once, below, if anything ran.
            logging.getLogger("alembic").setLevel(logging.WARNING)
            cfg = _alembic_config()
            cfg.attributes["connection"] = connection
            command.upgrade(cfg, target)

        before = await self.revision()
        async with self.engine.connect() as conn:
            await conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _MIGRATION_LOCK})
            try:
                await conn.run_sync(upgrade)
                await conn.commit()
            finally:
                await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MIGRATION_LOCK})
                await conn.commit()
        after = await self.revision() or ""
        if after != before:
            log.info("store: migrated %s from %s to %s", redact_url(self.url), before or "empty", after)
        return after

    async def revision(self) -> str | None:
        """The revision the database is at (None: never migrated)."""
        async with self.engine.connect() as conn:
            exists = await conn.scalar(text("SELECT to_regclass('alembic_version') IS NOT NULL"))
            if not exists:
                return None
            value = await conn.scalar(text("SELECT version_num FROM alembic_version"))
            return str(value) if value is not None else None

    async def ping(self) -> None:
        async with self.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def raw_pool(self) -> Any:
        """A small pool of asyncpg's own connections (an ``asyncpg.Pool``), made on first use.

        For hot paths with a latency target (the semantic cache's lookups): the
        main pool pings every connection it lends (``pool_pre_ping``: a round
        trip, to notice one the server closed), where asyncpg's pool notices a
        closed connection by itself and lends the next at no cost.
        """
        async with self._raw_lock:
            if self._raw is None:
                import asyncpg  # type: ignore[import-untyped]

                dsn = self.url.replace("postgresql+asyncpg://", "postgresql://", 1)
                # The semantic cache's nearest-neighbour search examines this many HNSW
                # candidates (pgvector's default is 40): set once per connection, not per query.
                settings = {"hnsw.ef_search": str(HNSW_EF_SEARCH)}
                self._raw = await asyncpg.create_pool(dsn, min_size=1, max_size=4, server_settings=settings)
        return self._raw

    async def close(self) -> None:
        if self._raw is not None:
            raw, self._raw = self._raw, None
            await raw.close()
        await self.engine.dispose()

    async def __aenter__(self) -> Database:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
