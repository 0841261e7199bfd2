"""The workload of ``sluice bench lab``: the reference lab's, so that results compare."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """The lab's fixed workload (the reference lab's, so results compare)."""

    load_jobs: int = 24
    high_priority_jobs: int = 8  # enqueued last, at priority 1: they must all start first
    worker_ids: tuple[str, ...] = ("worker-a", "worker-b")
    local_concurrency: int = 3
    global_concurrency: int = 4
    rate_limit_max: int = 4
    rate_limit_ms: int = 1000
    tokens_per_job: int = 100
    latencies_ms: tuple[int, ...] = (40, 60, 80)
    load_budget: int = 2400
    race_jobs: int = 4
    race_budget: int = 200
    overuse_jobs: int = 16
    overuse_budget: int = 1000
    #: what each overuse job's call really uses; it estimates tokens_per_job
    overuse_usage: int = 150
    throttled_index: int = 0  # the load job whose first call meets a 429
    throttle_retry_after_ms: int = 500
    #: a window of rate_limit_max + 1 starts must span at least this long
    rate_check_min_ms: float = 900.0

    @property
    def total_jobs(self) -> int:
        return self.load_jobs + self.race_jobs + self.overuse_jobs

    @property
    def concurrency(self) -> int:
        """The most jobs that can run at once: the global ceiling, or all the workers' slots if fewer."""
        return min(self.global_concurrency, len(self.worker_ids) * self.local_concurrency)

    def as_reference(self) -> dict[str, Any]:
        return {
            "loadJobs": self.load_jobs,
            "workerProcesses": len(self.worker_ids),
            "globalConcurrency": self.global_concurrency,
            "rateLimitMax": self.rate_limit_max,
            "rateLimitDurationMs": self.rate_limit_ms,
            "localConcurrency": self.local_concurrency,
            "raceJobs": self.race_jobs,
            "tokensPerJob": self.tokens_per_job,
            # beyond the reference lab's fields
            "overuseJobs": self.overuse_jobs,
            "overuseTokensUsed": self.overuse_usage,
        }
