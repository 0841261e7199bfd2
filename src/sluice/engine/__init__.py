"""The Redis engine: queues, workers, leases, retries, events, flow control, the token ledger.

No HTTP, SQL or LLMs here, and no third-party package but redis-py (with
hiredis) and orjson: scripts/check holds it to that with import-linter.
"""

from sluice.engine.admin import WorkerInfo
from sluice.engine.backoff import Backoff
from sluice.engine.budget_state import BudgetState, Reservation, Settlement
from sluice.engine.budgets import Budgets
from sluice.engine.context import JobContext, JobLogFilter, current_job
from sluice.engine.events import Event
from sluice.engine.flow import FlowState
from sluice.engine.hooks import AttemptEnd, Hook
from sluice.engine.job import MAX_PRIORITY, JobRecord, JobSpec, JobState
from sluice.engine.queue import Job, Queue
from sluice.engine.windows import RateWindow
from sluice.engine.worker import Worker

__all__ = [
    "MAX_PRIORITY",
    "AttemptEnd",
    "Backoff",
    "BudgetState",
    "Budgets",
    "Event",
    "FlowState",
    "Hook",
    "Job",
    "JobContext",
    "JobLogFilter",
    "JobRecord",
    "JobSpec",
    "JobState",
    "Queue",
    "RateWindow",
    "Reservation",
    "Settlement",
    "Worker",
    "WorkerInfo",
    "current_job",
]
