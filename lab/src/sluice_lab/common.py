"""What every benchmark needs: a Redis, a record of the machine, a clean-up, a JSON file.

A benchmark must never disturb data that is not its own: it runs on a queue
with a fresh random name and deletes exactly that queue's keys afterwards,
so ``--redis`` may point at a server that holds other data (never FLUSHDB).
Figures only mean something next to the machine and the load they were
measured under, so both go into the JSON.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import secrets
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from redis import Redis as SyncRedis
from redis.exceptions import RedisError

import sluice
from sluice.engine.connection import connect, redact
from sluice.engine.keys import QueueKeys
from sluice.errors import RedisUnavailable
from sluice.local.embedded import EmbeddedRedis
from sluice.settings import ENV_REDIS_URL

if TYPE_CHECKING:
    from redis.asyncio import Redis


@contextmanager
def bench_redis(explicit: str | None) -> Iterator[tuple[str, str]]:
    """Yield (url, origin): ``--redis``, else $SLUICE_REDIS_URL, else a throw-away server.

    The embedded server is non-persistent and listens on a free loopback
    port (not the CLI's shared ./.sluice socket): a benchmark should neither
    write an append-only file nor measure someone else's traffic.
    """
    url = explicit or os.environ.get(ENV_REDIS_URL)
    if url:
        check_redis(url)
        yield url, "given"
        return
    with tempfile.TemporaryDirectory(prefix="sluice-bench-redis-") as tmp:
        server = EmbeddedRedis(tmp, port=0, persist=False)
        with server:
            yield server.url, f"embedded redis-server {server.binary.version} ({server.binary.origin})"


def check_redis(url: str) -> None:
    """A given Redis answers a PING, or the benchmark stops here, saying so: a refused
    connection deep inside a run read as an internal error."""
    connect(url)  # the URL's form (a ConfigurationError saying how to write it)
    client = SyncRedis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
    except (RedisError, OSError) as exc:
        raise RedisUnavailable(
            redact(url),
            " ".join(str(exc).split()).rstrip(".") or type(exc).__name__,
            "Check that it runs and that --redis or SLUICE_REDIS_URL names it; without either, the "
            "benchmark starts a throw-away Redis of its own",
        ) from None
    finally:
        client.close()


def new_queue_name(kind: str) -> str:
    return f"bench-{kind}-{secrets.token_hex(4)}"


async def drop_queue(redis: Redis, queue: str, prefix: str = "sluice") -> int:
    """Delete every key of one queue (they all start with its base, hash tag included)."""
    base = QueueKeys.for_queue(queue, prefix).base
    pattern = base.replace("[", "\\[").replace("]", "\\]").replace("*", "\\*").replace("?", "\\?") + "*"
    removed = 0
    batch: list[Any] = []
    async for key in redis.scan_iter(match=pattern, count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            removed += await redis.unlink(*batch)
            batch = []
    if batch:
        removed += await redis.unlink(*batch)
    return removed


async def machine_meta(redis: Redis, url: str, origin: str) -> dict[str, Any]:
    """The machine, the software and the load the figures were measured under."""
    info: Any = await redis.info("server")
    try:
        loop = f"uvloop {importlib.metadata.version('uvloop')}"
    except importlib.metadata.PackageNotFoundError:
        loop = "asyncio"
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "sluice": sluice.__version__,
        "python": sys.version.split()[0],
        "event_loop": loop,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "redis_version": info.get("redis_version"),
        "redis_url": url,
        "redis_origin": origin,
        "command": " ".join(sys.argv),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    data.setdefault("meta", {})["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
