"""The Redis key layout of one queue, written down in one place.

Every key of a queue shares the hash tag ``{name}``, so all scripts touch a
single slot and run unchanged on Redis Cluster::

    <prefix>:{<queue>}:job:<id>   hash    one job (fields: see docs/architecture.md)
    <prefix>:{<queue>}:waiting    zset    id -> priority * 2**32 + sequence (FIFO within priority)
    <prefix>:{<queue>}:delayed    zset    id -> due time (ms)
    <prefix>:{<queue>}:active     zset    id -> lease deadline (ms)
    <prefix>:{<queue>}:dead       zset    id -> time it was dead-lettered (ms)
    <prefix>:{<queue>}:seq        string  last job sequence number (ids are sequence numbers)
    <prefix>:{<queue>}:idem:<key> string  idempotency key -> job id (expires)
    <prefix>:{<queue>}:events     stream  capped log of lifecycle events
    <prefix>:{<queue>}:wake       zset    one marker member; idle workers block on it
    <prefix>:{<queue>}:stats      hash    cumulative counters (completed, failed, stalled, ...)
    <prefix>:{<queue>}:workers    hash    worker id -> JSON heartbeat (names it serves, seen at)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sluice.errors import ConfigurationError

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
_JOB_ID = re.compile(r"^[1-9][0-9]{0,18}$")


def check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigurationError(
            f"{what} {value!r} is not usable: use 1-100 characters from A-Z a-z 0-9 _ . : -"
        )
    return value


def is_job_id(value: object) -> bool:
    return isinstance(value, str) and bool(_JOB_ID.match(value))


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """Key names of one queue; build with :meth:`for_queue`."""

    base: str
    job_prefix: str
    waiting: str
    delayed: str
    active: str
    dead: str
    seq: str
    idem_prefix: str
    events: str
    wake: str
    stats: str
    workers: str

    @classmethod
    def for_queue(cls, queue: str, prefix: str = "sluice") -> QueueKeys:
        check_name("queue name", queue)
        check_name("key prefix", prefix)
        base = f"{prefix}:{{{queue}}}:"
        return cls(
            base=base,
            job_prefix=base + "job:",
            waiting=base + "waiting",
            delayed=base + "delayed",
            active=base + "active",
            dead=base + "dead",
            seq=base + "seq",
            idem_prefix=base + "idem:",
            events=base + "events",
            wake=base + "wake",
            stats=base + "stats",
            workers=base + "workers",
        )

    def job(self, job_id: str) -> str:
        return self.job_prefix + job_id

    def idem(self, key: str) -> str:
        return self.idem_prefix + key
