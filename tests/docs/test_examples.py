"""The examples in examples/ run as documented."""

from __future__ import annotations

import pytest
from examples import produce
from examples.tasks import worker
from redis.asyncio import Redis

from tests.conftest import running


async def test_examples_run(redis: Redis, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    worker.prefix = "sluice"
    async with running(worker, redis):
        await produce.main(redis_url)
    out = capsys.readouterr().out
    assert "JOB 0" in out and "JOB 9" in out
