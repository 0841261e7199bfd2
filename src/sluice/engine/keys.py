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
    <prefix>:{<queue>}:control    hash    flow controls: paused, throttled_until, concurrency,
                                          rate_max, rate_ms, tpm (1 = token-rate limit on)
    <prefix>:{<queue>}:starts     zset    request-rate window: <id>:<token> -> start time (ms)
    <prefix>:{<queue>}:budget:<b> hash    one budget of the token ledger ('#tpm': the token-rate limit)
    <prefix>:{<queue>}:blog:<b>   zset    a rolling budget's reservations -> time reserved (ms)
    <prefix>:{<queue>}:resv:<r>   hash    one reservation (<job id>:<token>, or the caller's id)
    <prefix>:{<queue>}:parked:<b> zset    jobs waiting for budget <b> -> their waiting score
    <prefix>:{<queue>}:parkedby   zset    budget with parked jobs -> when to try them again (ms)

Budgets live in the queue's hash slot (a script may only touch one slot on a
cluster), so a budget is shared by every worker of its queue, not across queues.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sluice.errors import ConfigurationError, InvalidJobError

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


def check_job_id(value: object) -> str:
    if not isinstance(value, str) or not _JOB_ID.match(value):
        raise InvalidJobError(f"{value!r} is not a job id (ids are decimal numbers, e.g. '42')")
    return value


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
    control: str
    starts: str
    budget_prefix: str
    budget_log_prefix: str
    reservation_prefix: str
    parked_prefix: str
    parkedby: str

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
            control=base + "control",
            starts=base + "starts",
            budget_prefix=base + "budget:",
            budget_log_prefix=base + "blog:",
            reservation_prefix=base + "resv:",
            parked_prefix=base + "parked:",
            parkedby=base + "parkedby",
        )

    @property
    def flow(self) -> list[str]:
        """The seven flow-control and ledger keys, in the order the scripts take them."""
        return [
            self.control,
            self.starts,
            self.budget_prefix,
            self.budget_log_prefix,
            self.reservation_prefix,
            self.parked_prefix,
            self.parkedby,
        ]

    def job(self, job_id: str) -> str:
        return self.job_prefix + job_id

    def idem(self, key: str) -> str:
        return self.idem_prefix + key
