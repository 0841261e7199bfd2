"""What a chaos run does and when: its settings, and a fault schedule drawn from its seed.

The schedule is computed before the run, from the seed alone, so two runs
with one seed meet the same faults at the same moments (what the queue does
in between still depends on timing: a seed replays the faults, not the
interleaving). Faults fall inside the middle of the add window, where jobs
are both arriving and running: a fault at the very start or after the last
job would test nothing.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from sluice_lab.chaos_worker import LEASE_S

FaultKind = Literal["kill", "freeze", "redis"]

#: A frozen worker stays stopped for a time drawn from this range: always past its
#: lease and a reap, so its jobs are taken over before it wakes up and answers late;
#: sometimes only just, so that it answers while another worker is running the job
#: again (the late answer must then lose to the new lease), sometimes long after.
FREEZE_S = (LEASE_S + 1.0, 3 * LEASE_S)
#: Seconds a restarted Redis is given to load its data before the next Redis fault.
REDIS_START_S = 2.0
#: The faults fall between these fractions of the add window.
WINDOW = (0.1, 0.85)


@dataclass(frozen=True, slots=True)
class ChaosSpec:
    """One chaos run: the workload, the workers, and how many faults of each kind."""

    jobs: int = 5000
    workers: int = 3
    concurrency: int = 8
    producers: int = 2
    #: seconds over which the producers add the jobs, at an even pace; the faults happen then
    duration: float = 30.0
    seed: int = 1
    #: SIGKILLed workers (each replaced by a new process at once)
    kills: int = 3
    #: workers SIGSTOPped for FREEZE_S seconds (past their lease), then SIGCONTed
    freezes: int = 2
    #: kill -9 of Redis, restarted on the same port and append-only file
    redis_restarts: int = 2
    #: seconds Redis stays down each time
    redis_down_s: float = 1.0
    #: each job sleeps a duration drawn from this range, in milliseconds
    work_ms: tuple[int, int] = (10, 100)
    #: this share of the jobs sleeps a duration from ``slow_ms`` instead: a job
    #: that is still running again when its frozen first worker wakes up
    slow_share: float = 0.02
    slow_ms: tuple[int, int] = (500, 2500)
    #: jobs per add call (each with its own idempotency key)
    batch: int = 20
    #: seconds the queue gets to finish every job after the last add
    drain_timeout: float = 180.0

    def __post_init__(self) -> None:
        if self.jobs < 1 or self.workers < 1 or self.concurrency < 1 or self.producers < 1:
            raise ValueError("jobs, workers, concurrency and producers must be at least 1")
        if self.freezes and self.workers < 2:
            raise ValueError("freezing a worker needs at least 2 workers (one must keep running)")
        if min(self.kills, self.freezes, self.redis_restarts) < 0:
            raise ValueError("fault counts cannot be negative")
        if self.duration <= 0 or self.redis_down_s < 0 or self.drain_timeout <= 0:
            raise ValueError("duration and drain_timeout must be > 0, redis_down_s >= 0")
        for name, (low, high) in (("work_ms", self.work_ms), ("slow_ms", self.slow_ms)):
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 0 <= low <= high, got {(low, high)}")
        if not 0 <= self.slow_share <= 1:
            raise ValueError(f"slow_share must be from 0 to 1, got {self.slow_share}")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lease_s": LEASE_S, "freeze_s": FREEZE_S}


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """One fault of the schedule: ``at`` seconds after the start, on worker ``slot`` (kill, freeze)."""

    at: float
    kind: FaultKind
    slot: int | None = None
    #: how long the fault lasts (a freeze, Redis down); 0 for a kill
    hold: float = 0.0


@dataclass(slots=True)
class Plan:
    """The schedule, and the faults that could not be placed (and why)."""

    faults: list[PlannedFault] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def plan_faults(spec: ChaosSpec) -> Plan:
    """Spread the faults over the window, one per equal slice, each at a random point of its slice.

    A Redis restart waits until the one before has surely ended (it is
    pushed later, or skipped past the window's end). A kill or freeze picks
    a worker slot that is not frozen then; a freeze also leaves at least one
    other slot running, so the queue always has a worker.
    """
    rng = random.Random(spec.seed)
    wanted: dict[FaultKind, int] = {"kill": spec.kills, "freeze": spec.freezes, "redis": spec.redis_restarts}
    kinds = [kind for kind, count in wanted.items() for _ in range(count)]
    rng.shuffle(kinds)
    plan = Plan()
    if not kinds:
        return plan
    start, end = (f * spec.duration for f in WINDOW)
    width = (end - start) / len(kinds)
    frozen_until = [0.0] * spec.workers
    redis_free_at = 0.0
    for i, kind in enumerate(kinds):
        at = round(start + width * (i + rng.uniform(0.1, 0.9)), 3)
        if kind == "redis":
            at = max(at, redis_free_at)
            if at > end:
                plan.skipped.append(f"Redis restart: the one before ends after the window ({end:g}s)")
                continue
            redis_free_at = round(at + spec.redis_down_s + REDIS_START_S, 3)
            plan.faults.append(PlannedFault(at, kind, hold=spec.redis_down_s))
            continue
        free = [s for s in range(spec.workers) if frozen_until[s] <= at]
        if kind == "freeze" and len(free) < 2:
            plan.skipped.append(f"freeze at {at}s: it would leave no worker running")
            continue
        if not free:
            plan.skipped.append(f"kill at {at}s: every worker is frozen then")
            continue
        slot = rng.choice(free)
        if kind == "freeze":
            hold = round(rng.uniform(*FREEZE_S), 3)
            frozen_until[slot] = at + hold + 0.5
            plan.faults.append(PlannedFault(at, kind, slot, hold))
        else:
            plan.faults.append(PlannedFault(at, kind, slot))
    plan.faults.sort(key=lambda f: f.at)
    return plan


def work_ms(spec: ChaosSpec) -> list[int]:
    """Each job's duration, drawn from the seed (one stream for the schedule, one for the work)."""
    rng = random.Random(f"{spec.seed}:work")
    return [
        rng.randint(*(spec.slow_ms if rng.random() < spec.slow_share else spec.work_ms))
        for _ in range(spec.jobs)
    ]
