"""The embedded PostgreSQL (sluice.local.postgres, .shared_postgres) and its pytest fixtures.

Real servers from pgserver's PostgreSQL 16 binaries, each in a folder of its
own, reached with asyncpg as the service will reach them.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest

from sluice.errors import ConfigurationError
from sluice.local import shared_postgres
from sluice.local.embedded import pid_alive
from sluice.local.postgres import (
    ROOT_OS_USER,
    EmbeddedPostgres,
    PostgresCommandError,
    asyncpg_dsn,
)
from sluice.local.postgres_binaries import find_binaries
from sluice.local.shared_postgres import SharedPostgres
from tests.test_extras import run_hidden

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A server of this test's own (tests that restart, kill or inspect it)."""
    pg = EmbeddedPostgres(tmp_path / "pg", durable=False)
    yield pg
    pg.stop()


def run(code: str, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter (another "command"), with ``home`` (and ``args``) as arguments."""
    argv = [sys.executable, "-c", code, str(home), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


async def fetchval(dsn: str, sql: str) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def test_start_answers_on_a_loopback_port_and_stop_ends_it(server: EmbeddedPostgres) -> None:
    started = time.monotonic()
    server.start()
    took = time.monotonic() - started
    assert server.url == f"postgresql+asyncpg://postgres@127.0.0.1:{server.port}/postgres"
    assert server.dsn == asyncpg_dsn(server.url) == f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
    version = await fetchval(server.dsn, "SHOW server_version")
    assert str(version).startswith("16.")
    assert took < 10, f"initdb and start took {took:.1f}s"
    pid = server.pid
    assert pid is not None
    server.stop()
    assert not pid_alive(pid)
    with pytest.raises(OSError):
        await asyncpg.connect(server.dsn, timeout=5)


async def test_its_data_is_kept_across_restarts_of_the_same_folder(tmp_path: Path) -> None:
    with EmbeddedPostgres(tmp_path / "pg") as first:
        await fetchval(first.dsn, "CREATE TABLE kept AS SELECT 42 AS answer")
    # A new object on the same folder: no initdb, the same cluster (on another free port).
    started = time.monotonic()
    with EmbeddedPostgres(tmp_path / "pg") as second:
        took = time.monotonic() - started
        assert await fetchval(second.dsn, "SELECT answer FROM kept") == 42
    assert took < 2, f"a restart took {took:.1f}s"


async def test_two_servers_run_at_once_on_their_own_ports_and_data(tmp_path: Path) -> None:
    with (
        EmbeddedPostgres(tmp_path / "a", durable=False) as a,
        EmbeddedPostgres(tmp_path / "b", durable=False) as b,
    ):
        assert a.port != b.port
        await fetchval(a.dsn, "CREATE TABLE only_in_a (x int)")
        assert await fetchval(a.dsn, "SELECT to_regclass('only_in_a')::text") == "only_in_a"
        assert await fetchval(b.dsn, "SELECT to_regclass('only_in_a')::text") is None


@pytest.mark.parametrize("turn", ["first", "second"])
async def test_each_test_gets_a_fresh_empty_database(sluice_database_url: str, turn: str) -> None:
    dsn = asyncpg_dsn(sluice_database_url)
    conn = await asyncpg.connect(dsn)
    try:
        tables = await conn.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        assert tables == 0
        # Both turns create the same table: they would clash if they shared a database.
        await conn.execute("CREATE TABLE mine (turn text)")
        await conn.execute("INSERT INTO mine VALUES ($1)", turn)
        assert await conn.fetchval("SELECT current_database()") == sluice_database_url.rpartition("/")[2]
    finally:
        await conn.close()


async def test_a_created_database_is_dropped_even_while_connected(
    sluice_postgres_server: EmbeddedPostgres,
) -> None:
    started = time.monotonic()
    url = sluice_postgres_server.create_database("scratch")
    took = time.monotonic() - started
    assert url.endswith("/scratch") and url.startswith("postgresql+asyncpg://")
    assert took < 2, f"CREATE DATABASE took {took:.2f}s"
    assert sluice_postgres_server.create_database("scratch", exist_ok=True) == url
    with pytest.raises(PostgresCommandError, match="already exists"):
        sluice_postgres_server.create_database("scratch")
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        sluice_postgres_server.drop_database("scratch")  # WITH (FORCE): the open connection is ended
    finally:
        conn.terminate()
    names = sluice_postgres_server.psql("SELECT datname FROM pg_database").split()
    assert "scratch" not in names
    with pytest.raises(ValueError, match="database name"):
        sluice_postgres_server.create_database("x; DROP DATABASE postgres")


async def test_pgvector_is_there_and_answers_a_cosine_distance_query(sluice_database_url: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(sluice_database_url))
    try:
        await conn.execute("CREATE EXTENSION vector")
        version = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        assert str(version).startswith("0.6")
        await conn.execute("CREATE TABLE docs (id int PRIMARY KEY, embedding vector(3))")
        await conn.execute("INSERT INTO docs VALUES (1, '[1,0,0]'), (2, '[0,1,0]'), (3, '[1,1,0]')")
        await conn.execute("CREATE INDEX ON docs USING hnsw (embedding vector_cosine_ops)")
        rows = await conn.fetch(
            "SELECT id, embedding <=> '[1,0.1,0]' AS distance FROM docs ORDER BY distance LIMIT 2"
        )
    finally:
        await conn.close()
    assert [r["id"] for r in rows] == [1, 3]
    assert rows[0]["distance"] == pytest.approx(1 - 1 / (1.01**0.5), abs=1e-6)


async def test_after_a_kill_it_starts_again_and_recovers_what_was_committed(tmp_path: Path) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg")  # durable: fsync on, as for real data
    try:
        pg.start()
        await fetchval(pg.dsn, "CREATE TABLE survivors AS SELECT generate_series(1, 1000) AS n")
        pid = pg.pid
        assert pid is not None
        pg.kill()
        assert not pid_alive(pid)
        pg.start()
        assert await fetchval(pg.dsn, "SELECT count(*) FROM survivors") == 1000
        assert "was interrupted" in pg.log_tail() or "not properly shut down" in pg.log_tail()
    finally:
        pg.stop()


async def test_on_the_socket_only_and_with_a_password_on_tcp(tmp_path: Path) -> None:
    with EmbeddedPostgres(tmp_path / "sock", port=None, durable=False, database="app") as pg:
        assert pg.port is None
        assert pg.url.startswith("postgresql+asyncpg://postgres@/app?host=")
        assert await fetchval(pg.dsn, "SELECT current_database()") == "app"
        assert await fetchval(pg.dsn, "SELECT inet_server_port()") is None  # not over TCP
    secret = secrets.token_urlsafe(12)
    with EmbeddedPostgres(tmp_path / "tcp", durable=False, password=secret) as pg:
        assert pg.dsn == f"postgresql://postgres:{secret}@127.0.0.1:{pg.port}/postgres"
        assert await fetchval(pg.dsn, "SELECT 1") == 1
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(f"postgresql://postgres:wrong@127.0.0.1:{pg.port}/postgres")
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{pg.port}/postgres")
        assert pg.psql("SELECT 2").strip() == "2"  # the socket needs none


async def test_a_folder_too_deep_for_a_socket_gets_its_socket_in_the_temp_dir(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedPostgres(deep, port=None, durable=False) as pg:
        assert pg.socket_dir != pg.pgdata and len(str(pg.socket_dir)) < 40
        assert await fetchval(pg.dsn, "SELECT 1") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="only root needs another OS user")
def test_as_root_the_server_runs_as_an_unprivileged_user(server: EmbeddedPostgres) -> None:
    server.start()
    status = Path(f"/proc/{server.pid}/status").read_text()
    uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
    assert server.user is not None and server.user.name == ROOT_OS_USER
    assert int(uid) == server.user.uid != 0
    assert server.pgdata.stat().st_uid == server.user.uid


def test_errors_say_what_is_wrong_and_what_to_do(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    with pytest.raises(ConfigurationError, match=r"cannot use .*a-file for PostgreSQL"):
        EmbeddedPostgres(a_file).start()

    stray = tmp_path / "stray"
    (stray / "data").mkdir(parents=True)
    (stray / "data" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigurationError, match="not empty and holds no PostgreSQL cluster"):
        EmbeddedPostgres(stray).start()

    with pytest.raises(ConfigurationError, match="no executable initdb, postgres, psql in"):
        find_binaries(tmp_path)

    # A server that exits at start: the error shows the end of its log.
    bad = EmbeddedPostgres(tmp_path / "bad", durable=False, settings={"shared_buffers": "lots"})
    with pytest.raises(ConfigurationError, match=r"exited at start(.|\n)*shared_buffers"):
        bad.start()


def test_without_pgserver_the_error_names_the_service_extra() -> None:
    code = (
        "from sluice.local.postgres import EmbeddedPostgres\n"
        "from sluice.errors import MissingExtra\n"
        "try:\n    EmbeddedPostgres('/nonexistent/pg').start()\n"
        "except MissingExtra as exc:\n    print(exc.extra); print(exc)\n"
    )
    out = run_hidden(["pgserver"], code)
    assert out.returncode == 0, out.stderr
    extra, message = out.stdout.splitlines()[:2]
    assert extra == "service"
    assert "pip install 'sluice-queue[service]'" in message and "pgserver" in message
    assert "SLUICE_DATABASE_URL" in message


# ---- the shared server of a folder (the command line's) ------------------------------------------


async def test_a_second_command_finds_the_folders_server_and_the_last_one_out_stops_it(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    first = SharedPostgres(home, label="first")
    url = first.attach()
    second = SharedPostgres(home, label="second")
    try:
        assert first.started and first.record is not None
        assert url.startswith("postgresql+asyncpg://postgres@/sluice?host=")
        assert (home / "postgres" / "data" / "PG_VERSION").exists()
        await fetchval(first.dsn, "CREATE TABLE notes AS SELECT 'kept' AS note")

        assert second.attach() == url and not second.started
        assert second.record is not None and second.record.pid == first.record.pid
        found = shared_postgres.status(home)
        assert found is not None and {u.label for u in found.users} == {"first", "second"}
        assert first.detach() == 1 and second.running()  # the other still uses it
    finally:
        first.detach()
        left = second.detach()
    assert left == 0 and not pid_alive(first.record.pid)
    assert shared_postgres.status(home) is None

    # The next command on the folder starts it again, on the same data.
    with SharedPostgres(home) as again_url:
        assert await fetchval(asyncpg_dsn(again_url), "SELECT note FROM notes") == "kept"


async def test_a_command_in_another_process_finds_the_running_server(tmp_path: Path) -> None:
    home = tmp_path / "home"
    code = (
        "import json, sys\n"
        "from sluice.local.shared_postgres import SharedPostgres\n"
        "other = SharedPostgres(sys.argv[1], label='other')\n"
        "with other as url:\n"
        "    print(json.dumps({'url': url, 'started': other.started, 'pid': other.record.pid}))\n"
    )
    with SharedPostgres(home) as url:
        out = await asyncio.to_thread(run, code, home)
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout)
        record = shared_postgres.PostgresFolder(home).read_record()
        assert record is not None
        assert seen == {"url": url, "started": False, "pid": record.pid}
        assert await fetchval(asyncpg_dsn(url), "SELECT 1") == 1  # still up after the other left


@pytest.mark.parametrize("killed", ["once ready", "before creating the database"])
async def test_a_killed_starters_server_is_adopted_and_stopped_by_the_last_one_out(
    tmp_path: Path, killed: str
) -> None:
    home = tmp_path / "home"
    code = (
        "import dataclasses, os, signal, sys\n"
        "from sluice.local.shared_postgres import PostgresFolder, SharedPostgres\n"
        "SharedPostgres(sys.argv[1]).attach()\n"
        "folder = PostgresFolder(sys.argv[1])\n"
        "if sys.argv[2] == 'early':  # as if killed between spawning the server and finishing its setup\n"
        "    folder.write_record(dataclasses.replace(folder.read_record(), complete=False))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = await asyncio.to_thread(run, code, home, "early" if killed.startswith("before") else "ready")
    assert out.returncode == -9, out.stderr
    orphaned = shared_postgres.PostgresFolder(home).read_record()
    assert orphaned is not None and pid_alive(orphaned.pid)
    adopter = SharedPostgres(home)
    with adopter as url:
        assert await fetchval(asyncpg_dsn(url), "SELECT 1") == 1
        assert adopter.record is not None
        if orphaned.complete:  # adopted as it is
            assert not adopter.started and adopter.record.pid == orphaned.pid
        else:  # stopped, and started again properly
            assert adopter.started and not pid_alive(orphaned.pid)
    assert not pid_alive(orphaned.pid) and not pid_alive(adopter.record.pid)


def test_commands_starting_at_once_start_exactly_one_server(tmp_path: Path) -> None:
    home = tmp_path / "home"
    code = (  # each stays long enough for the others to find its server
        "import json, sys, time\n"
        "from sluice.local.shared_postgres import SharedPostgres\n"
        "s = SharedPostgres(sys.argv[1])\n"
        "s.attach(); time.sleep(1.0)\n"
        "print(json.dumps({'started': s.started, 'pid': s.record.pid})); s.detach()\n"
    )
    argv = [sys.executable, "-c", code, str(home)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    seen = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert sum(s["started"] for s in seen) == 1
    assert len({s["pid"] for s in seen}) == 1
    assert not pid_alive(seen[0]["pid"]) and shared_postgres.status(home) is None


async def test_on_a_port_the_shared_server_wants_its_password_and_stop_stops_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    shared = SharedPostgres(home, port=0)
    url = shared.attach()
    try:
        record = shared.record
        assert record is not None and record.port is not None and record.password
        assert url == f"postgresql+asyncpg://postgres:{record.password}@127.0.0.1:{record.port}/sluice"
        assert oct((home / "postgres" / "server.json").stat().st_mode & 0o777) == "0o600"
        assert await fetchval(shared.dsn, "SELECT current_database()") == "sluice"
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{record.port}/sluice")
        stopped = shared_postgres.stop(home)
        assert stopped is not None and stopped.record.pid == record.pid
        assert not pid_alive(record.pid) and not shared.running()
        assert shared_postgres.stop(home) is None
    finally:
        assert shared.detach() == 0


def test_the_fixtures_are_fast(sluice_postgres_server: EmbeddedPostgres) -> None:
    """A fresh database per test must stay cheap: create and drop take well under a second."""
    started = time.monotonic()
    for i in range(5):
        sluice_postgres_server.create_database(f"speed{i}")
        sluice_postgres_server.drop_database(f"speed{i}")
    per_database = (time.monotonic() - started) / 5
    assert per_database < 0.5, f"{per_database * 1000:.0f} ms per database"
