"""Redis clients with explicit timeouts, for one Redis or for a Redis Cluster.

redis-py 8 changed the default socket timeout; a blocking read (BZPOPMIN,
XREAD BLOCK) longer than the socket timeout then fails as a connection error.
Sluice therefore always sets timeouts itself, and runs blocking reads on a
client of their own whose socket timeout is longer than any block it issues.

A pooled connection whose server restarted is replaced before a command is
sent on it: redis-py checks for that, but redis-py 8 skips the check while
its "maintenance notifications" (a Redis Cloud feature) are in their default
"auto" mode, so the first command after every restart failed. Sluice turns
them off; open-source Redis 6.2 and 7.x never send them.

A URL may name any node of a Redis Cluster, and nothing in it says so. The
client :func:`connect` returns therefore finds out with its first command
(``CLUSTER INFO``: a single server refuses it, a cluster node answers) and,
on a cluster, sends every command through a redis-py cluster client, which
routes it to the master that owns its key's slot and follows MOVED
replies. Every key of a queue shares the hash tag ``{queue}`` (keys.py), so
all that one queue does lands on one master: the worker's own connections
(the pump's wire, the blocking clients) go straight to that master
(:func:`server_for`) and look for it again after a MOVED or ASK reply or a
broken connection (a failover, a resharding).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.engine.cancel_safe import cancel_safe, cancel_safe_cluster
from sluice.errors import ConfigurationError

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from redis.asyncio.connection import AbstractConnection

try:
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:  # redis-py before 7 has no maintenance notifications, and checks always
    MaintNotificationsConfig = None  # type: ignore[assignment,misc]

T = TypeVar("T")

#: Socket timeout of ordinary commands (scripts are short; 10 s means Redis is gone).
COMMAND_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0
#: Longest block Sluice ever asks for, and the socket timeout of blocking clients.
MAX_BLOCK = 5.0
BLOCKING_TIMEOUT = MAX_BLOCK + 10.0

#: Failures after which the server that holds a key may be another one: the slot
#: moved (MOVED, ASK), the cluster is electing a new master, or the master is gone.
REROUTE_ERRORS = (
    MovedError,
    AskError,
    ClusterDownError,
    TryAgainError,
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
)


#: Commands about the whole keyspace: on a cluster they ask every master (redis-py
#: would ask one), as :meth:`Client.scan_iter` does.
_WHOLE_KEYSPACE = frozenset({"KEYS", "DBSIZE"})


def connect(url: str, **options: Any) -> Client:
    """An asyncio client for ``url`` (redis://, rediss:// or unix://) with explicit timeouts.

    ``url`` may be any node of a Redis Cluster: the client finds out at its
    first command and then talks to the whole cluster (see :class:`Client`).
    """
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigurationError(
            f"Redis URL {redact(url)!r} is not usable; use redis://host:port/db, rediss://... or "
            "unix:///path/to/redis.sock (or unset SLUICE_REDIS_URL to use an embedded Redis)"
        )
    options.setdefault("socket_timeout", COMMAND_TIMEOUT)
    options.setdefault("socket_connect_timeout", CONNECT_TIMEOUT)
    options.setdefault("health_check_interval", 30)
    # Callers beyond the pool size wait for a connection instead of failing:
    # a thousand result waiters on one client is a normal thing to do.
    options.setdefault("max_connections", 64)
    options.setdefault("timeout", COMMAND_TIMEOUT)
    if MaintNotificationsConfig is not None:
        options.setdefault("maint_notifications_config", MaintNotificationsConfig(enabled=False))
    try:
        pool = aioredis.BlockingConnectionPool.from_url(url, **options)
        pool.connection_class = cancel_safe(pool.connection_class)
        # Build one connection object now (no I/O): an option it does not take fails here,
        # as a configuration error, not at the first command as a TypeError.
        pool.connection_class(**pool.connection_kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"Redis URL {redact(url)!r} is not usable: {exc}") from exc
    return Client(pool, url=url, options=options)


class Client(aioredis.Redis):
    """A client of one Redis, or of the Redis Cluster that its URL is a node of.

    Built by :func:`connect` (or :meth:`wrapping` a ``RedisCluster``). Its
    first command asks ``CLUSTER INFO``; a single server refuses it, and the
    client then works exactly as a plain ``redis.asyncio.Redis``. On a cluster
    node, every command, pipeline and SCAN goes through a redis-py
    ``RedisCluster`` built from the same URL and options, which routes each
    command to the master that owns its key's slot. That cluster client never
    retries a command behind the caller's back (a write that may have been
    applied must not be sent twice; see transport.py): after a broken
    connection the command fails, and the next one finds the nodes again.
    Commands at once are capped at ``max_connections`` over the whole cluster,
    and callers beyond it wait as they would for the single server's pool.
    """

    def __init__(
        self,
        pool: aioredis.ConnectionPool,
        *,
        url: str | None,
        options: dict[str, Any],
        cluster: RedisCluster | None = None,
    ) -> None:
        super().__init__(connection_pool=pool)
        self.auto_close_connection_pool = True
        self._url = url
        self._options = options
        self._cluster = cluster
        self._owns_cluster = cluster is None
        #: whether the server has been told apart (single or cluster)
        self._known = cluster is not None
        #: "single" was only a guess: CLUSTER INFO was refused (an ACL), so a MOVED may follow
        self._guessed = False
        self._lock = asyncio.Lock()
        self._max = int(options.get("max_connections", 64))
        self._free = asyncio.Semaphore(self._max)
        self._wait = float(options.get("timeout", COMMAND_TIMEOUT))

    @classmethod
    def wrapping(cls, cluster: RedisCluster) -> Client:
        """A client that sends everything through ``cluster`` (which the caller keeps and closes)."""
        node = next(iter(cluster.nodes_manager.startup_nodes.values()))
        # Never used to send a command: it names the cluster in messages (transport.server_url).
        pool = aioredis.ConnectionPool(connection_class=node.connection_class, host=node.host, port=node.port)
        return cls(pool, url=None, options={}, cluster=cluster)

    async def cluster_client(self) -> RedisCluster | None:
        """The cluster client when the server is a cluster node, else None (asks on the first call)."""
        if not self._known:
            async with self._lock:
                if not self._known:
                    await self._detect()
        return self._cluster

    async def _detect(self) -> None:
        try:
            await super().execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        except ResponseError as exc:
            # "ERR This instance has cluster support disabled": a single server. Any other
            # refusal (a user whose ACL lacks CLUSTER) leaves it open; a MOVED reply will tell.
            self._guessed = "disabled" not in str(exc)
        else:
            await self._become_cluster()
        self._known = True

    async def _become_cluster(self) -> None:
        if "path" in self.connection_pool.connection_kwargs or self._url is None:
            raise ConfigurationError(
                f"{redact(self._url)} is a node of a Redis Cluster, reached over a unix socket; "
                "cluster clients need TCP: use the node's redis://host:port URL"
            )
        options = {k: v for k, v in self._options.items() if k != "timeout"}  # the pool's wait
        # Connection errors are not retried (see the class docstring); MOVED and ASK are
        # followed all the same: a command redirected was not applied.
        options.setdefault("retry", Retry(NoBackoff(), 0))
        # A slot of another queue being moved must not stop this queue's commands.
        options.setdefault("require_full_coverage", False)
        try:
            cluster = cancel_safe_cluster(RedisCluster.from_url(self._url, **options))
        except (TypeError, ValueError, RedisClusterException) as exc:
            raise ConfigurationError(
                f"Redis URL {redact(self._url)!r} names a Redis Cluster node, but a cluster "
                f"client cannot be built with its options: {exc}"
            ) from exc
        try:
            await mapped(cluster.initialize())
        except BaseException:
            await cluster.aclose()
            raise
        self._cluster = cluster
        self._guessed = False

    @contextlib.asynccontextmanager
    async def _connection_slot(self) -> AsyncIterator[None]:
        """Wait for one of ``max_connections`` (as the single server's blocking pool does)."""
        try:
            async with asyncio.timeout(self._wait):
                await self._free.acquire()
        except TimeoutError:
            raise RedisConnectionError(
                f"No connection available: all {self._max} of the cluster client's connections "
                f"stayed busy for {self._wait}s"
            ) from None
        try:
            yield
        finally:
            self._free.release()

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        cluster = self._cluster if self._known else await self.cluster_client()
        if cluster is None:
            try:
                return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
            except MovedError:
                if not self._guessed:
                    raise
                # A cluster node after all: the command was not applied (MOVED), send it again.
                async with self._lock:
                    if self._cluster is None:
                        await self._become_cluster()
                return await self.execute_command(*args, **options)
        if args and args[0] in _WHOLE_KEYSPACE:
            options.setdefault("target_nodes", RedisCluster.PRIMARIES)
        async with self._connection_slot():
            return await mapped(cluster.execute_command(*args, **options))

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        return _Pipeline(self, transaction, shard_hint)

    async def scan_iter(  # type: ignore[override] # redis-py types it as a sync Iterator
        self, match: Any = None, count: int | None = None, _type: str | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """SCAN over the server, or over every master of the cluster."""
        cluster = await self.cluster_client()
        source = (
            super().scan_iter(match, count, _type, **kwargs)
            if cluster is None
            else cluster.scan_iter(match=match, count=count, _type=_type, **kwargs)
        )
        try:
            async for key in source:
                yield key
        except RedisClusterException as exc:
            raise _cluster_error(exc) from exc

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        cluster = self._cluster
        if cluster is not None and self._owns_cluster:
            await cluster.aclose()
            # RedisCluster.aclose() does nothing while the client waits to find its nodes
            # again (after a broken connection): close their connections all the same.
            await cluster.nodes_manager.aclose()
            await cluster.nodes_manager.aclose("startup_nodes")
        await super().aclose(close_connection_pool)


class _Pipeline(Pipeline):
    """A pipeline of a :class:`Client`: queued as usual, sent to the cluster if it is one."""

    def __init__(self, client: Client, transaction: bool, shard_hint: str | None) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, transaction, shard_hint)
        self._client = client

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        cluster = await self._client.cluster_client()
        if cluster is None:
            result: list[Any] = await super().execute(raise_on_error)
            return result
        stack, self.command_stack = self.command_stack, []
        async with self._client._connection_slot():  # the client's own cap
            if self.is_transaction:
                return await _transaction(cluster, stack, self.response_callbacks, raise_on_error)
            pipe = cluster.pipeline()
            for args, options in stack:
                pipe.execute_command(*args, **options)
            return await mapped(pipe.execute(raise_on_error))


async def _transaction(
    cluster: RedisCluster, stack: list[Any], callbacks: Any, raise_on_error: bool
) -> list[Any]:
    """MULTI/EXEC on the master of the first command's key (a queue's keys share one slot).

    redis-py's cluster transactions queue each command through a thread of its
    own with an event loop of its own, which must not meet a cluster client that
    is reconnecting; a transaction of one slot needs no more than one master.
    A MOVED reply means nothing was applied: the slot map is read again and the
    transaction sent once more.
    """
    for attempt in (1, 2):
        connection_class, kwargs = await _cluster_server(cluster, stack[0][0][1], refresh=attempt > 1)
        pool = aioredis.ConnectionPool(connection_class=connection_class, **kwargs)
        pipe = Pipeline(pool, callbacks, True, None)
        pipe.command_stack = list(stack)
        try:
            return await pipe.execute(raise_on_error)
        except (MovedError, AskError):
            if attempt == 2:
                raise
        finally:
            await pipe.reset()  # type: ignore[no-untyped-call]
            await pool.disconnect()
    raise AssertionError("unreachable")  # pragma: no cover


async def _cluster_server(
    cluster: RedisCluster, key: Any, *, refresh: bool
) -> tuple[type[AbstractConnection], dict[str, Any]]:
    """Connection class and settings of the master for ``key`` (reading the slot map again
    first when ``refresh``)."""

    async def find() -> Any:
        await cluster.initialize()  # a client that lost a node reads the slot map at its next use
        if refresh:
            await cluster.nodes_manager.initialize()
        return cluster.get_node_from_key(key)

    node = await mapped(find())
    kwargs = dict(node.connection_kwargs)
    if MaintNotificationsConfig is not None:
        kwargs.setdefault("maint_notifications_config", MaintNotificationsConfig(enabled=False))
    return cancel_safe(node.connection_class), kwargs


async def mapped(awaitable: Awaitable[T]) -> T:
    """Await a cluster call; its cluster-level failures become redis-py errors.

    redis-py raises some cluster failures as ``RedisClusterException``, which
    is not a ``RedisError``: no node could be reached, or a slot has no master
    for now. They are connection failures (nothing was sent), so the engine's
    error mapping (transport.py) and the worker's loops treat them as such.
    """
    try:
        return await awaitable
    except RedisClusterException as exc:
        raise _cluster_error(exc) from exc


def _cluster_error(exc: RedisClusterException) -> RedisError:
    text = str(exc)
    if isinstance(exc, SlotNotCoveredError) or any(
        words in text for words in ("cannot be connected", "not covered", "not enabled")
    ):
        return RedisConnectionError(f"Error connecting to the Redis Cluster: {text}")
    return RedisError(text)


async def server_for(
    redis: aioredis.Redis, key: str, *, refresh: bool = False
) -> tuple[type[AbstractConnection], dict[str, Any]]:
    """Connection class and settings of the server that holds ``key``.

    The client's own server, or on a cluster the master that owns the key's
    slot; with ``refresh``, as the cluster says now (after a MOVED, ASK or
    broken connection). For connections of the worker's own (the pump's wire,
    blocking reads) that skip the client and its routing.
    """
    cluster = await redis.cluster_client() if isinstance(redis, Client) else None
    if cluster is None:
        pool = redis.connection_pool
        return cancel_safe(pool.connection_class), dict(pool.connection_kwargs)
    return await _cluster_server(cluster, key, refresh=refresh)


def adopt(redis: aioredis.Redis | RedisCluster) -> aioredis.Redis:
    """The client a Queue uses: ``redis`` itself, or a :class:`Client` around a ``RedisCluster``."""
    return Client.wrapping(redis) if isinstance(redis, RedisCluster) else redis


def _blocking_pool(
    connection_class: type[AbstractConnection], kwargs: dict[str, Any]
) -> aioredis.ConnectionPool:
    kwargs = dict(kwargs)
    kwargs["socket_timeout"] = BLOCKING_TIMEOUT
    kwargs.setdefault("socket_connect_timeout", CONNECT_TIMEOUT)
    return aioredis.ConnectionPool(connection_class=cancel_safe(connection_class), **kwargs)


class _BlockingClient(aioredis.Redis):
    """A client of the one server that holds ``key``, with a socket timeout longer than any block.

    For a queue's blocking reads (BZPOPMIN of its wake marker, XREAD BLOCK of
    its events): a cluster client would look the key up with an extra round
    trip (COMMAND GETKEYS) for every XREAD, and this one needs a single server.
    It finds that server before its first command and again after a failure
    that may mean the key's slot moved; a read that MOVED, or whose master was
    gone before it was sent, is sent once more to the master named now (it
    only ever reads, so a second try is harmless).
    """

    def __init__(self, parent: aioredis.Redis, key: str) -> None:
        pool = parent.connection_pool
        super().__init__(connection_pool=_blocking_pool(pool.connection_class, pool.connection_kwargs))
        self.auto_close_connection_pool = True
        self._parent = parent
        self._key = key
        # A plain client (not one of connect()'s) has its one server: nothing to find.
        self._placed = not isinstance(parent, Client)
        self._stale = False

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        for attempt in (1, 2):
            if not self._placed:
                await self._place()
            try:
                return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
            except REROUTE_ERRORS as exc:
                if not isinstance(self._parent, Client):
                    raise
                self._placed = False
                self._stale = True
                # A command that MOVED, or that found its master gone, was not run: send it
                # once more, to the master the cluster names now.
                if attempt == 2 or not (isinstance(exc, MovedError) or _not_sent(exc)):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _place(self) -> None:
        connection_class, kwargs = await server_for(self._parent, self._key, refresh=self._stale)
        current = self.connection_pool.connection_kwargs
        where = ("host", "port", "path")
        if any(kwargs.get(k) != current.get(k) for k in where):
            old, self.connection_pool = self.connection_pool, _blocking_pool(connection_class, kwargs)
            await old.disconnect()
        self._placed = True
        self._stale = False


def _not_sent(exc: BaseException) -> bool:
    """A connection that could not be opened (redis-py words it "Error ... connecting to")."""
    return isinstance(exc, RedisConnectionError) and "connecting to" in str(exc)


def blocking_client(redis: aioredis.Redis, key: str) -> aioredis.Redis:
    """A new client for blocking reads of ``key`` (BZPOPMIN, XREAD BLOCK), with a long socket timeout.

    It talks to the server that holds ``key``: the client's own, or on a
    cluster the master that owns the key's slot.
    """
    return _BlockingClient(redis, key)


def redact(url: object) -> str:
    """A URL with its password (and user) replaced, for messages and logs."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    creds, at, host = rest.rpartition("@")
    if not at:
        return text
    return f"{scheme}://***@{host}" if creds else text
