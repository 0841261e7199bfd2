"""Errors of the Redis transport, mapped into Sluice's own tree (see sluice/errors.py).

Every public call that talks to Redis is marked :func:`reads` or
:func:`writes`. The mark decides what a failure means to the caller:

* the server could not be reached, refused the credentials, is loading its
  data, or the pool had no free connection: nothing was sent, so nothing
  happened: :class:`~sluice.errors.RedisUnavailable`;
* the connection broke *after* a command was sent: a read is simply tried
  once more on a new connection (that is what a server restart looks like
  to a pooled connection, and reading twice is harmless); a write may have
  been applied, so it becomes :class:`~sluice.errors.OutcomeUnknown` and is
  never repeated behind the caller's back;
* Redis answered with an error (out of memory, a read-only replica, an ACL
  refusal): :class:`~sluice.errors.RedisCommandError`, with what to do.

Connections that a restart left stale are found before a command is sent
(connection.py turns on redis-py's check), so a restart costs no error at all
in the common case; the read retry covers the rest. The server is always
named by a URL without its credentials.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ClusterCrossSlotError,
    ClusterDownError,
    InvalidResponse,
    MovedError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.errors import OutcomeUnknown, RedisCommandError, RedisUnavailable, SluiceError

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("sluice.transport")

P = ParamSpec("P")
R = TypeVar("R")


class HasRedis(Protocol):
    @property
    def redis(self) -> Redis: ...


S = TypeVar("S", bound=HasRedis)

#: Failures of the layer underneath; a SluiceError (also a ConnectionError, an
#: OSError) raised by an inner marked call passes through untouched.
TRANSPORT_ERRORS = (RedisError, OSError)

#: Replies of Redis that have a known cause, and what to do about each.
_ADVICE = {
    "OOM": "Redis reached its maxmemory: free memory or raise maxmemory (Sluice needs "
    "maxmemory-policy noeviction, or jobs may vanish)",
    "READONLY": "The URL points at a read-only replica; point Sluice at the primary",
    "NOPERM": "The Redis user lacks a permission: Sluice needs EVALSHA, SCRIPT LOAD and the "
    "commands its scripts run, on every key under its prefix",
    "NOAUTH": "Redis wants a password: put it in the URL (redis://:PASSWORD@host:port/0)",
    "WRONGTYPE": "A key under this queue's prefix holds another type: another program writes "
    "there; give Sluice a prefix of its own",
    "BUSY": "Redis is running a long script; wait, or end it with SCRIPT KILL",
    "MISCONF": "Redis cannot persist its data (see its log); fix the disk or its save settings",
    "MOVED": "The URL points at a Redis Cluster node but the client talks to one server only: "
    "build it with sluice's connect(url), or pass a redis.asyncio.RedisCluster",
    "ASK": "The URL points at a Redis Cluster node but the client talks to one server only: "
    "build it with sluice's connect(url), or pass a redis.asyncio.RedisCluster",
    "CLUSTERDOWN": "The Redis Cluster is down or electing a new master; retry in a moment, or check "
    "that every slot has a master (redis-cli --cluster check)",
    "TRYAGAIN": "The queue's slot is being moved between cluster nodes; retry in a moment",
}
_IN_SCRIPT = re.compile(r"^Error running script .*?: -([A-Z]+) (.*)$")
_CODED = (
    (OutOfMemoryError, "OOM"),
    (ReadOnlyError, "READONLY"),
    (NoPermissionError, "NOPERM"),
    (MovedError, "MOVED"),  # before AskError, of which it is a subclass
    (AskError, "ASK"),
    (ClusterDownError, "CLUSTERDOWN"),
    (TryAgainError, "TRYAGAIN"),
    (ClusterCrossSlotError, "CROSSSLOT"),
)
_UNKNOWN_REPLY = (
    "This is not expected: report it with the message at the Sluice issue tracker "
    "(Sluice needs Redis 6.2 or newer)"
)


def server_url(redis: Any) -> str:
    """The server a client talks to, as a URL without username or password."""
    pool = getattr(redis, "connection_pool", None)
    kwargs: dict[str, Any] = dict(getattr(pool, "connection_kwargs", {}) or {})
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    if not kwargs:
        return "Redis"
    connection_class = getattr(pool, "connection_class", None)
    scheme = "rediss" if connection_class is not None and "SSL" in connection_class.__name__ else "redis"
    return f"{scheme}://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().rstrip(".") or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _not_sent(exc: BaseException) -> bool:
    """True when the failure happened before any command reached the server.

    redis-py words its connect failures "Error ... connecting to ..." or
    "Timeout connecting to server", and a pool without a free connection "No
    connection available". tests/engine/test_transport.py fails if a new redis-py
    words a refused connection otherwise (every write would then say
    OutcomeUnknown).
    """
    if isinstance(exc, AuthenticationError | AuthorizationError | BusyLoadingError):
        return True
    text = str(exc)
    return "connecting to" in text or "No connection available" in text


def translate(redis: Any, exc: BaseException, *, operation: str | None) -> SluiceError:
    """The Sluice error for a transport failure; ``operation`` names a write (None: a read)."""
    url = server_url(redis)
    cause = _known_unavailability(exc)
    if cause is not None:
        return RedisUnavailable(url, *cause)
    if isinstance(exc, ResponseError):
        return _command_error(url, exc)
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
        if operation is not None and not _not_sent(exc):
            return OutcomeUnknown(url, _reason(exc), operation)
        return RedisUnavailable(url, _reason(exc))
    return RedisCommandError(url, _reason(exc), _UNKNOWN_REPLY)


def _known_unavailability(exc: BaseException) -> tuple[str, str] | None:
    """(reason, advice) for failures that say what the server is doing instead of serving."""
    if isinstance(exc, BusyLoadingError):
        return "it is loading its data set", "Retry in a moment: nothing was applied"
    if isinstance(exc, AuthenticationError | AuthorizationError):
        return (
            f"it refused the credentials ({_reason(exc)})",
            "Put the right user and password in the URL: redis://USER:PASSWORD@host:port/0",
        )
    if isinstance(exc, InvalidResponse):
        return (
            f"what answers there does not speak the Redis protocol ({_reason(exc)})",
            "Check that the URL points at a Redis server, not another kind of server",
        )
    return None


def _command_error(url: str, exc: ResponseError) -> RedisCommandError:
    # redis-py strips the error code from the replies it has classes for.
    code = next((c for cls, c in _CODED if isinstance(exc, cls)), None)
    reply = _reason(exc)
    wrapped = _IN_SCRIPT.search(reply)  # Redis 6.2: "Error running script (...): -OOM ..."
    if wrapped:
        code, reply = wrapped.group(1), f"{wrapped.group(1)} {wrapped.group(2)}"
    elif code is None:
        code = reply.split(" ", 1)[0].upper()
    else:
        reply = f"{code} {reply}"
    return RedisCommandError(url, reply, _ADVICE.get(code, _UNKNOWN_REPLY))


def _retryable_read(exc: BaseException) -> bool:
    """A connection that broke (a restarted server) is worth one more try; a server that
    did not answer in time is not (the try would take as long again)."""
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return False
    return isinstance(exc, RedisConnectionError | OSError) and not _not_sent(exc)


def _operation(fn: Callable[..., Any]) -> str:
    owner, _, name = fn.__qualname__.rpartition(".")
    return f"{owner.split('.')[-1] or 'Queue'}.{name}()"


def reads(
    fn: Callable[Concatenate[S, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """Mark a call that only reads: transport errors map to RedisUnavailable, and a
    connection that broke after the command was sent is tried once more."""
    return _read(fn, tries=2)


def reads_once(
    fn: Callable[Concatenate[S, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """Mark a read that is not tried again: one that waits (a result), where a second try
    would start the caller's whole wait over."""
    return _read(fn, tries=1)


