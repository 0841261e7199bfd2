"""Every error Sluice raises, in one tree.

Catch :class:`SluiceError` to handle anything raised by Sluice itself. Each
error's message says what went wrong *and* what to do about it::

    SluiceError
    ├── ConfigurationError        settings or environment are unusable (bad URL,
    │                             no redis-server binary, unknown handler module)
    ├── MissingExtra              an optional part is not installed; the message
    │                             names the extra (also an ImportError)
    ├── RedisUnavailable          Redis cannot be reached, is loading its data, or
    │   │                         the connection broke (also a ConnectionError);
    │   │                         ``.url`` names the server, without credentials
    │   └── OutcomeUnknown        the connection broke after a write was sent: it
    │                             may or may not have been applied. Retrying an
    │                             add is safe with an idempotency key
    ├── StoreUnavailable          PostgreSQL (the service's store) could not take
    │                             a write (also a ConnectionError); send the
    │                             request again with its idempotency key
    ├── RedisCommandError         Redis refused a command (out of memory, a
    │                             read-only replica, missing ACL permission)
    ├── InvalidJobError           bad input to Queue.add / add_bulk; nothing was
    │   │                         written (also a ValueError)
    │   ├── PayloadNotSerializable  payload is not JSON (also a TypeError)
    │   ├── PayloadTooLarge         encoded payload exceeds the queue's limit
    │   └── UnknownJobName          no handler is registered under that name
    ├── CorruptJobError           a job record read back from Redis does not
    │                             parse (written by another program or version)
    ├── JobNotFound               no job with that id (expired or never existed;
    │                             also a KeyError)
    ├── JobStateError             the operation does not apply in the job's
    │                             current state (e.g. redrive a completed job)
    ├── JobFailed                 Job.result(): the job ended in the dead-letter
    │                             queue; ``.error`` holds its last error
    ├── JobCancelled              Job.result(): the job was cancelled
    ├── JobRejected               Job.result(): its budget could not admit it
    │   │                         (on_exhausted="reject"); ``.reason`` says why
    │   └── JobExhausted          the same, after earlier attempts had spent
    │                             tokens (``JobRecord.spent`` says how much)
    ├── BudgetError               a budget operation cannot be done (bad name,
    │   │                         parent or window)
    │   ├── BudgetNotFound        no budget of that name (also raised by add for
    │   │                         a job naming one; nothing is written)
    │   └── BudgetExists          create() of a name that exists
    ├── ResultTimeout             Job.result(): no outcome within the timeout
    │                             (also a TimeoutError); the job goes on
    └── AttemptTimeout            recorded as a job's error (never raised to the
                                  caller) when an attempt ran past its timeout

Raised *by handlers* to steer the worker (not errors of Sluice itself)::

    PermanentError                do not retry: the job goes straight to the
                                  dead-letter queue with this error
    Throttled                     the provider said "too many requests": the
                                  queue pauses for ``retry_after`` seconds and
                                  the job waits again, its attempt not counted
"""

from __future__ import annotations

__all__ = [
    "AttemptTimeout",
    "BudgetError",
    "BudgetExists",
    "BudgetNotFound",
    "ConfigurationError",
    "CorruptJobError",
    "InvalidJobError",
    "JobCancelled",
    "JobFailed",
    "JobNotFound",
    "JobRejected",
    "JobStateError",
    "MissingExtra",
    "OutcomeUnknown",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "PermanentError",
    "RedisCommandError",
    "RedisUnavailable",
    "ResultTimeout",
    "SluiceError",
    "Throttled",
    "UnknownJobName",
]


class SluiceError(Exception):
    """Base class of every error raised by Sluice."""


class ConfigurationError(SluiceError):
    """Settings or the environment cannot work; the message names the fix."""


class MissingExtra(SluiceError, ImportError):
    """An optional part of Sluice needs packages that are not installed."""

    def __init__(self, extra: str, feature: str, missing: str, alternative: str = "") -> None:
        super().__init__(
            f"the {extra!r} extra is needed for {feature} ({missing} is not installed): "
            f"pip install 'sluice-queue[{extra}]'" + (f"; {alternative}" if alternative else "")
        )
        self.extra = extra
        self.feature = feature


