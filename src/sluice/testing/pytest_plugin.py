"""Pytest fixtures for testing code that uses Sluice, against a real Redis.

Enable them in your ``conftest.py``::

    pytest_plugins = ["sluice.testing.pytest_plugin"]

and write tests such as::

    async def test_summarize(sluice_redis_url: str, sluice_prefix: str) -> None:
        worker.configure(prefix=sluice_prefix)
        async with running_worker(worker, sluice_redis_url):
            async with Queue.from_url(sluice_redis_url, worker.queue_name, prefix=sluice_prefix) as q:
                job = await q.add("summarize", {"text": "..."})
                assert await job.result(timeout=10) == {...}

``sluice_redis_server`` is one redis-server for the whole session, on a free
loopback port, never persisted and stopped at the end; every test gets a
random key prefix (``sluice_prefix``), so tests share the server without
seeing each other's keys and need no FLUSHALL. Sluice's own suite uses these
fixtures, with the server fixture overridden to run on every Redis version
it supports.

For code that uses PostgreSQL (the ``service`` extra)::

    async def test_store(sluice_database_url: str) -> None:
        engine = create_async_engine(sluice_database_url)  # postgresql+asyncpg://...

``sluice_postgres_server`` is one PostgreSQL 16 (with pgvector) for the
session, on a free loopback port, without fsync, stopped at the end; every
test asking for ``sluice_database_url`` gets a database of its own, created
empty for it (``CREATE DATABASE``: tens of milliseconds) and dropped after
it, so tests need no cleanup and cannot see each other's tables.
:func:`sluice.testing.asyncpg_dsn` turns the URL into what asyncpg takes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from sluice.local.embedded import EmbeddedRedis, find_binary
from sluice.local.postgres import EmbeddedPostgres


@pytest.fixture(scope="session")
def sluice_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A private redis-server for the session (system redis-server, else the ``embedded`` extra's)."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), binary=find_binary(), port=0, persist=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def sluice_redis_url(sluice_redis_server: EmbeddedRedis) -> str:
    """redis://127.0.0.1:<port>/0 of the session's server."""
    return sluice_redis_server.url


@pytest.fixture
def sluice_prefix() -> str:
    """A random key prefix for this test (pass it as ``prefix=`` to Queue and Worker)."""
    return "t" + secrets.token_hex(5)


@pytest.fixture(scope="session")
def sluice_postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    """A private PostgreSQL 16 with pgvector for the session (pgserver's binaries: the ``service`` extra)."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("postgres"), port=0, durable=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def sluice_database_url(sluice_postgres_server: EmbeddedPostgres) -> Iterator[str]:
    """postgresql+asyncpg://postgres@127.0.0.1:<port>/<db> of an empty database for this test alone."""
    name = "t" + secrets.token_hex(6)
    url = sluice_postgres_server.create_database(name)
    yield url
    sluice_postgres_server.drop_database(name)
