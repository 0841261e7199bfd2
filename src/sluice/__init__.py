"""Sluice: a budget-aware distributed job queue for LLM workloads, on Redis.

The public API is what this module exports in ``__all__``::

    from sluice import Queue, Worker, JobContext
"""

import importlib.metadata

from sluice.engine import (
    MAX_PRIORITY,
    Backoff,
    BudgetState,
    Event,
    FlowState,
    Job,
    JobContext,
    JobLogFilter,
    JobRecord,
    JobSpec,
    JobState,
    Queue,
    RateWindow,
    Reservation,
    Settlement,
    Worker,
    WorkerInfo,
    current_job,
)
from sluice.errors import (
    AttemptTimeout,
    BudgetError,
    BudgetExists,
    BudgetNotFound,
    ConfigurationError,
    CorruptJobError,
    InvalidJobError,
    JobCancelled,
    JobExhausted,
    JobFailed,
    JobNotFound,
    JobRejected,
    JobStateError,
    MissingExtra,
    OutcomeUnknown,
    PayloadNotSerializable,
    PayloadTooLarge,
    PermanentError,
    RedisCommandError,
    RedisUnavailable,
    ResultTimeout,
    SluiceError,
    Throttled,
    UnknownJobName,
)

try:
    __version__ = importlib.metadata.version("sluice-queue")
except importlib.metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "MAX_PRIORITY",
    "AttemptTimeout",
    "Backoff",
    "BudgetError",
    "BudgetExists",
    "BudgetNotFound",
    "BudgetState",
    "ConfigurationError",
    "CorruptJobError",
    "Event",
    "FlowState",
    "InvalidJobError",
    "Job",
    "JobCancelled",
    "JobContext",
    "JobExhausted",
    "JobFailed",
    "JobLogFilter",
    "JobNotFound",
    "JobRecord",
    "JobRejected",
    "JobSpec",
    "JobState",
    "JobStateError",
    "MissingExtra",
    "OutcomeUnknown",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "PermanentError",
    "Queue",
    "RateWindow",
    "RedisCommandError",
    "RedisUnavailable",
    "Reservation",
    "ResultTimeout",
    "Settlement",
    "SluiceError",
    "Throttled",
    "UnknownJobName",
    "Worker",
    "WorkerInfo",
    "__version__",
    "current_job",
]
