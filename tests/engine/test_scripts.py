"""The Lua loader: includes expanded once, cycles refused, every command loads on Redis."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from sluice.engine.scripts import COMMANDS, expand, source
from sluice.errors import ConfigurationError


def test_include_is_expanded_once() -> None:
    parts = {"a": "-- @include c\nlocal A = 1", "b": "-- @include c\nlocal B = 2", "c": "local C = 3"}
    text = expand("-- @include a\n-- @include b\nreturn A + B + C", parts.__getitem__)
    assert text.count("local C = 3") == 1
    assert text.index("local C = 3") < text.index("local A = 1") < text.index("local B = 2")


def test_include_cycle_is_refused() -> None:
    parts = {"a": "-- @include b", "b": "-- @include a"}
    with pytest.raises(ConfigurationError, match="cycle: a -> b -> a"):
        expand("-- @include a", parts.__getitem__)


def test_self_include_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="cycle: a -> a"):
        expand("-- @include a", {"a": "-- @include a"}.__getitem__)


def test_unknown_command() -> None:
    with pytest.raises(ConfigurationError, match="unknown Lua command"):
        source("nope")


@pytest.mark.parametrize("command", COMMANDS)
async def test_every_command_compiles_on_redis(redis: Redis, command: str) -> None:
    text = source(command)
    assert "@include" not in text.replace("-- (include", "")
    sha = await redis.script_load(text)
    assert len(sha) == 40


async def test_scripts_reload_after_script_flush(redis: Redis, prefix: str) -> None:
    from sluice import Queue

    q = Queue("q", redis=redis, prefix=prefix)
    await q.add("a")
    await redis.script_flush()
    job = await q.add("b")  # NOSCRIPT -> loaded again
    assert job.id == "2"
