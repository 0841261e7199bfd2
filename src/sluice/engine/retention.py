"""How long, and how many, finished jobs a queue keeps.

A setting of the queue, stored in Redis (its ``retention`` hash), not of a
client: every producer and worker of the queue then applies the same one,
and an operator changes it without redeploying anything. Each kind of ending
has an age and a count limit:

=========  =========  =========
kind       age        count
=========  =========  =========
completed  1 day      1,000,000
dead       30 days    100,000
cancelled  1 day      100,000
rejected   1 day      100,000
exhausted  30 days    100,000
=========  =========  =========

A job's record expires with its kind's age (Redis drops it even when no
worker runs); workers trim the oldest records past a count limit, and the
index entries of expired ones, in bounded steps (the trim script). So the
memory a queue holds is bounded by its rate times the age, and by the counts,
however long it runs. Changing an age applies to jobs that finish from then
on; records kept already go when they pass the new age (trimmed) or their old
one (expired), whichever comes first. The defaults are written once, in
``lua/includes/retention.lua``; :meth:`QueueRetention.retention` reads them
from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from sluice.engine.transport import reads, writes
from sluice.errors import ConfigurationError

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.core import QueueCore

#: The kinds of ending that are kept, in the order the settings are listed.
KINDS: Final = ("completed", "dead", "cancelled", "rejected", "exhausted")
#: The longest age accepted (a year): PEXPIRE's limit is far above, a typo is not.
MAX_AGE_S: Final = 366 * 86_400.0
#: A count of this many or more is a mistake rather than a limit.
MAX_COUNT: Final = 1_000_000_000


class _Unchanged:
    def __repr__(self) -> str:
        return "UNCHANGED"


#: ``set_retention``'s default: leave that limit as it is.
UNCHANGED: Final = _Unchanged()


@dataclass(frozen=True, slots=True)
class Retention:
    """One kind's limits: ``age`` in seconds and ``count`` of jobs (None: no such limit)."""

    age: float | None
    count: int | None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"age": self.age, "count": self.count}


def check_kind(kind: object) -> str:
    if kind not in KINDS:
        raise ConfigurationError(f"{kind!r} is not a kind of finished job; use one of {', '.join(KINDS)}")
    return str(kind)


def _age_ms(age: object) -> int:
    if age is None:
        return 0
    if isinstance(age, bool) or not isinstance(age, int | float) or not math.isfinite(age):
        raise ConfigurationError(f"retention age {age!r} is not a number of seconds (None: no age limit)")
    if not 0 < age <= MAX_AGE_S:
        raise ConfigurationError(
            f"retention age {age!r} s is out of range: use more than 0 and at most {MAX_AGE_S:.0f} s "
            "(a year), or None for no age limit"
        )
    return max(1, round(age * 1000))


def _count(count: object) -> int:
    if count is None:
        return 0
    if isinstance(count, bool) or not isinstance(count, int) or not 0 < count < MAX_COUNT:
        raise ConfigurationError(
            f"retention count {count!r} is not usable: use a whole number of jobs from 1 to "
            f"{MAX_COUNT - 1:,}, or None for no count limit"
        )
    return count


def refuse_keep_finished(keep_finished: object) -> None:
    """``keep_finished=`` was a client's setting; retention is now the queue's, in Redis."""
    if keep_finished is not None:
        raise ConfigurationError(
            "keep_finished is no longer an option of a client: how long finished jobs are kept is "
            "a setting of the queue, stored in Redis; use "
            f"await queue.set_retention('completed', age={keep_finished!r}) or "
            f"`sluice retention set completed --age {keep_finished}`"
        )


class QueueRetention:
    """The retention calls of a queue (offered by :class:`~sluice.engine.queue.Queue`)."""

    def __init__(self, core: QueueCore) -> None:
        self.keys = core.keys
        self.scripts = core.scripts
        self._core = core

    @property
    def redis(self) -> Redis:
        return self._core.redis

    @reads
    async def retention(self) -> dict[str, Retention]:
        """Every kind's limits as they apply now (stored ones, else the defaults)."""
        raw: list[Any] = await self._core.run(self._core.commands.retention())
        out: dict[str, Retention] = {}
        for i in range(0, len(raw), 3):
            kind = raw[i].decode() if isinstance(raw[i], bytes) else str(raw[i])
            age_ms, count = int(raw[i + 1]), int(raw[i + 2])
            out[kind] = Retention(age=age_ms / 1000 if age_ms > 0 else None, count=count or None)
        return out

    @writes
    async def set_retention(
        self,
        kind: str,
        *,
        age: float | _Unchanged | None = UNCHANGED,
        count: int | _Unchanged | None = UNCHANGED,
    ) -> Retention:
        """Set how long (``age``, seconds) and how many (``count``) jobs that ended as ``kind``
        the queue keeps; None lifts that limit, and a limit not given stays as it is.

        ``kind``: completed, dead, cancelled, rejected or exhausted. Returns the kind's
        limits now. Workers apply a lower limit to the jobs kept already
        within a few seconds (their trim step runs with the reaper).
        """
        kind = check_kind(kind)
        fields: dict[Any, Any] = {}  # Any: redis-py's mapping type is invariant in its keys
        if not isinstance(age, _Unchanged):
            fields[f"{kind}_age"] = _age_ms(age)
        if not isinstance(count, _Unchanged):
            fields[f"{kind}_count"] = _count(count)
        if fields:
            await self.redis.hset(self.keys.retention, mapping=fields)
        return (await self.retention())[kind]
