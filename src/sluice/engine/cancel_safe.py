"""Connections whose writes never swallow a task's cancellation.

redis-py bounds a write with ``asyncio.wait_for(send, socket_timeout)``. On
Python 3.11 ``wait_for`` returns the inner result when the outer task is
cancelled at the moment the send finishes, and the ``CancelledError`` is lost:
the cancelled task goes on as if nothing had happened. A worker cancels
tasks to stop them (shutdown, a job's timeout, a poller that is no longer
needed), so a write that loses one leaves a task running forever and a
shutdown that never ends (seen: a test's event loop could not close, a CI run
timed out). Every send is a few microseconds long and every command sends, so
the window is hit in practice.

These classes bound the write with ``asyncio.timeout`` instead, which
re-raises a cancellation that arrives while it runs. Everything else is
redis-py's own code: the health check, the write itself and its error
mapping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import redis.asyncio.connection as rconn
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import TimeoutError as RedisTimeoutError


class _CancelSafeSend(rconn.AbstractConnection):
    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        limit = self.socket_timeout
        if not limit:
            await super().send_packed_command(command, check_health)
            return
        if not self.is_connected:
            await self.connect_check_health(check_health=False)
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        # With no socket timeout redis-py writes and drains directly (no wait_for); the
        # connection serves one command at a time, so nothing else reads the field meanwhile.
        self.socket_timeout = None
        try:
            async with asyncio.timeout(limit):
                await super().send_packed_command(command, check_health=False)
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = limit


class Connection(_CancelSafeSend, rconn.Connection):
    """A TCP connection (``redis://``)."""


class SSLConnection(_CancelSafeSend, rconn.SSLConnection):
    """A TLS connection (``rediss://``)."""


class UnixDomainSocketConnection(_CancelSafeSend, rconn.UnixDomainSocketConnection):
    """A unix socket connection (``unix://``)."""


def for_url(url: str) -> type[rconn.AbstractConnection]:
    """The cancel-safe connection class for ``url``'s scheme."""
    if url.startswith("rediss://"):
        return SSLConnection
    if url.startswith("unix://"):
        return UnixDomainSocketConnection
    return Connection


def cancel_safe(connection_class: type[rconn.AbstractConnection]) -> type[rconn.AbstractConnection]:
    """``connection_class``'s cancel-safe twin (itself if it is one, or one Sluice does not know)."""
    if issubclass(connection_class, _CancelSafeSend):
        return connection_class
    for safe in (SSLConnection, UnixDomainSocketConnection, Connection):
        if connection_class is safe.__mro__[2]:
            return safe
    return connection_class


def cancel_safe_cluster(cluster: RedisCluster) -> RedisCluster:
    """``cluster`` (not yet initialized) with cancel-safe connections to every node it finds."""
    for kwargs in (cluster.connection_kwargs, cluster.nodes_manager.connection_kwargs):
        kwargs["connection_class"] = cancel_safe(kwargs.get("connection_class", rconn.Connection))
    for node in cluster.nodes_manager.startup_nodes.values():
        node.connection_class = cancel_safe(node.connection_class)  # type: ignore[assignment]
    return cluster
