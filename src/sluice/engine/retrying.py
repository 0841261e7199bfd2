"""How the worker's loops ride out a Redis that is away, slow or refusing: log, wait, go on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from sluice.engine.transport import describe, server_url
from sluice.errors import RedisCommandError, RedisUnavailable, SluiceError

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("sluice.worker")

#: Errors a loop rides out with a backoff: Redis unreachable, slow, restarting or
#: refusing commands (out of memory); the marked queue calls raise them mapped.
TRANSIENT = (RedisError, OSError, RedisUnavailable, RedisCommandError)


def reraise_if_cancelled() -> None:
    """Raise CancelledError if this task is being cancelled (redis-py may have swallowed it)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def pause_after(
    what: str,
    exc: BaseException,
    failures: int,
    *,
    worker_id: str,
    lease_ms: int,
    redis: Redis,
    wake: asyncio.Event | None = None,
) -> None:
    """Log the failure and wait before the next try (``wake`` cuts the wait short)."""
    # At most a quarter of a lease: once Redis is back, leases are renewed and
    # outcomes handed in before they expire.
    ceiling = min(5.0, lease_ms / 4000)
    delay = min(ceiling, 0.05 * 2 ** min(failures, 7)) * (0.5 + random.random() / 2)
    # A mapped error names the server itself; a raw one gets the URL added.
    error = str(exc) if isinstance(exc, SluiceError) else f"Redis at {server_url(redis)}: {describe(exc)}"
    log.warning(
        "worker %s: %s failed (%s); retrying in %.2fs",
        worker_id,
        what,
        error,
        delay,
        extra={"worker_id": worker_id, "error": error, "retry_in_s": round(delay, 2)},
    )
    if wake is None:
        await asyncio.sleep(delay)
    else:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await wake.wait()