class RedisUnavailable(SluiceError, ConnectionError):
    """Redis cannot be reached, is still loading its data, or the connection broke.

    Nothing was applied when this is raised by a read, or by a write whose
    connection failed before the command was sent. ``url`` names the server
    without credentials; ``reason`` is what the transport said.
    """

    def __init__(self, url: str, reason: str, advice: str = "") -> None:
        advice = advice or (
            "Check that it runs and that the URL is right (--redis or SLUICE_REDIS_URL; "
            "`sluice redis` starts a local one)"
        )
        super().__init__(f"Redis at {url} is unavailable: {reason}. {advice}")
        self.url = url
        self.reason = reason


class OutcomeUnknown(RedisUnavailable):
    """The connection broke after a write was sent: Redis may or may not have applied it.

    Retrying is safe for an add with an ``idempotency_key`` (the second add
    returns the first job), for cancel, redrive and purge (they only act on
    jobs in the right state), and for reads; otherwise look before retrying
    (``queue.get_job``, ``queue.budgets.get``).
    """

    def __init__(self, url: str, reason: str, operation: str) -> None:
        super().__init__(
            url,
            reason,
            f"{operation} was sent and may have been applied. Retry adds only with an "
            "idempotency_key (the retry then returns the first job); check other changes "
            "before repeating them",
        )
        self.operation = operation


class StoreUnavailable(SluiceError, ConnectionError):
    """PostgreSQL (the service's store) could not take the write: unreachable, restarting, or
    the connection broke. The job was most likely not stored (if the connection broke after
    the commit, it was, and the reconciler enqueues it): send the request again with its
    idempotency key, which names one job however often it is sent."""

    def __init__(self, reason: str, advice: str = "") -> None:
        self.reason = reason
        advice = advice or "try again shortly (check that it runs and SLUICE_DATABASE_URL)"
        super().__init__(f"the store (PostgreSQL) is unavailable: {reason}; {advice}")


class RedisCommandError(SluiceError):
    """Redis answered a command with an error: out of memory, a read-only replica, no ACL permission."""

    def __init__(self, url: str, reply: str, advice: str) -> None:
        super().__init__(f"Redis at {url} refused the command: {reply}. {advice}")
        self.url = url
        self.reply = reply


class InvalidJobError(SluiceError, ValueError):
    """A job given to ``Queue.add`` / ``add_bulk`` is invalid; nothing was written."""


class PayloadNotSerializable(InvalidJobError, TypeError):
    """The payload cannot be encoded as JSON (Sluice never pickles)."""


class PayloadTooLarge(InvalidJobError):
    """The encoded payload is larger than the queue's ``max_payload_bytes``."""


class UnknownJobName(InvalidJobError):
    """The job name is not one of the handler names the queue was told about."""


class CorruptJobError(SluiceError):
    """A job record in Redis is missing fields or holds values that do not parse."""

    def __init__(self, job_id: str, problem: str) -> None:
        super().__init__(
            f"job {job_id!r}: stored record is unreadable ({problem}); it was written by "
            "another program or an incompatible Sluice version. Inspect it with "
            "`sluice show ID` or remove it with `sluice dlq purge ID`."
        )
        self.job_id = job_id
        self.problem = problem


class JobNotFound(SluiceError, KeyError):
    """No job with that id: it never existed, or its record expired."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"no job {job_id!r} in this queue: it never existed or its record expired "
            "(finished jobs are kept as the queue's retention says: `sluice retention show`)"
        )
        self.job_id = job_id

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class JobStateError(SluiceError):
    """The operation does not apply to a job in its current state."""

    def __init__(self, job_id: str, state: str, wanted: str) -> None:
        super().__init__(f"job {job_id!r} is {state}; {wanted}")
        self.job_id = job_id
        self.state = state


class JobFailed(SluiceError):
    """The job exhausted its attempts (or failed permanently) and is dead-lettered."""

    def __init__(self, job_id: str, error: str) -> None:
        super().__init__(
            f"job {job_id!r} failed and was moved to the dead-letter queue: {error}\n"
            "Inspect it with `sluice dlq show`, fix the cause, then `sluice dlq redrive`."
        )
        self.job_id = job_id
        self.error = error


class JobCancelled(SluiceError):
    """The job was cancelled before it completed."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} was cancelled")
        self.job_id = job_id


