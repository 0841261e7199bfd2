"""Redis transport errors reach the caller as SluiceErrors that say what happened and what to do.

Real servers only: a port nobody listens on, a real Redis restarted under a
pooled client, a real Redis out of memory, a real read-only replica, and a
loopback proxy in front of a real Redis that drops one reply after Redis has
acted on the command (the only way to know a write's outcome is unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import BusyLoadingError, ResponseError

from sluice import (
    ConfigurationError,
    JobSpec,
    OutcomeUnknown,
    Queue,
    RedisCommandError,
    RedisUnavailable,
    SluiceError,
    Worker,
)
from sluice.engine.budget_state import BudgetCopy
from sluice.engine.budgets import Budgets
from sluice.engine.connection import connect
from sluice.engine.protocol import WorkerProtocol
from sluice.engine.queue import Job
from sluice.engine.transport import translate
from sluice.testing import EmbeddedRedis, free_port
from tests.conftest import running

Call = Callable[[Queue], Awaitable[Any]]


async def _first_event(q: Queue) -> Any:
    async for event in q.events(since="0"):
        return event
    return None


#: One call of every public coroutine of Queue, its Budgets, its WorkerProtocol and Job.
async def _top_up(q: Queue) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return await q.budgets.top_up("b", 10)


CALLS: dict[str, Call] = {
    "Queue.add": lambda q: q.add("x"),
    "Queue.add_bulk": lambda q: q.add_bulk([JobSpec("x")]),
    "Queue.get_job": lambda q: q.get_job("1"),
    "Queue.get_jobs": lambda q: q.get_jobs(["1"]),
    "Queue.job_state": lambda q: q.job_state("1"),
    "Queue.wait_result": lambda q: q.wait_result("1", timeout=1),
    "Queue.events": _first_event,
    "Queue.cancel": lambda q: q.cancel("1"),
    "Queue.counts": lambda q: q.counts(),
    "Queue.ids": lambda q: q.ids(q_state_waiting()),
    "Queue.workers": lambda q: q.workers(),
    "Queue.latency": lambda q: q.latency(60),
    "Queue.latency_series": lambda q: q.latency_series(300),
    "Queue.latency_totals": lambda q: q.latency_totals(),
    "Queue.refusals": lambda q: q.refusals(),
    "Queue.dead_letters": lambda q: q.dead_letters(),
    "Queue.redrive": lambda q: q.redrive(),
    "Queue.purge_dead": lambda q: q.purge_dead(),
    "Queue.set_global_concurrency": lambda q: q.set_global_concurrency(2),
    "Queue.set_rate_limit": lambda q: q.set_rate_limit(2),
    "Queue.set_token_rate_limit": lambda q: q.set_token_rate_limit(100),
    "Queue.set_limits": lambda q: q.set_limits(requests={"minute": 60, "day": 1000}),
    "Queue.set_pacing": lambda q: q.set_pacing(headroom_ms=10),
    "Queue.follow_provider": lambda q: q.follow_provider(False),
    "Queue.pause": lambda q: q.pause(),
    "Queue.resume": lambda q: q.resume(),
    "Queue.throttle": lambda q: q.throttle(1),
    "Queue.flow": lambda q: q.flow(),
    "Queue.retention": lambda q: q.retention(),
    "Queue.set_retention": lambda q: q.set_retention("completed", age=60),
    "Budgets.create": lambda q: q.budgets.create("b", 10),
    "Budgets.set_limit": lambda q: q.budgets.set_limit("b", 10),
    "Budgets.credit": lambda q: q.budgets.credit("b", 10),
    "Budgets.adjust": lambda q: q.budgets.adjust("b", 10),
    "Budgets.sweep": lambda q: q.budgets.sweep(),
    "Budgets.get": lambda q: q.budgets.get("b"),
    "Budgets.get_many": lambda q: q.budgets.get_many(["b"]),
    "Budgets.reserve": lambda q: q.budgets.reserve("b", 1, "r"),
    "Budgets.commit": lambda q: q.budgets.commit("r", 1),
    "Budgets.refund": lambda q: q.budgets.refund("r"),
    "Budgets.reservation": lambda q: q.budgets.reservation("r"),
    "Budgets.held": lambda q: q.budgets.held(),
    "Budgets.copies": lambda q: q.budgets.copies(["b"]),
    "Budgets.restore": lambda q: q.budgets.restore(BudgetCopy("b", 10, 0, "", 0, None, 0, 0, 0)),
    "Budgets.top_up": _top_up,
    "WorkerProtocol.step": lambda q: q.protocol.step(now=1, want=1, lease_ms=100, worker_id="w"),
    "WorkerProtocol.extend": lambda q: q.protocol.extend(now=1, lease_ms=100, leases=[("1", b"1")]),
    "WorkerProtocol.reap": lambda q: q.protocol.reap(now=1),
    "WorkerProtocol.trim": lambda q: q.protocol.trim(now=1),
    "Job.info": lambda q: q.job("1").info(),
    "Job.state": lambda q: q.job("1").state(),
    "Job.result": lambda q: q.job("1").result(timeout=1),
    "Job.cancel": lambda q: q.job("1").cancel(),
}

#: Public coroutines that talk to Redis only through marked ones, and those that do not talk at all.
DELEGATING = {"Queue.add", "Queue.dead_letters", "Job.info", "Job.state", "Job.result", "Job.cancel"}
NOT_REDIS = {"Queue.close", "Queue.__aenter__", "Queue.__aexit__"}


def q_state_waiting() -> Any:
    from sluice import JobState

    return JobState.WAITING


def _public_coroutines() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for cls in (Queue, Budgets, WorkerProtocol, Job):
        for name, fn in inspect.getmembers(cls):
            if name.startswith("_") and name not in ("__aenter__", "__aexit__"):
                continue
            if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
                found[f"{cls.__name__}.{name}"] = fn
    return found


def test_every_public_call_is_marked_and_covered_here() -> None:
    public = _public_coroutines()
    unmarked = {
        name
        for name, fn in public.items()
        if not hasattr(fn, "__sluice_transport__") and name not in DELEGATING | NOT_REDIS
    }
    assert unmarked == set(), "mark these with @reads or @writes (sluice.engine.transport)"
    assert set(public) - NOT_REDIS == set(CALLS), "add the new call to CALLS"


@pytest.mark.parametrize("name", sorted(CALLS))
async def test_an_unreachable_redis_is_redis_unavailable_naming_the_server(name: str) -> None:
    port = free_port()
    client = connect(f"redis://:s3cret@127.0.0.1:{port}/0", socket_connect_timeout=1)
    queue = Queue("q", redis=client)
    try:
        with pytest.raises(RedisUnavailable) as caught:
            await asyncio.wait_for(CALLS[name](queue), 10)
    finally:
        await queue.close()
        await client.aclose()
    err = caught.value
    # Nothing was sent, so even a write is plainly unavailable, not "outcome unknown".
    assert not isinstance(err, OutcomeUnknown)
    assert isinstance(err, SluiceError) and isinstance(err, ConnectionError)
    assert err.url == f"redis://127.0.0.1:{port}/0"
    assert f"Redis at redis://127.0.0.1:{port}/0 is unavailable" in str(err)
    assert "Connection refused" in str(err) or "connecting to" in str(err)
    assert "s3cret" not in str(err)
    assert "SLUICE_REDIS_URL" in str(err)


async def test_a_restarted_redis_costs_a_pooled_client_no_error(tmp_path: Path) -> None:
    # Given a client whose pool holds a connection to a Redis
    port = free_port()
    server = EmbeddedRedis(tmp_path, port=port, persist=True)
    await asyncio.to_thread(server.start)
    client = connect(server.url)
    queue = Queue("q", redis=client)
    try:
        job = await queue.add("x")
        # When the server restarts (same port, same data)
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)
        # Then the next write (never retried) and read go through on a new connection
        assert (await queue.add("x")).id == "2"
        assert (await queue.get_job(job.id)) is not None
    finally:
        await queue.close()
        await client.aclose()
        await asyncio.to_thread(server.stop)


class DroppingProxy:
    """A loopback TCP proxy to a real Redis that, once armed, forwards the next command
    containing ``marker`` to Redis, lets Redis answer it, and then closes the client's
    connection without passing the answer on."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.marker: bytes | None = None
        self.dropped = 0
        self.server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> DroppingProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pump = asyncio.create_task(self._pipe(up_reader, writer))
        try:
            while data := await reader.read(65536):
                up_writer.write(data)
                await up_writer.drain()
                if self.marker is not None and self.marker in data:
                    self.marker = None
                    self.dropped += 1
                    pump.cancel()
                    await asyncio.sleep(0.2)  # Redis runs the command and answers into the void
                    break
        finally:
            pump.cancel()
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()


