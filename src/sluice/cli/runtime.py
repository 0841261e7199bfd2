"""Running a command's coroutine against its queue.

:func:`run` uses uvloop when installed, plain asyncio otherwise.
:func:`with_queue` opens the queue a command names (starting the embedded
Redis if needed), runs the command's coroutine on it and words any library
error for that queue, so each command only says what it does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from redis.exceptions import RedisError

from sluice.cli.errors import CliFailure, explain
from sluice.cli.options import Target
from sluice.cli.output import stderr
from sluice.cli.server import redis_url
from sluice.engine import Queue
from sluice.engine.connection import connect
from sluice.engine.transport import translate
from sluice.errors import SluiceError

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def with_queue(target: Target, fn: Callable[[Queue], Awaitable[T]]) -> T:
    """Run ``fn(queue)`` on the target's queue and return what it returns.

    Library errors become one-line :class:`CliFailure` messages that name
    the queue; redis-py errors of the few direct client calls (a SCAN of
    the budgets) are mapped as the library maps its own first.
    """

    async def go(url: str) -> T:
        client = connect(url)
        queue = Queue(target.queue, redis=client, prefix=target.prefix)
        try:
            return await fn(queue)
        except RedisError as exc:
            raise translate(client, exc, operation=None) from exc
        finally:
            await queue.close()
            await client.aclose()

    try:
        with redis_url(target.redis, stderr()) as url:
            return run(go(url))
    except SluiceError as exc:
        raise CliFailure(explain(exc, target)) from exc
