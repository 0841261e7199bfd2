"""The handler registry: job names to the functions that run them, each marked async or sync."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from sluice.engine.context import JobContext
from sluice.errors import ConfigurationError

#: ``async def handler(job)``: runs on the worker's event loop, and is cancelled at its timeout.
AsyncHandler = Callable[[JobContext], Awaitable[Any]]
#: ``def handler(job)``: runs in a thread of the worker's own, so blocking calls are fine.
SyncHandler = Callable[[JobContext], Any]
Handler = AsyncHandler | SyncHandler


class Handlers:
    """Handlers by job name; the runner looks one up per job, so an entry is one tuple:
    (handler, whether it is a plain function run in a thread)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Handler, bool]] = {}

    def register(self, name: str, fn: Handler) -> None:
        """Make ``fn`` the handler of ``name`` (see Worker.register for what each kind may do)."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"handler name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise ConfigurationError(f"handler {name!r} must be a function (def or async def), got {fn!r}")
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise ConfigurationError(
                f"handler {name!r} is a generator function; a handler returns its result (def or async def)"
            )
        known = self._entries.get(name)
        if known is not None and known[0] is not fn:
            raise ConfigurationError(f"a different handler is already registered as {name!r}")
        # An object whose __call__ is async is awaited too, not run in a thread.
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        self._entries[name] = (fn, not is_async)

    def entry(self, name: str) -> tuple[Handler, bool] | None:
        return self._entries.get(name)

    def get(self, name: str) -> Handler | None:
        found = self._entries.get(name)
        return None if found is None else found[0]

    def is_sync(self, name: str) -> bool:
        found = self._entries.get(name)
        return found is not None and found[1]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)
