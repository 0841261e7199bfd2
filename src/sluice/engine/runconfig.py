"""What a runner is told at start: the worker's settings, frozen, so nothing reads them live."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One run's settings (Worker.configure checked them; see Worker for each)."""

    worker_id: str
    concurrency: int
    #: seconds a lease lasts unrenewed
    lease: float
    #: default seconds per attempt (None: no limit)
    timeout: float | None
    shutdown_grace: float
    reap_interval: float
    hard_grace: float | None
    loop_block_warning: float | None

    @property
    def lease_ms(self) -> int:
        return int(self.lease * 1000)