@contextlib.asynccontextmanager
async def proxied_queue(
    redis_server: EmbeddedRedis, prefix: str
) -> AsyncIterator[tuple[DroppingProxy, Queue]]:
    async with DroppingProxy(redis_server.port) as proxy:
        client = connect(f"redis://127.0.0.1:{proxy.port}/0")
        queue = Queue("q", redis=client, prefix=prefix)
        try:
            yield proxy, queue
        finally:
            await queue.close()
            await client.aclose()


async def test_a_write_whose_answer_is_lost_is_outcome_unknown(
    redis_server: EmbeddedRedis, redis: Redis, prefix: str
) -> None:
    async with proxied_queue(redis_server, prefix) as (proxy, queue):
        await queue.add("x")  # loads the script, so the next add is one EVALSHA
        # When the connection breaks after Redis ran the add
        proxy.marker = b"EVALSHA"
        with pytest.raises(OutcomeUnknown) as caught:
            await queue.add("x", {"n": 2})
        assert proxy.dropped == 1
        # Then the error says the add may have happened, and how to retry safely
        assert caught.value.operation == "Queue.add()"
        assert "may have been applied" in str(caught.value) and "idempotency_key" in str(caught.value)
        # And indeed it had: the job is there, which is why retrying without a key would duplicate it
        record = await Queue("q", redis=redis, prefix=prefix).get_job("2")
        assert record is not None and record.payload == {"n": 2}
        # And a retry with an idempotency key is safe: a lost answer, then the retry, add one job
        proxy.marker = b"EVALSHA"
        with pytest.raises(OutcomeUnknown):
            await queue.add("x", idempotency_key="k")
        again = await queue.add("x", idempotency_key="k")
        assert (again.id, again.created) == ("3", False)
        assert (await queue.counts())["added"] == 3


