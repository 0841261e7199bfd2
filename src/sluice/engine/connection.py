"""Redis clients with explicit timeouts.

redis-py 8 changed the default socket timeout; a blocking read (BZPOPMIN,
XREAD BLOCK) longer than the socket timeout then fails as a connection error.
Sluice therefore always sets timeouts itself, and runs blocking reads on a
client of their own whose socket timeout is longer than any block it issues.

A pooled connection whose server restarted is replaced before a command is
sent on it: redis-py checks for that, but redis-py 8 skips the check while
its "maintenance notifications" (a Redis Cloud feature) are in their default
"auto" mode, so the first command after every restart failed. Sluice turns
them off; open-source Redis 6.2 and 7.x never send them.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from sluice.errors import ConfigurationError

try:
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:  # redis-py before 7 has no maintenance notifications, and checks always
    MaintNotificationsConfig = None  # type: ignore[assignment,misc]

#: Socket timeout of ordinary commands (scripts are short; 10 s means Redis is gone).
COMMAND_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0
#: Longest block Sluice ever asks for, and the socket timeout of blocking clients.
MAX_BLOCK = 5.0
BLOCKING_TIMEOUT = MAX_BLOCK + 10.0


def connect(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio client for ``url`` (redis://, rediss:// or unix://) with explicit timeouts."""
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
        # Build one connection object now (no I/O): an option it does not take fails here,
        # as a configuration error, not at the first command as a TypeError.
        pool.connection_class(**pool.connection_kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"Redis URL {redact(url)!r} is not usable: {exc}") from exc
    return aioredis.Redis.from_pool(pool)


def blocking_client(redis: aioredis.Redis) -> aioredis.Redis:
    """A new client to the same server for blocking reads, with a long socket timeout."""
    pool = redis.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs["socket_timeout"] = BLOCKING_TIMEOUT
    kwargs.setdefault("socket_connect_timeout", CONNECT_TIMEOUT)
    new_pool = aioredis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    return aioredis.Redis.from_pool(new_pool)


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
