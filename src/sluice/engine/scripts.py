"""Loading the Lua scripts, with their ``-- @include name`` lines resolved.

Each command is one ``lua/<name>.lua`` file; pieces shared between commands
live in ``lua/includes/``. Includes are expanded at load time (Redis has no
``require``), each at most once per script, and a cycle is an error, so a
shared helper can never be defined twice or recurse at load.

One include is generated rather than read: ``wire``, the dispatch reply's
layout and the outcome kinds, from :mod:`sluice.engine.wireformat`, so that
Python and Lua cannot disagree on them.

Scripts run with EVALSHA through redis-py's ``Script`` objects, which load
them on the first NOSCRIPT reply (after a Redis restart or SCRIPT FLUSH).
Redis Functions are avoided on purpose: Redis 6.2 lacks them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from sluice.engine import wireformat
from sluice.errors import ConfigurationError

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

    from sluice.engine.commands import Call

_INCLUDE = re.compile(r"^--\s*@include\s+([A-Za-z0-9_]+)\s*$", re.MULTILINE)

#: The command scripts the engine uses (file names without ``.lua``).
COMMANDS = (
    "add",
    "dispatch",
    "extend",
    "reap",
    "trim",
    "retention",
    "cancel",
    "redrive",
    "purge",
    "budget_put",
    "budget_read",
    "budget_restore",
    "reserve",
    "settle",
    "sweep",
    "heartbeat",
    "now",
    "latency",
    "pace",
    "lag",
    "observe",
)


#: Includes made by Python when the scripts load, by name.
GENERATED: dict[str, Callable[[], str]] = {"wire": wireformat.lua_include}


def _read(relative: str) -> str:
    ref = resources.files("sluice.engine").joinpath("lua", relative)
    try:
        return ref.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigurationError(f"Lua file {relative!r} is missing from the sluice package") from None


def expand(source: str, read_include: Callable[[str], str] | None = None) -> str:
    """Replace every ``-- @include name`` line with ``includes/name.lua``.

    An include that was already expanded is dropped (so two includes may both
    need a third); an include that includes itself, directly or not, raises
    ``ConfigurationError``. ``read_include`` (name -> text) is for tests.
    """

    def reader(name: str) -> str:
        if read_include is not None:
            return read_include(name)
        if name in GENERATED:
            return GENERATED[name]()
        return _read(f"includes/{name}.lua")

    done: set[str] = set()

    def resolve(text: str, stack: tuple[str, ...]) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in stack:
                chain = " -> ".join((*stack, name))
                raise ConfigurationError(f"Lua include cycle: {chain}")
            if name in done:
                return f"-- (include {name}: already above)"
            body = resolve(reader(name), (*stack, name))
            done.add(name)
            return f"-- begin include {name}\n{body}\n-- end include {name}"

        return _INCLUDE.sub(one, text)

    return resolve(source, ())


@cache
def source(command: str) -> str:
    """The full text of one command script, includes expanded."""
    if command not in COMMANDS:
        raise ConfigurationError(f"unknown Lua command {command!r}; known: {', '.join(COMMANDS)}")
    return expand(_read(f"{command}.lua"))


class Scripts:
    """The engine's scripts registered on one Redis client."""

    def __init__(self, redis: Redis) -> None:
        self.add: AsyncScript = redis.register_script(source("add"))
        self.dispatch: AsyncScript = redis.register_script(source("dispatch"))
        self.extend: AsyncScript = redis.register_script(source("extend"))
        self.reap: AsyncScript = redis.register_script(source("reap"))
        self.trim: AsyncScript = redis.register_script(source("trim"))
        self.retention: AsyncScript = redis.register_script(source("retention"))
        self.cancel: AsyncScript = redis.register_script(source("cancel"))
        self.redrive: AsyncScript = redis.register_script(source("redrive"))
        self.purge: AsyncScript = redis.register_script(source("purge"))
        self.budget_put: AsyncScript = redis.register_script(source("budget_put"))
        self.budget_read: AsyncScript = redis.register_script(source("budget_read"))
        self.budget_restore: AsyncScript = redis.register_script(source("budget_restore"))
        self.reserve: AsyncScript = redis.register_script(source("reserve"))
        self.settle: AsyncScript = redis.register_script(source("settle"))
        self.sweep: AsyncScript = redis.register_script(source("sweep"))
        self.heartbeat: AsyncScript = redis.register_script(source("heartbeat"))
        self.now: AsyncScript = redis.register_script(source("now"))
        self.latency: AsyncScript = redis.register_script(source("latency"))
        self.pace: AsyncScript = redis.register_script(source("pace"))
        self.lag: AsyncScript = redis.register_script(source("lag"))
        self.observe: AsyncScript = redis.register_script(source("observe"))

    async def run(self, call: Call) -> Any:
        """Send one call (sluice.engine.commands builds them) with EVALSHA."""
        script: AsyncScript = getattr(self, call.script)
        return await script(keys=call.keys, args=call.args)
