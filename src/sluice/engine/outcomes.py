"""What an attempt's ending means for the queue: plain functions, no Redis.

An attempt ends in one :class:`~sluice.engine.wireformat.Kind` with a value
and, for a retry, a delay. The functions here decide which, from what the
handler did (returned, raised, was stopped, ran past its timeout), and
name the outcome for the worker's hooks (``AttemptEnd.outcome``). They log what an operator must
see (a retry, a dead letter) and have no other effect, so they are tested
without a queue (tests/engine/test_outcomes.py).
"""

from __future__ import annotations

import inspect
import logging
import traceback
from typing import TYPE_CHECKING, Any

from sluice.engine.backoff import Backoff
from sluice.engine.codec import encode
from sluice.engine.transport import describe
from sluice.engine.wireformat import Kind
from sluice.errors import AttemptTimeout, PayloadNotSerializable, PermanentError, Throttled

if TYPE_CHECKING:
    from sluice.engine.context import JobContext

log = logging.getLogger("sluice.worker")

#: (kind, value, retry in ms) of one attempt, as the dispatch script takes it.
Result = tuple[bytes, bytes, int]

MAX_ERROR_BYTES = 8192

# The kinds as plain names, read on every job.
COMPLETED = Kind.COMPLETED
FAILED = Kind.FAILED
PERMANENT = Kind.PERMANENT
OVERRAN = Kind.OVERRAN
RELEASED = Kind.RELEASED
CANCELLED = Kind.CANCELLED
THROTTLED = Kind.THROTTLED

#: What a handler the runner stopped reports, by why it was stopped.
_STOPPED: dict[str, Result] = {
    "cancel": (CANCELLED, b"cancelled by request", 0),
    "release": (RELEASED, b"", 0),
}

#: An outcome as the hooks see it (FAILED depends on the attempts left).
_TRACE_NAMES: dict[bytes, str] = {
    COMPLETED: "completed",
    PERMANENT: "dead",
    THROTTLED: "throttled",
    CANCELLED: "cancelled",
    RELEASED: "released",
}


def describe_error(exc: BaseException) -> bytes:
    """The error text a job record keeps: a head line and the traceback, bounded."""
    text = "".join(traceback.format_exception(exc, limit=20))
    head = f"{type(exc).__name__}: {exc}\n"
    return (head + text).encode(errors="replace")[:MAX_ERROR_BYTES]


def dead(ctx: JobContext, error: bytes, worker_id: str, kind: bytes = PERMANENT) -> Result:
    """Dead-letter the job now (or, with kind FAILED, on its last attempt), logged."""
    text = error[:300].decode(errors="replace").splitlines()[0] if error else ""
    log.error(
        "worker %s: job %s (%s) dead-lettered after attempt %d: %s",
        worker_id,
        ctx.id,
        ctx.name,
        ctx.attempt,
        text,
        extra={
            "worker_id": worker_id,
            "job_id": ctx.id,
            "job_name": ctx.name,
            "attempt": ctx.attempt,
            "error": text,
        },
    )
    return kind, error, 0


def no_handler(ctx: JobContext, names: frozenset[str], worker_id: str) -> Result:
    """A job of a type this worker does not serve (a producer may send any name)."""
    error = f"no handler named {ctx.name!r} on worker {worker_id} (it serves: {', '.join(sorted(names))})"
    return dead(ctx, error.encode(), worker_id)


def returned(ctx: JobContext, result: Any, sync: bool, worker_id: str) -> Result:
    """The handler returned ``result``: completed, unless it cannot be stored."""
    if sync and inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never awaited, on purpose: no warning for it
        error = (
            f"handler {ctx.name!r} is a plain function but returned an awaitable; declare it "
            "`async def` for the worker to await it"
        )
        return dead(ctx, error.encode(), worker_id)
    try:
        return COMPLETED, encode(result, "result"), 0
    except PayloadNotSerializable as exc:
        return dead(ctx, describe_error(exc), worker_id)


def failed(ctx: JobContext, exc: Exception, backoff: bytes, worker_id: str) -> Result:
    """The handler raised ``exc``: dead, throttled, or retried after its backoff."""
    if isinstance(exc, PermanentError | PayloadNotSerializable):
        return dead(ctx, describe_error(exc), worker_id)
    if isinstance(exc, Throttled):
        log.info(
            "worker %s: job %s was throttled by its provider; the queue pauses for %gs "
            "and the job waits again",
            worker_id,
            ctx.id,
            exc.retry_after,
            extra={"worker_id": worker_id, "job_id": ctx.id, "retry_after_s": exc.retry_after},
        )
        return THROTTLED, b"%d" % round(exc.retry_after * 1000), 0
    if ctx.attempt >= ctx.max_attempts:
        return dead(ctx, describe_error(exc), worker_id, kind=FAILED)
    try:
        delay = Backoff.from_json(backoff).seconds(ctx.attempt)
    except (ValueError, TypeError):
        delay = 1.0
    error = describe(exc)
    log.warning(
        "worker %s: job %s (%s) attempt %d of %d failed, retrying in %.3fs: %s",
        worker_id,
        ctx.id,
        ctx.name,
        ctx.attempt,
        ctx.max_attempts,
        delay,
        error,
        extra={
            "worker_id": worker_id,
            "job_id": ctx.id,
            "job_name": ctx.name,
            "attempt": ctx.attempt,
            "retry_in_s": round(delay, 3),
            "error": error,
        },
    )
    return FAILED, describe_error(exc), int(delay * 1000)


def timed_out(
    ctx: JobContext,
    timeout: float,
    backoff: bytes,
    worker_id: str,
    *,
    after: str | None = None,
    late: float = 0.0,
    sync: bool = False,
) -> Result:
    """The attempt's timeout fired: a failure, whatever the handler did ``late`` seconds
    after (``after``: what; None when it ended cancelled)."""
    error = AttemptTimeout(timeout)
    if after is not None:
        # A thread cannot be cancelled: it only sees job.stop_requested.
        went_on = "'s thread went on past" if sync else " went on after it was cancelled at"
        note = f"the handler{went_on} its timeout, and {late:.2f}s later {after}"
        error.add_note(note)
        log.warning(
            "worker %s: job %s (%s) went on past its timeout of %gs: %s; the attempt counts as timed out",
            worker_id,
            ctx.id,
            ctx.name,
            timeout,
            note,
            extra={"worker_id": worker_id, "job_id": ctx.id, "job_name": ctx.name, "late_s": round(late, 3)},
        )
    return failed(ctx, error, backoff, worker_id)


def stopped(reason: str | None) -> Result | None:
    """The outcome of a handler the runner cancelled for ``reason``; None: not reported (its
    lease was lost, so the outcome is no longer this worker's to give)."""
    reason = reason or "release"
    return None if reason == "lease_lost" else _STOPPED.get(reason, _STOPPED["release"])


def trace_name(ctx: JobContext, outcome: Result | None) -> tuple[str, str | None]:
    """An attempt's outcome as the hooks see it (a tracer's span says it too), and the error
    it reports (if any)."""
    if outcome is None:
        return "lease_lost", None
    kind, value = outcome[0], outcome[1]
    if kind == FAILED:
        name = "retry" if ctx.attempt < ctx.max_attempts else "dead"
    else:
        name = _TRACE_NAMES.get(kind, kind.decode(errors="replace"))
    error = value[:1000].decode(errors="replace") if kind in (FAILED, PERMANENT) else None
    return name, error
