"""Sluice: a budget-aware distributed job queue for LLM workloads, on Redis.

The public API is what this module exports in ``__all__``::

    from sluice import Queue, Worker, JobContext
"""

from sluice.engine import (
    MAX_PRIORITY,
    Backoff,
    BudgetState,
    Event,
    FlowState,
    Job,
    JobContext,
    JobRecord,
    JobSpec,
    JobState,
    Queue,
    Reservation,
    Settlement,
    Worker,
)
from sluice.errors import (
    BudgetError,
    ConfigurationError,
    CorruptJobError,
    InvalidJobError,
    JobCancelled,
    JobFailed,
    JobNotFound,
    JobRejected,
    JobStateError,
    PayloadNotSerializable,
    PayloadTooLarge,
    PermanentError,
    ResultTimeout,
    SluiceError,
    Throttled,
    UnknownJobName,
)

__version__ = "0.1.0"

__all__ = [
    "MAX_PRIORITY",
    "Backoff",
    "BudgetError",
    "BudgetState",
    "ConfigurationError",
    "CorruptJobError",
    "Event",
    "FlowState",
    "InvalidJobError",
    "Job",
    "JobCancelled",
    "JobContext",
    "JobFailed",
    "JobNotFound",
    "JobRecord",
    "JobRejected",
    "JobSpec",
    "JobState",
    "JobStateError",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "PermanentError",
    "Queue",
    "Reservation",
    "ResultTimeout",
    "Settlement",
    "SluiceError",
    "Throttled",
    "UnknownJobName",
    "Worker",
    "__version__",
]
