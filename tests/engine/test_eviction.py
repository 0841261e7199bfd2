"""A Redis that may evict keys is named once: it can lose accepted jobs without an error."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import Queue
from sluice.engine import eviction


async def test_an_evicting_redis_is_warned_about_once(
    redis: Redis, prefix: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eviction, "_checked", set())
    config: Any = await redis.config_get("maxmemory-policy")
    before = str(config["maxmemory-policy"])
    await redis.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with caplog.at_level(logging.WARNING, logger="sluice.queue"):
            first, second = Queue("a", redis=redis, prefix=prefix), Queue("b", redis=redis, prefix=prefix)
            await first.add("x")
            await first.add("x")
            await second.add("x")
    finally:
        await redis.config_set("maxmemory-policy", before)
    warnings = [r for r in caplog.records if "maxmemory-policy allkeys-lru" in r.getMessage()]
    assert len(warnings) == 1
    assert "set maxmemory-policy noeviction" in warnings[0].getMessage()


async def test_noeviction_is_not_warned_about(
    redis: Redis, prefix: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eviction, "_checked", set())
    assert (await redis.config_get("maxmemory-policy"))["maxmemory-policy"] == "noeviction"
    with caplog.at_level(logging.WARNING, logger="sluice.queue"):
        await Queue("a", redis=redis, prefix=prefix).add("x")
    assert not [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