def _read(
    fn: Callable[Concatenate[S, P], Coroutine[Any, Any, R]], tries: int
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    @functools.wraps(fn)
    async def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(1, tries + 1):
            try:
                return await fn(self, *args, **kwargs)
            except SluiceError:
                raise
            except TRANSPORT_ERRORS as exc:
                if attempt == tries or not _retryable_read(exc):
                    raise translate(self.redis, exc, operation=None) from exc
                log.info("Redis connection broke during a read (%s); trying once more", _reason(exc))
        raise AssertionError("unreachable")  # pragma: no cover

    call.__sluice_transport__ = "read"  # type: ignore[attr-defined]
    return call


def writes(
    fn: Callable[Concatenate[S, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """Mark a call that changes data: never retried; a break after sending is OutcomeUnknown."""
    operation = _operation(fn)

    @functools.wraps(fn)
    async def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(self, *args, **kwargs)
        except SluiceError:
            raise
        except TRANSPORT_ERRORS as exc:
            raise translate(self.redis, exc, operation=operation) from exc

    call.__sluice_transport__ = "write"  # type: ignore[attr-defined]
    return call


def reads_stream(
    fn: Callable[Concatenate[S, P], AsyncIterator[R]],
) -> Callable[Concatenate[S, P], AsyncIterator[R]]:
    """Mark an async generator that reads: its transport errors map to RedisUnavailable."""
    if not inspect.isasyncgenfunction(fn):
        raise TypeError(f"{fn.__qualname__} is not an async generator")

    @functools.wraps(fn)
    async def stream(self: S, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[R]:
        try:
            async for item in fn(self, *args, **kwargs):
                yield item
        except SluiceError:
            raise
        except TRANSPORT_ERRORS as exc:
            raise translate(self.redis, exc, operation=None) from exc

    stream.__sluice_transport__ = "read"  # type: ignore[attr-defined]
    return stream


def describe(exc: BaseException) -> str:
    """``Type: message`` for logs: the message is what tells an operator what broke."""
    return f"{type(exc).__name__}: {_reason(exc)}"