async def test_a_read_whose_answer_is_lost_is_tried_once_more(
    redis_server: EmbeddedRedis, prefix: str
) -> None:
    async with proxied_queue(redis_server, prefix) as (proxy, queue):
        job = await queue.add("x", {"n": 1})
        proxy.marker = b"HGETALL"
        record = await queue.get_job(job.id)
        assert proxy.dropped == 1
        assert record is not None and record.payload == {"n": 1}


async def test_redis_out_of_memory_is_a_command_error_that_says_what_to_do(
    redis: Redis, queue: Queue
) -> None:
    await redis.config_set("maxmemory", "1")
    try:
        with pytest.raises(RedisCommandError, match="maxmemory") as caught:
            await queue.add("x")
    finally:
        await redis.config_set("maxmemory", "0")
    assert caught.value.reply.startswith("OOM")
    assert (await queue.counts())["added"] == 0


async def test_a_read_only_replica_is_a_command_error_that_says_use_the_primary(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    replica = EmbeddedRedis(tmp_path, binary=redis_server.binary, port=0, persist=False)
    await asyncio.to_thread(replica.start)
    client = connect(replica.url)
    try:
        await client.replicaof("127.0.0.1", redis_server.port)
        queue = Queue("q", redis=client)
        with pytest.raises(RedisCommandError, match="read-only replica; point Sluice at the primary"):
            await queue.add("x")
    finally:
        await client.aclose()
        await asyncio.to_thread(replica.stop)


async def test_a_server_that_is_not_redis_is_named_as_such() -> None:
    # Given an HTTP server where Redis was expected
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = connect(f"redis://127.0.0.1:{port}/0")
    try:
        with pytest.raises(RedisUnavailable, match="does not speak the Redis protocol") as caught:
            await Queue("q", redis=client).add("x")
        assert not isinstance(caught.value, OutcomeUnknown)
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_a_read_from_a_redis_that_never_answers_is_not_tried_twice() -> None:
    # Given a server that accepts connections and never answers
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = connect(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        with pytest.raises(RedisUnavailable, match="Timeout"):
            await Queue("q", redis=client).counts()
        # Then it gave up after one socket timeout, not two
        assert loop.time() - started < 0.9
    finally:
        await client.aclose()
        for writer in writers:
            writer.close()
            await writer.wait_closed()
        server.close()
        await server.wait_closed()


def test_a_url_option_redis_py_does_not_take_is_a_configuration_error() -> None:
    with pytest.raises(
        ConfigurationError, match=r"Redis URL 'redis://\*\*\*@h:1/0\?bogus_option=1' is not usable"
    ):
        connect("redis://:s3cret@h:1/0?bogus_option=1")


def test_a_loading_redis_is_unavailable_with_nothing_applied() -> None:
    err = translate(None, BusyLoadingError("Redis is loading the dataset in memory"), operation="Queue.add()")
    assert type(err) is RedisUnavailable
    assert "loading its data set" in str(err) and "nothing was applied" in str(err)
    unknown = translate(None, ResponseError("WEIRD something new"), operation=None)
    assert isinstance(unknown, RedisCommandError) and "report it" in str(unknown)


async def test_worker_logs_say_what_broke(caplog: pytest.LogCaptureFixture) -> None:
    # Given a worker pointed at a Redis that is not there
    port = free_port()
    worker = Worker("q", concurrency=1, lease=1.0)

    @worker.handler
    async def x(job: Any) -> None:
        return None

    caplog.set_level(logging.WARNING, logger="sluice")
    async with running(worker, f"redis://127.0.0.1:{port}/0"):
        await asyncio.sleep(0.6)
    # Then its log lines name the server and keep the transport's message
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("sluice")]
    assert any(f"Redis at redis://127.0.0.1:{port}/0" in line and "onnect" in line for line in lines), lines


async def test_a_stopping_worker_gives_up_on_a_redis_that_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a worker running a long job on a Redis of its own
    server = EmbeddedRedis(tmp_path, port=0, persist=False)
    await asyncio.to_thread(server.start)
    worker = Worker("q", concurrency=1, lease=5.0, shutdown_grace=0.5)
    started = asyncio.Event()

    @worker.handler
    async def slow(job: Any) -> None:
        started.set()
        await asyncio.sleep(30)

    caplog.set_level(logging.WARNING, logger="sluice")
    task = asyncio.create_task(worker.run(server.url, handle_signals=False))
    async with Queue.from_url(server.url, "q") as queue:
        job = await queue.add("slow")
    await asyncio.wait_for(started.wait(), 10)
    # When Redis goes away, and then the worker is told to stop
    await asyncio.to_thread(server.stop)
    worker.stop()
    # Then it releases the job after its grace, cannot report that, and stops all the same,
    # saying which job runs again once its lease expires
    await asyncio.wait_for(task, 15)
    assert "stopped without reporting 1 outcome(s)" in caplog.text
    assert f"jobs {job.id} run again once their leases expire" in caplog.text
