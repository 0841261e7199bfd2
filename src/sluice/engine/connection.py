"""Redis clients with explicit timeouts.

redis-py 8 changed the default socket timeout; a blocking read (BZPOPMIN,
XREAD BLOCK) longer than the socket timeout then fails as a connection error.
Sluice therefore always sets timeouts itself, and runs blocking reads on a
client of their own whose socket timeout is longer than any block it issues.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from sluice.errors import ConfigurationError

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
            f"Redis URL {url!r} is not usable; use redis://host:port/db, rediss://... or "
            "unix:///path/to/redis.sock (or unset SLUICE_REDIS_URL to use an embedded Redis)"
        )
    options.setdefault("socket_timeout", COMMAND_TIMEOUT)
    options.setdefault("socket_connect_timeout", CONNECT_TIMEOUT)
    options.setdefault("health_check_interval", 30)
    # Callers beyond the pool size wait for a connection instead of failing:
    # a thousand result waiters on one client is a normal thing to do.
    options.setdefault("max_connections", 64)
    options.setdefault("timeout", COMMAND_TIMEOUT)
    try:
        pool = aioredis.BlockingConnectionPool.from_url(url, **options)
    except ValueError as exc:
        raise ConfigurationError(f"Redis URL {url!r} is not usable: {exc}") from exc
    return aioredis.Redis.from_pool(pool)


def blocking_client(redis: aioredis.Redis) -> aioredis.Redis:
    """A new client to the same server for blocking reads, with a long socket timeout."""
    pool = redis.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs["socket_timeout"] = BLOCKING_TIMEOUT
    kwargs.setdefault("socket_connect_timeout", CONNECT_TIMEOUT)
    new_pool = aioredis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    return aioredis.Redis.from_pool(new_pool)