class JobRejected(SluiceError):
    """The job's budget could not admit its token estimate and its policy was to reject."""

    def __init__(self, job_id: str, reason: str) -> None:
        if reason.startswith("no budget named"):
            advice = "Create the budget (queue.budgets.create) and add the job again."
        else:
            advice = (
                "Credit the budget (queue.budgets.credit) or wait for its window to turn, "
                "then add the job again; or add jobs with on_exhausted='wait'."
            )
        super().__init__(f"job {job_id!r} was rejected: {reason}. {advice}")
        self.job_id = job_id
        self.reason = reason


class JobExhausted(JobRejected):
    """The job spent tokens in earlier attempts, then its budget refused to run it again.

    A :class:`JobRejected`, so code that handles refusals handles both; apart
    from it because money was spent (``JobRecord.spent`` says how much).
    """

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(job_id, reason)
        self.args = (
            f"job {job_id!r} spent tokens in earlier attempts, then its budget refused to run it again: "
            f"{reason}. Credit the budget (queue.budgets.credit) and add the job again, or add jobs "
            "with on_exhausted='wait' to wait for room.",
        )


class BudgetError(SluiceError):
    """A budget operation cannot be done; the message says what to change."""


class BudgetNotFound(BudgetError):
    """No budget of that name in this queue's ledger."""

    def __init__(self, name: str, message: str = "") -> None:
        super().__init__(message or f"no budget named {name!r}; create it first (queue.budgets.create)")
        self.name = name


class BudgetExists(BudgetError):
    """``create`` named a budget that exists already."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"budget {name!r} exists already; change it with queue.budgets.set_limit(), adjust() or "
            "credit(), or pass exist_ok=True to accept the existing one"
        )
        self.name = name


class ResultTimeout(SluiceError, TimeoutError):
    """No outcome arrived in time; the job itself is not affected and goes on."""

    def __init__(self, job_id: str, timeout: float, state: str | None) -> None:
        super().__init__(
            f"job {job_id!r} has no result after {timeout:g}s (it is {state or 'unknown'}); "
            "wait longer, or check that a worker serves this queue (`sluice info`)"
        )
        self.job_id = job_id
        self.state = state
        self.timeout = timeout


class AttemptTimeout(SluiceError, TimeoutError):
    """An attempt ran past its timeout and was cancelled; recorded as the job's error."""

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"the attempt ran past its timeout of {timeout:g}s and was cancelled; "
            "raise the job's timeout, or make the handler faster"
        )
        self.timeout = timeout


class PermanentError(Exception):
    """Raise from a handler when retrying cannot help: the job is dead-lettered now."""


class Throttled(Exception):
    """Raise from a handler when the provider answered 429 (rate limited).

    The queue dispatches nothing for ``retry_after`` seconds (every worker, on
    every machine), and the job goes back to waiting at its priority with its
    attempt and failure counts unchanged. Its token reservation is refunded,
    unless the handler reported usage first (``job.record_usage``): a call the
    provider served and billed before asking to slow down is charged.

    ``asked``: the wait the provider asked for, when ``retry_after`` is that
    wait held within bounds (Sluice's providers keep a 429's pause within
    25 ms and 300 s): a paced queue learns from it how early the call came
    (docs/architecture.md, "The headroom, measured").
    """

    def __init__(self, retry_after: float = 1.0, message: str = "", *, asked: float | None = None) -> None:
        if (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, int | float)
            or not (0 <= retry_after <= 86_400)
        ):
            raise ValueError(f"retry_after must be 0 to 86400 seconds, got {retry_after!r}")
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int | float) or asked < 0):
            raise ValueError(f"asked must be a number of seconds >= 0 or None, got {asked!r}")
        super().__init__(message or f"provider rate limit; retry after {retry_after:g}s")
        self.retry_after = float(retry_after)
        #: the wait the provider asked for (retry_after when the handler gave no other)
        self.asked = float(retry_after) if asked is None else float(asked)
