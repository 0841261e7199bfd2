"""The Redis key names of one queue, built in one place.

Every key of a queue shares the hash tag ``{name}``, so all scripts touch a
single slot and run unchanged on Redis Cluster. What each key holds (its
type, members and fields, and the job hash's fields) is written down once,
in docs/architecture.md, section "Keys"; tests/engine/test_keys.py checks that
every key built here is there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sluice.errors import ConfigurationError, InvalidJobError

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
#: The ids the engine makes: the queue's sequence number, for a job added without one.
_SEQ_ID = re.compile(r"^[1-9][0-9]{0,18}$")
#: An id a caller gives (a store's UUID, a request's id): not all digits, so that it never
#: names a job the sequence made (BullMQ refuses integer custom ids for the same reason).
_CALLER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
MAX_JOB_ID_LENGTH = 128


def check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigurationError(
            f"{what} {value!r} is not usable: use 1-100 characters from A-Z a-z 0-9 _ . : -"
        )
    return value


def is_job_id(value: object) -> bool:
    """A job id: one the engine made (a decimal number) or one a caller gave."""
    return isinstance(value, str) and bool(
        _SEQ_ID.match(value) or (_CALLER_ID.match(value) and not value.isdigit())
    )


def check_caller_id(value: object) -> str:
    """An id a caller gives a new job: 1-128 characters from A-Z a-z 0-9 _ . : -, starting with a
    letter or digit, and not all digits (those are the ids the engine makes)."""
    if not isinstance(value, str) or not _CALLER_ID.match(value) or value.isdigit():
        raise InvalidJobError(
            f"job id {value!r} is not usable: use 1-{MAX_JOB_ID_LENGTH} characters from "
            "A-Z a-z 0-9 _ . : - (starting with a letter or digit), not all digits: decimal ids "
            "are the ones the engine makes for jobs added without an id"
        )
    return value


def check_job_id(value: object) -> str:
    if not isinstance(value, str) or not is_job_id(value):
        raise InvalidJobError(
            f"{value!r} is not a job id (the engine's are decimal numbers, e.g. '42'; a caller's "
            "are 1-128 characters from A-Z a-z 0-9 _ . : -)"
        )
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
    finished_prefix: str
    retention: str
    seq: str
    idem_prefix: str
    events: str
    wake: str
    stats: str
    workers: str
    alive: str
    calls: str
    epoch: str
    control: str
    starts: str
    lags: str
    budget_prefix: str
    budget_log_prefix: str
    reservation_prefix: str
    held: str
    budget_ops_prefix: str
    parked_prefix: str
    parkedby: str
    latency_prefix: str

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
            finished_prefix=base + "finished:",
            retention=base + "retention",
            seq=base + "seq",
            idem_prefix=base + "idem:",
            events=base + "events",
            wake=base + "wake",
            stats=base + "stats",
            workers=base + "workers",
            alive=base + "alive",
            calls=base + "calls",
            epoch=base + "epoch",
            control=base + "control",
            starts=base + "starts",
            lags=base + "lags",
            budget_prefix=base + "budget:",
            budget_log_prefix=base + "blog:",
            reservation_prefix=base + "resv:",
            held=base + "held",
            budget_ops_prefix=base + "bop:",
            parked_prefix=base + "parked:",
            parkedby=base + "parkedby",
            latency_prefix=base + "lat:",
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

    def latency(self, metric: str, resolution: str, index: int) -> str:
        """One latency bucket hash (engine/sketch.py): ``lat:<metric>:<10s|1m>:<n>``."""
        return f"{self.latency_prefix}{metric}:{resolution}:{index}"

    def latency_total(self, metric: str, priority: str) -> str:
        """A latency metric's cumulative bins for one priority (or ``other``), never expiring:
        ``lat:<metric>:all:<priority>``."""
        return f"{self.latency_prefix}{metric}:all:{priority}"

    @property
    def latency_priorities(self) -> str:
        """The priorities that have cumulative latency bins of their own (a set, capped)."""
        return f"{self.latency_prefix}priorities"
