"""Time, as Redis tells it.

Every time the engine judges (a lease's end, a rate window, a delay, a
throttle, a calendar period) is read by the scripts from Redis's own clock
(``TIME``, see lua/includes/clock.lua), so workers and producers on hosts
whose clocks disagree still agree on when a lease ends. A caller passes
``now=None``; tests that drive time pass a number, which :func:`script_now`
hands to the script in place of Redis's clock, or install a clock of their
own for every call with :func:`set_test_clock` (never done outside tests).

:func:`now_ms` (this host's clock) is for what only this process sees, such
as how long to sleep; :func:`queue_now_ms` reads Redis's clock for the calls
that compare with it outside a script.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class _Core(Protocol):
    async def now_ms(self) -> int: ...


class QueueLike(Protocol):
    """What :func:`queue_now_ms` needs of a queue: its core (sluice.engine.core)."""

    @property
    def core(self) -> _Core: ...


_test_clock: Callable[[], int] | None = None


def set_test_clock(clock: Callable[[], int] | None) -> None:
    """Make every script call without a ``now`` use ``clock()`` (None: Redis's clock again).

    For tests that compare the engine with a model step by step; a process
    that serves real work never calls it.
    """
    global _test_clock  # noqa: PLW0603 - one switch for the whole process, by design
    _test_clock = clock


def now_ms() -> int:
    """This host's wall clock, in ms."""
    return time.time_ns() // 1_000_000


#: The ``now`` argument that tells a script to read Redis's clock.
REDIS_CLOCK = ""


def script_now(now: int | None) -> int | str:
    """The ``now`` argument of a script: Redis's clock unless a test gives one."""
    if now is not None:
        return now
    return REDIS_CLOCK if _test_clock is None else _test_clock()


def fixed_now() -> int | None:
    """The test clock's time, or None when none is set (Redis's clock rules)."""
    return None if _test_clock is None else _test_clock()


async def queue_now_ms(queue: QueueLike) -> int:
    """Redis's clock on the server that holds ``queue``, in ms (one round trip; the test
    clock if one is set)."""
    return await queue.core.now_ms()
