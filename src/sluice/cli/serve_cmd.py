"""``sluice serve`` (the HTTP API) and ``sluice keys`` (its API keys).

The service's modules are imported inside the commands: the rest of the
command line works without the ``service`` extra installed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from typing import TYPE_CHECKING, Annotated

import typer

from sluice.cli.errors import CliFailure
from sluice.cli.output import plain_table, print_json, stdout, utc
from sluice.cli.parsing import SluiceCommand
from sluice.errors import SluiceError
from sluice.settings import ENV_REDIS_URL

if TYPE_CHECKING:
    from sluice.store.database import Database
    from sluice.store.keys import ApiKey

ENV_DATABASE = "SLUICE_DATABASE_URL"
#: prometheus-client's multiprocess directory (``sluice serve -p N`` sets its own).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: How long a stopping API waits for open requests (long ones: the dashboard's live streams).
STOP_GRACE_SECONDS = 5

keys_app = typer.Typer(
    help="API keys of the service: each is bound to a tenant, and sees only that tenant's jobs.",
    no_args_is_help=True,
)

DatabaseOpt = Annotated[
    str | None,
    typer.Option(
        "--database",
        help=f"PostgreSQL URL (default ${ENV_DATABASE}).",
        show_default=False,
    ),
]


def _database_url(explicit: str | None) -> str:
    url = explicit or os.environ.get(ENV_DATABASE)
    if not url:
        raise CliFailure(
            f"no database: pass --database postgresql://user:password@host:5432/db or set {ENV_DATABASE} "
            "(`sluice dev` runs an embedded PostgreSQL for you)"
        )
    return url


def _service_modules() -> None:
    try:
        import fastapi  # noqa: F401
        import sqlalchemy  # noqa: F401
    except ImportError as exc:
        raise CliFailure(
            f"the service needs the 'service' extra ({exc.name} is missing): "
            "pip install 'sluice-queue[service]'"
        ) from None


def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    processes: Annotated[int, typer.Option("--processes", "-p", min=1, max=64, help="API processes.")] = 1,
    database: DatabaseOpt = None,
    redis: Annotated[
        str | None, typer.Option("--redis", help=f"Redis URL (default ${ENV_REDIS_URL}).", show_default=False)
    ] = None,
    queue: Annotated[str, typer.Option("--queue", "-q", help="The engine queue API jobs go to.")] = "jobs",
) -> None:
    """Run the HTTP API (FastAPI) with PostgreSQL as the system of record.

    Every request needs an API key (`sluice keys create --tenant T`). At start
    the store's migrations are applied; each process also carries the engine's
    transitions into the store and reconciles the two. Run workers beside it:
    `sluice worker sluice.service.handlers:worker`. OpenAPI: /docs, /openapi.json.
    """
    _service_modules()
    import uvicorn

    redis_url = redis or os.environ.get(ENV_REDIS_URL)
    if not redis_url:
        raise CliFailure(
            f"no Redis: pass --redis redis://host:6379/0 or set {ENV_REDIS_URL} (or use `sluice dev`)"
        )
    database_url = _database_url(database)
    _check_database(database_url)
    os.environ["SLUICE_DATABASE_URL"] = database_url
    os.environ["SLUICE_REDIS_URL"] = redis_url
    os.environ["SLUICE_QUEUE"] = queue
    # Prometheus: with several processes each writes its metrics' values into a directory of
    # its own that all of them share, and the one answering a scrape adds them up (the
    # variable is read when a process imports prometheus-client: uvicorn's workers do, after
    # this). A fresh directory per run, ours, removed at exit; one process keeps them in memory.
    metrics_dir = tempfile.mkdtemp(prefix="sluice-metrics-") if processes > 1 else None
    if metrics_dir is not None:
        os.environ[MULTIPROC_ENV] = metrics_dir
    else:
        os.environ.pop(MULTIPROC_ENV, None)
    try:
        uvicorn.run(
            "sluice.service.asgi:app",
            factory=True,
            host=host,
            port=port,
            workers=processes if processes > 1 else None,
            log_level="warning",
            access_log=False,
            # Open dashboard streams (GET /v1/live) end at once rather than hold the stop.
            timeout_graceful_shutdown=STOP_GRACE_SECONDS,
        )
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _check_database(url: str) -> None:
    """Migrate once, here, before any API process starts: a database that is unreachable or
    refuses is one line with what to check, not a traceback from every process."""

    async def run() -> None:
        db = await _database(url)
        await db.close()

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    except Exception as exc:
        raise _db_failure(url, exc) from exc


def _db_failure(url: str, exc: Exception) -> CliFailure:
    from sluice.store.database import redact_url

    if isinstance(exc, CliFailure):
        return exc
    if isinstance(exc, SluiceError):  # bad input of ours (a tenant name): its own message
        return CliFailure(str(exc))
    return CliFailure(
        f"PostgreSQL at {redact_url(url)} cannot be used ({type(exc).__name__}: {exc}); check "
        f"--database / {ENV_DATABASE} and that the server runs"
    )


async def _database(url: str) -> Database:
    from sluice.store.database import Database

    db = Database(url, pool_size=1)
    await db.migrate()
    return db


@keys_app.command("create", cls=SluiceCommand)
def keys_create(
    tenant: Annotated[str, typer.Option("--tenant", "-t", help="The tenant whose jobs the key sees.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="May change budgets, pause queues, redrive and purge.")
    ] = False,
    name: Annotated[str | None, typer.Option(help="A label for lists (who or what uses it).")] = None,
    database: DatabaseOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Make an API key. It is printed once: store it now (only its hash is kept)."""
    _service_modules()
    url = _database_url(database)

    async def run() -> tuple[ApiKey, str]:
        from sluice.store.keys import KeyStore

        db = await _database(url)
        try:
            return await KeyStore(db).create(tenant, admin=admin, name=name)
        finally:
            await db.close()

    try:
        record, key = asyncio.run(run())
    except Exception as exc:
        raise _db_failure(url, exc) from exc
    if as_json:
        print_json({"id": str(record.id), "tenant": tenant, "admin": admin, "key": key})
        return
    stdout().print(f"API key for tenant {tenant}{' (admin)' if admin else ''}, shown once:\n{key}")


