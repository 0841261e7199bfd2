"""The store's migrations build exactly the tables its models describe."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from sluice.store.database import Database, _alembic_config, head_revision
from sluice.store.jobs import JobStore
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


_STATE = ("status", "attempts", "result", "error", "engine_id", "ev_ms", "ev_seq")


async def test_a_jobs_state_moves_to_a_row_of_its_own_and_back(sluice_database_url: str) -> None:
    """0008 copies where each job stands into ``job_states`` (nothing is lost on upgrade), and
    its downgrade copies it back."""
    job_id = uuid.uuid4()
    at = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    state = ("COMPLETED", 2, {"ok": True}, "boom", 7, 1733230000000, 4)
    db = Database(sluice_database_url)
    try:
        await db.migrate("0007")
        async with db.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO jobs (id, tenant, queue, type, status, priority, attempts, max_attempts,"
                    " payload, result, error, engine_id, ev_ms, ev_seq, backoff, created_at, updated_at,"
                    " processed_at, completed_at) VALUES (:id, 'acme', 'q', 'generic', :status, 10,"
                    " :attempts, 3, '{\"a\": 1}', CAST(:result AS jsonb), :error, :engine_id, :ev_ms,"
                    " :ev_seq, '[]', :at, :at, :at, :at)"
                ),
                dict(zip(_STATE, state, strict=True)) | {"id": job_id, "at": at, "result": '{"ok": true}'},
            )
        assert await db.migrate("0008") == "0008"
        job = await JobStore(db).get(job_id, tenant="acme")
        assert job is not None
        assert (job.status, job.attempts, job.result, job.error) == state[:4]
        assert (job.payload, job.created_at, job.updated_at, job.completed_at) == ({"a": 1}, at, at, at)

        def downgrade(connection: Any) -> None:
            cfg = _alembic_config()
            cfg.attributes["connection"] = connection
            command.downgrade(cfg, "0007")

        async with db.engine.connect() as conn:
            await conn.run_sync(downgrade)
            await conn.commit()
        async with db.engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT status, attempts, result, error, engine_id, ev_ms, ev_seq FROM jobs"
                        " WHERE id = :id"
                    ),
                    {"id": job_id},
                )
            ).one()
            assert tuple(row) == state
            assert await conn.scalar(text("SELECT to_regclass('job_states')")) is None
    finally:
        await db.close()


async def test_an_unfinished_jobs_engine_id_is_kept_when_the_column_goes(sluice_database_url: str) -> None:
    """0009 drops ``job_states.engine_id``, keeping the ids of unfinished jobs (the engine may
    still hold them under those numbers) in ``job_legacy_ids``; its downgrade puts them back."""
    waiting, finished = uuid.uuid4(), uuid.uuid4()
    at = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
    db = Database(sluice_database_url)
    try:
        await db.migrate("0008")
        async with db.engine.begin() as conn:
            for job_id, status, engine_id in ((waiting, "QUEUED", 41), (finished, "COMPLETED", 42)):
                await conn.execute(
                    text(
                        "INSERT INTO jobs (id, tenant, queue, type, priority, max_attempts, payload,"
                        " backoff, created_at) VALUES (:id, 'acme', 'q', 'generic', 10, 3, '{}', '[]', :at)"
                    ),
                    {"id": job_id, "at": at},
                )
                await conn.execute(
                    text(
                        "INSERT INTO job_states (id, tenant, queue, created_at, status, engine_id,"
                        " updated_at) VALUES (:id, 'acme', 'q', :at, :status, :engine_id, :at)"
                    ),
                    {"id": job_id, "at": at, "status": status, "engine_id": engine_id},
                )
        assert await db.migrate() == head_revision()
        store = JobStore(db)
        assert await store.legacy_engine_ids([waiting, finished]) == {waiting: "41"}
        assert (await store.engine_id(waiting), await store.engine_id(finished)) == ("41", str(finished))

        def downgrade(connection: Any) -> None:
            cfg = _alembic_config()
            cfg.attributes["connection"] = connection
            command.downgrade(cfg, "0008")

        async with db.engine.connect() as conn:
            await conn.run_sync(downgrade)
            await conn.commit()
        async with db.engine.connect() as conn:
            rows = await conn.execute(text("SELECT id, engine_id FROM job_states ORDER BY engine_id"))
            assert {r.id: r.engine_id for r in rows} == {waiting: 41, finished: None}
    finally:
        await db.close()
