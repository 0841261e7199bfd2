"""Duplicates of one idempotency key across two real API processes: one row, one job, one id.

``sluice serve -p 2`` runs as a user runs it (uvicorn's two worker processes
share the listening socket, so connections land on both), on the session's
Redis and a PostgreSQL database of the test's own. Two thousand connections
are opened first and a request written on each in one burst, so the
duplicates reach both processes together and race on the store's unique
index, not on a read. The in-process tests (tests/service/test_service_api.py) cover
one process; this is the race between processes, whose only shared state is
PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import text

from sluice.engine.queue import Queue
from sluice.local.embedded import free_port
from sluice.store.database import Database
from sluice.store.keys import KeyStore
from sluice.store.sink import engine_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

DUPLICATES = 2000
#: Connections opened at once (a burst of SYNs past the listen backlog would be dropped).
OPEN_CHUNK = 250
QUEUE = "dups"
TENANT = "acme"


@dataclass
class Served:
    base: str
    port: int
    key: str
    db: Database
    queue: Queue
    workers: list[int]


def _workers_of(proc: subprocess.Popen[bytes]) -> list[int]:
    """uvicorn's worker processes (multiprocessing children; not its resource tracker)."""
    found = []
    for child in psutil.Process(proc.pid).children():
        with suppress(psutil.Error):
            if any("spawn_main" in arg for arg in child.cmdline()):
                found.append(child.pid)
    return found


@pytest.fixture
def serve(
    tmp_path: Path, redis_url: str, sluice_database_url: str, prefix: str
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env |= {
        "SLUICE_REDIS_URL": redis_url,
        "SLUICE_DATABASE_URL": sluice_database_url,
        "SLUICE_PREFIX": prefix,
        # one key sends every request: the per-key rate limit is not what this tests
        "SLUICE_RATE_LIMIT": "0",
    }
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", "serve", "-p", "2", "--port", str(port), "--queue", QUEUE],
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        yield proc, port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


@pytest.fixture
async def served(
    serve: tuple[subprocess.Popen[bytes], int], redis_url: str, sluice_database_url: str, prefix: str
) -> AsyncIterator[Served]:
    proc, port = serve
    base = f"http://127.0.0.1:{port}"
    db = Database(sluice_database_url, pool_size=2)
    queue = Queue.from_url(redis_url, QUEUE, prefix=prefix)
    try:
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(base_url=base, timeout=2) as client:
            while True:
                assert proc.poll() is None, "sluice serve exited"
                with suppress(httpx.HTTPError):
                    if (await client.get("/readyz")).status_code == 200 and len(_workers_of(proc)) == 2:
                        break
                assert time.monotonic() < deadline, "sluice serve was not ready within 60 s"
                await asyncio.sleep(0.2)
        _, key = await KeyStore(db).create(TENANT)
        yield Served(base, port, key, db, queue, _workers_of(proc))
    finally:
        await queue.close()
        await db.close()


def _request(path: str, body: dict[str, object], key: str) -> bytes:
    """One HTTP/1.1 request that asks the server to close the connection after its answer."""
    raw = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + raw


async def _burst(port: int, request: bytes, n: int) -> list[tuple[int, dict[str, object]]]:
    """Open ``n`` connections, then write ``request`` on each at once; every (status, body)."""
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for start in range(0, n, OPEN_CHUNK):
        conns += await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", port) for _ in range(min(OPEN_CHUNK, n - start)))
        )
    for _, writer in conns:
        writer.write(request)

    async def answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, dict[str, object]]:
        raw = await reader.read()  # to the end: the server closes after answering
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        parsed: dict[str, object] = json.loads(body)
        return int(head[9:12]), parsed

    return list(await asyncio.wait_for(asyncio.gather(*(answer(r, w) for r, w in conns)), 90))


async def _rows(db: Database, idem: str) -> int:
    async with db.engine.connect() as conn:
        query = text("SELECT count(*) FROM jobs WHERE tenant = :t AND idempotency_key = :k")
        return int(await conn.scalar(query, {"t": TENANT, "k": idem}) or 0)


async def _one_engine_job(queue: Queue, job_id: str) -> bool:
    """The engine holds the job under the key the API enqueues it with (``job:<uuid>``)."""
    return bool(await queue.redis.exists(queue.keys.idem(engine_key(uuid.UUID(job_id)))))


async def test_sequential_duplicates_on_fresh_connections_answer_the_first_job(served: Served) -> None:
    # Each request on a connection of its own: they land on either process, one after another.
    body = {"type": "generic", "payload": {"n": 1}, "idempotencyKey": "seq"}
    answers = []
    for _ in range(20):
        async with httpx.AsyncClient(base_url=served.base, timeout=10) as client:
            resp = await client.post("/jobs", json=body, headers={"Authorization": f"Bearer {served.key}"})
            answers.append((resp.status_code, resp.json()["id"]))
    assert {status for status, _ in answers} == {201}
    assert len({job_id for _, job_id in answers}) == 1
    assert await _rows(served.db, "seq") == 1
    assert (await served.queue.counts())["added"] == 1
    assert await _one_engine_job(served.queue, answers[0][1])


async def test_2000_concurrent_duplicates_across_two_api_processes_make_one_job(served: Served) -> None:
    cpu0 = {pid: sum(psutil.Process(pid).cpu_times()[:2]) for pid in served.workers}

    # The NestJS design's route: every duplicate is a 201 with the first job.
    nest = _request("/jobs", {"type": "generic", "payload": {"n": 1}, "idempotencyKey": "same"}, served.key)
    answers = await _burst(served.port, nest, DUPLICATES)
    statuses = {status for status, _ in answers}
    assert statuses == {201}, sorted(statuses)
    ids = {str(body["id"]) for _, body in answers}
    assert len(ids) == 1
    assert await _rows(served.db, "same") == 1
    assert (await served.queue.counts())["added"] == 1
    assert await _one_engine_job(served.queue, ids.pop())

    # Our route: one 201 (created), every other answer a 200 naming the same job.
    v1 = _request("/v1/jobs", {"type": "generic", "payload": {}, "idempotency_key": "same-v1"}, served.key)
    answers = await _burst(served.port, v1, DUPLICATES)
    by_status = sorted(status for status, _ in answers)
    assert by_status == [200] * (DUPLICATES - 1) + [201]
    assert [body["created"] for status, body in answers if status == 201] == [True]
    assert {body["created"] for status, body in answers if status == 200} == {False}
    ids = {str(body["id"]) for _, body in answers}
    assert len(ids) == 1
    assert await _rows(served.db, "same-v1") == 1
    assert (await served.queue.counts())["added"] == 2
    assert await _one_engine_job(served.queue, ids.pop())

    # Both processes served the race (each parsed and answered its share of the connections).
    spent = {pid: sum(psutil.Process(pid).cpu_times()[:2]) - cpu0[pid] for pid in served.workers}
    assert all(seconds > 0.05 for seconds in spent.values()), spent
