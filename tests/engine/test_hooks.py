"""A worker's hooks (engine/hooks.py): startup, shutdown, and around each attempt."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import AttemptEnd, Hook, JobContext, JobFailed, Queue, Worker
from sluice.errors import ConfigurationError
from tests.conftest import running


class Recorder(Hook):
    def __init__(self, name: str, log: list[Any]) -> None:
        self.name = name
        self.log = log

    async def startup(self, state: dict[str, Any]) -> None:
        self.log.append((self.name, "startup"))
        state[self.name] = f"{self.name}'s client"

    async def shutdown(self, state: dict[str, Any]) -> None:
        self.log.append((self.name, "shutdown", state.pop(self.name)))

    def before_attempt(self, job: JobContext) -> Any:
        self.log.append((self.name, "before", job.name))
        return f"{self.name}:{job.id}"

    def after_attempt(self, job: JobContext, end: AttemptEnd, before: Any) -> None:
        self.log.append((self.name, "after", end.outcome, before == f"{self.name}:{job.id}"))


async def test_hooks_run_in_order_and_after_hooks_in_reverse(queue: Queue, redis: Redis, prefix: str) -> None:
    log: list[Any] = []
    w = Worker("q", prefix=prefix, hooks=[Recorder("a", log), Recorder("b", log)], concurrency=1)

    @w.handler
    async def work(job: JobContext) -> str:
        # The state the hooks' startup filled is the worker's, reachable from a handler.
        log.append(("handler", w.state["a"]))
        return "ok"

    async with running(w, redis):
        assert await (await queue.add("work")).result(timeout=10) == "ok"
    assert log == [
        ("a", "startup"),
        ("b", "startup"),
        ("a", "before", "work"),
        ("b", "before", "work"),
        ("handler", "a's client"),
        ("b", "after", "completed", True),
        ("a", "after", "completed", True),
        ("b", "shutdown", "b's client"),
        ("a", "shutdown", "a's client"),
    ]
    assert w.state == {}


async def test_a_hook_that_raises_fails_neither_the_attempt_nor_the_others(
    queue: Queue, redis: Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    log: list[Any] = []

    class Broken(Hook):
        def before_attempt(self, job: JobContext) -> Any:
            raise RuntimeError("before")

        def after_attempt(self, job: JobContext, end: AttemptEnd, before: Any) -> None:
            raise RuntimeError("after")

    w = Worker("q", prefix=prefix, hooks=[Broken(), Recorder("r", log)])

    @w.handler
    async def boom(job: JobContext) -> None:
        raise ValueError("no")

    async with running(w, redis):
        job = await queue.add("boom", max_attempts=1)
        with pytest.raises(JobFailed):
            await job.result(timeout=10)
    assert ("r", "after", "dead", True) in log
    assert "failed before job" in caplog.text and "failed after job" in caplog.text


async def test_a_startup_that_raises_stops_the_run_and_shuts_down_those_started(
    redis: Redis, prefix: str
) -> None:
    log: list[Any] = []

    class NoStart(Hook):
        async def startup(self, state: dict[str, Any]) -> None:
            raise OSError("no model")

    w = Worker("q", prefix=prefix, hooks=[Recorder("a", log), NoStart(), Recorder("c", log)])
    w.register("x", lambda job: None)
    with pytest.raises(OSError, match="no model"):
        await w.run(redis, handle_signals=False)
    assert log == [("a", "startup"), ("a", "shutdown", "a's client")]


def test_a_hook_must_be_a_hook() -> None:
    with pytest.raises(ConfigurationError, match="Hook"):
        Worker("q").add_hook(object())  # type: ignore[arg-type]
