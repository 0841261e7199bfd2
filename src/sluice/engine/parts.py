"""A method of the queue that one of its parts implements, typed as the part's own.

``counts = part_method("_admin", QueueAdmin.counts)`` in the Queue's class body
makes ``queue.counts()`` call ``queue._admin.counts()``: the Queue keeps its
calls in one place for its users, and the parts stay apart (core.py says why).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")


class PartMethod(Generic[P, R]):
    """A descriptor: the part's method, bound to the part the instance holds."""

    def __init__(self, part: str, method: Callable[Concatenate[Any, P], R]) -> None:
        self._part = part
        self._method = method
        self.__name__ = method.__name__
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None) -> Callable[Concatenate[Any, P], R]: ...
    @overload
    def __get__(self, obj: object, owner: type[Any] | None = None) -> Callable[P, R]: ...
    def __get__(self, obj: object | None, owner: type[Any] | None = None) -> Any:
        if obj is None:  # Queue.counts: a function of a queue, as a method read off its class is
            return self._of_queue()
        return types.MethodType(self._method, getattr(obj, self._part))

    def _of_queue(self) -> Callable[..., Any]:
        part, method = self._part, self._method
        if inspect.iscoroutinefunction(method):  # (so that inspect sees a coroutine function too)

            @functools.wraps(method)
            async def coroutine(queue: Any, /, *args: Any, **kwargs: Any) -> Any:
                return await method(getattr(queue, part), *args, **kwargs)

            return coroutine

        @functools.wraps(method)
        def function(queue: Any, /, *args: Any, **kwargs: Any) -> Any:
            return method(getattr(queue, part), *args, **kwargs)

        return function


def part_method(part: str, method: Callable[Concatenate[Any, P], R]) -> PartMethod[P, R]:
    """The queue's method ``method`` of the part held in the attribute ``part``."""
    return PartMethod(part, method)
