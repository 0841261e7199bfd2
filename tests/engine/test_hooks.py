"""A worker's hooks (engine/hooks.py): startup, shutdown, and around each attempt."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice import AttemptEnd, Hook, JobContext, JobFailed, JobState, Queue, Worker
from sluice.errors import ConfigurationError
from tests.conftest import eventually, running


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


class Ends(Hook):
    """Keeps every AttemptEnd, by job id, and counts the before calls."""

    def __init__(self) -> None:
        self.begun: list[str] = []
        self.ends: dict[str, AttemptEnd] = {}

    def before_attempt(self, job: JobContext) -> Any:
        self.begun.append(job.id)

    def after_attempt(self, job: JobContext, end: AttemptEnd, before: Any) -> None:
        self.ends[job.id] = end


async def test_the_end_says_whether_the_timeout_fired_and_whether_the_name_has_a_handler(
    queue: Queue, redis: Redis, prefix: str
) -> None:
    ends = Ends()
    w = Worker("q", prefix=prefix, hooks=[ends])

    @w.handler
    async def sleepy(job: JobContext) -> None:
        await asyncio.sleep(5)

    @w.handler
    async def quick(job: JobContext) -> str:
        return "ok"

    async with running(w, redis):
        slow = await queue.add("sleepy", timeout=0.2, max_attempts=1)
        unknown = await queue.add("made-up-by-a-producer", max_attempts=1)
        done = await queue.add("quick")
        for job in (slow, unknown):
            with pytest.raises(JobFailed):
                await job.result(timeout=10)
        assert await done.result(timeout=10) == "ok"
    assert ends.ends[slow.id][:1] == ("dead",) and ends.ends[slow.id].timed_out
    assert ends.ends[slow.id].registered and ends.ends[slow.id].seconds >= 0.2
    assert ends.ends[unknown.id].outcome == "dead" and not ends.ends[unknown.id].registered
    assert "no handler named 'made-up-by-a-producer'" in (ends.ends[unknown.id].error or "")
    assert ends.ends[done.id] == ("completed", None, ends.ends[done.id].seconds, False, True)


async def test_an_attempt_stopped_before_its_task_ran_calls_no_hook(
    queue: Queue, redis: Redis, prefix: str
) -> None:
    """Two jobs leased in one call: the first handler to run stops the worker at once, which
    cancels the other attempt's task before it ever ran. Only the attempt that ran is seen,
    once before and once after; both jobs go back to waiting."""
    ends = Ends()
    w = Worker("q", prefix=prefix, hooks=[ends], concurrency=2)
    ran: list[str] = []

    @w.handler
    async def stopper(job: JobContext) -> None:
        ran.append(job.id)
        w.stop(immediately=True)
        await asyncio.sleep(10)

    jobs = [await queue.add("stopper") for _ in range(2)]
    async with running(w, redis) as task:
        await asyncio.wait_for(task, timeout=10)
    assert len(ran) == 1
    assert ends.begun == ran and list(ends.ends) == ran
    assert ends.ends[ran[0]].outcome == "released"
    for job in jobs:
        await eventually(lambda job=job: _state_is(queue, job.id, JobState.WAITING))


async def _state_is(queue: Queue, job_id: str, state: JobState) -> bool:
    record = await queue.get_job(job_id)
    return record is not None and record.state == state


async def test_an_outermost_hook_encloses_those_added_before_it(
    queue: Queue, redis: Redis, prefix: str
) -> None:
    log: list[Any] = []
    w = Worker("q", prefix=prefix, hooks=[Recorder("a", log)])
    w.add_hook(Recorder("b", log))
    w.add_hook(Recorder("outer", log), outermost=True)
    w.register("work", lambda job: "ok")
    assert [h.name for h in w.hooks if isinstance(h, Recorder)] == ["outer", "a", "b"]
    async with running(w, redis):
        assert await (await queue.add("work")).result(timeout=10) == "ok"
    around = [entry[:2] for entry in log if entry[1] in ("before", "after")]
    assert around == [
        ("outer", "before"),
        ("a", "before"),
        ("b", "before"),
        ("b", "after"),
        ("a", "after"),
        ("outer", "after"),
    ]


def test_a_hook_must_be_a_hook() -> None:
    with pytest.raises(ConfigurationError, match="Hook"):
        Worker("q").add_hook(object())  # type: ignore[arg-type]
