"""A task cancelled while it talks to Redis stops.

On Python 3.11, redis-py bounds each write with ``asyncio.wait_for``, which
drops a cancellation that arrives as the write finishes: the task runs on.
A poller cancelled that way kept a test's event loop from closing and a CI run
timed out. Sluice's clients write through connections that keep it
(engine/cancel_safe.py); these tests cancel a task at random moments of a
command stream, hundreds of times, on every client Sluice builds. With
redis-py's own connections the first test fails within its first few tries.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from redis.asyncio import Redis

from sluice.engine.connection import blocking_client, connect
from sluice.local.embedded import EmbeddedRedis

TRIES = 200


async def cancel_at_random(command: Callable[[], Awaitable[object]]) -> None:
    """Run ``command`` in a loop and cancel it at a random moment, ``TRIES`` times."""
    rng = random.Random(7)
    for attempt in range(TRIES):

        async def loop() -> None:
            while True:
                await command()

        task = asyncio.create_task(loop())
        await asyncio.sleep(rng.random() * 0.005)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)
        if not done:
            for _ in range(100):  # stop it all the same, or the event loop cannot close
                task.cancel()
                await asyncio.sleep(0.01)
        assert done, f"try {attempt}: the cancelled task went on running ({task})"
        assert task.cancelled()


async def test_a_cancelled_command_cancels_its_task(redis: Redis, prefix: str) -> None:
    await cancel_at_random(lambda: redis.get(f"{prefix}:k"))
    # and the client still answers afterwards, in order
    await redis.set(f"{prefix}:k", "v")
    assert await redis.get(f"{prefix}:k") == b"v"


async def test_a_cancelled_pipeline_cancels_its_task(redis: Redis, prefix: str) -> None:
    async def pipeline() -> object:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.incr(f"{prefix}:n")
            pipe.get(f"{prefix}:n")
            return await pipe.execute()

    await cancel_at_random(pipeline)


async def test_a_cancelled_blocking_read_cancels_its_task(redis: Redis, prefix: str) -> None:
    reader = blocking_client(redis, f"{prefix}:wake")
    try:
        await cancel_at_random(lambda: reader.bzpopmin(f"{prefix}:wake", 0.001))
    finally:
        await reader.aclose()


def test_a_cancelled_command_on_a_unix_socket_cancels_its_task() -> None:
    with (
        tempfile.TemporaryDirectory(dir="/tmp") as folder,
        EmbeddedRedis(Path(folder), persist=False) as server,
    ):
        assert server.url.startswith("unix://")

        async def run() -> None:
            client = connect(server.url)
            try:
                await cancel_at_random(client.ping)
            finally:
                await client.aclose()

        asyncio.run(run())
