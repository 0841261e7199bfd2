"""The PostgreSQL of a benchmark: one given (checked before the run starts), else a throw-away
embedded server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from sluice.errors import ConfigurationError, StoreUnavailable
from sluice.local.postgres import EmbeddedPostgres
from sluice.settings import ENV_DATABASE_URL
from sluice.store.database import Database, redact_url


@dataclass
class BenchDatabase:
    """The PostgreSQL of the run: its URL, where it came from, and its server's pid if ours."""

    url: str
    origin: str
    pid: int | None = None
    version: str | None = None


async def check_database(url: str, *, from_env: bool = True) -> None:
    """A given PostgreSQL takes a connection, or the benchmark stops here, saying so (and
    how to fix it): a refused connection deep inside a run read as an internal error."""
    db: Database | None = None
    try:
        db = Database(url, pool_size=1)
        async with asyncio.timeout(10):
            await db.ping()
    except ConfigurationError:
        raise  # the URL's form: its own message says how to write it
    except (OSError, TimeoutError, SQLAlchemyError) as exc:  # refused, no such database, password...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        named_by = "--database or SLUICE_DATABASE_URL" if from_env else "--database"
        raise StoreUnavailable(
            f"PostgreSQL at {redact_url(url)} cannot be reached ({type(exc).__name__}: {reason})",
            f"check {named_by} and that the server runs, or leave it out for a throw-away server",
        ) from None
    finally:
        if db is not None:
            await db.close()


@contextlib.contextmanager
def bench_database(
    explicit: str | None, *, durable: bool = True, from_env: bool = True
) -> Iterator[BenchDatabase]:
    """``--database``, else $SLUICE_DATABASE_URL (unless ``from_env`` is False: a benchmark that
    rewrites a table must not find a production database by accident), else a throw-away
    embedded PostgreSQL.

    The embedded server is durable by default (fsync and synchronous commit on,
    as a production server is): a 201 then means the row survives a crash,
    and the figure includes what that costs. On a given server the run uses
    tenants of its own and leaves their rows in place (it never deletes what
    it did not make, and a benchmark's rows are small).
    """
    url = explicit or (os.environ.get(ENV_DATABASE_URL) if from_env else None)
    if url:
        asyncio.run(check_database(url, from_env=from_env))
        yield BenchDatabase(url, "given")
        return
    with tempfile.TemporaryDirectory(prefix="sluice-bench-pg-") as tmp:
        server = EmbeddedPostgres(tmp, port=0, durable=durable, database="ingest")
        with server:
            assert server.binaries is not None
            origin = f"embedded PostgreSQL {server.binaries.version} ({'durable' if durable else 'no fsync'})"
            yield BenchDatabase(server.url, origin, server.pid, server.binaries.version)