@keys_app.command("list", cls=SluiceCommand)
def keys_list(
    tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="Only this tenant's keys.")] = None,
    database: DatabaseOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The API keys (never the keys themselves: their first characters, tenant and state)."""
    _service_modules()
    url = _database_url(database)

    async def run() -> list[ApiKey]:
        from sluice.store.keys import KeyStore

        db = await _database(url)
        try:
            return await KeyStore(db).list_keys(tenant)
        finally:
            await db.close()

    try:
        keys = asyncio.run(run())
    except Exception as exc:
        raise _db_failure(url, exc) from exc
    if as_json:
        print_json(
            [
                {
                    "id": str(k.id),
                    "tenant": k.tenant,
                    "admin": k.admin,
                    "name": k.name,
                    "prefix": k.prefix,
                    "revoked": k.revoked_at is not None,
                }
                for k in keys
            ]
        )
        return
    table = plain_table("API keys")
    for col in ("id", "tenant", "admin", "name", "starts with", "created", "state"):
        table.add_column(col)
    for k in keys:
        table.add_row(
            str(k.id),
            k.tenant,
            "yes" if k.admin else "no",
            k.name or "-",
            k.prefix + "…",
            utc(int(k.created_at.timestamp() * 1000)),
            "revoked" if k.revoked_at else "live",
        )
    stdout().print(table)


@keys_app.command("revoke", cls=SluiceCommand)
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (sluice keys list).")],
    database: DatabaseOpt = None,
) -> None:
    """Revoke an API key: refused from then on (within 30 s in running API processes)."""
    _service_modules()
    url = _database_url(database)
    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        raise CliFailure(f"{key_id!r} is not a key id; `sluice keys list` shows them") from None

    async def run() -> bool:
        from sluice.store.keys import KeyStore

        db = await _database(url)
        try:
            return await KeyStore(db).revoke(parsed)
        finally:
            await db.close()

    try:
        revoked = asyncio.run(run())
    except Exception as exc:
        raise _db_failure(url, exc) from exc
    if not revoked:
        raise CliFailure(f"no live key {key_id}; `sluice keys list` shows them")
    stdout().print(f"revoked {key_id}")
