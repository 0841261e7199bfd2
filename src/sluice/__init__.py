"""Sluice: a budget-aware distributed job queue for LLM workloads, on Redis.

The public API is what this module exports in ``__all__``::

    from sluice import Queue, Worker, JobContext
"""

from sluice.engine import (
    MAX_PRIORITY,
    Backoff,
    Event,
    Job,
    JobContext,
    JobRecord,
    JobSpec,
    JobState,
    Queue,
    Worker,
)
from sluice.errors import (
    ConfigurationError,
    CorruptJobError,
    InvalidJobError,
    JobCancelled,
    JobFailed,
    JobNotFound,
    JobStateError,
    PayloadNotSerializable,
    PayloadTooLarge,
    PermanentError,
    ResultTimeout,
    SluiceError,
    UnknownJobName,
)

__version__ = "0.1.0"

__all__ = [
    "MAX_PRIORITY",
    "Backoff",
    "ConfigurationError",
    "CorruptJobError",
    "Event",
    "InvalidJobError",
    "Job",
    "JobCancelled",
    "JobContext",
    "JobFailed",
    "JobNotFound",
    "JobRecord",
    "JobSpec",
    "JobState",
    "JobStateError",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "PermanentError",
    "Queue",
    "ResultTimeout",
    "SluiceError",
    "UnknownJobName",
    "Worker",
    "__version__",
]
