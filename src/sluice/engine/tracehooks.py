"""Where a tracer plugs into the producer side of the engine, which imports no tracing library.

The engine carries one thing for tracing: a job's trace context
(``JobSpec.trace_context``, the W3C ``traceparent`` of the span that added
it), stored in the job's hash and handed to every attempt
(``JobContext.trace_context``). ``Queue.add``/``add_bulk`` open an enqueue
scope with the :class:`Tracer` a higher layer installs here
(``sluice.tracing``, for OpenTelemetry), and the new jobs carry its trace
context. This one is process-wide on purpose: adding jobs is not a worker's
business (any program, the API, a handler may add), and OpenTelemetry's
tracer provider is one per process anyway. The worker's side, a span per
attempt, is a worker hook instead (``sluice.tracing.AttemptSpans``).

With no tracer installed (the default) an add costs one global read, and a
tracer that raises is logged, never a failed add.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sluice.engine.job import JobSpec

log = logging.getLogger("sluice.tracing")


class EnqueueScope(Protocol):
    """One add call being traced."""

    #: the traceparent the new jobs carry (those that name none of their own); None: none
    trace_context: str | None

    def done(self, job_ids: Sequence[str] | None, error: BaseException | None) -> None:
        """The add returned ``job_ids``, or raised ``error``."""


class Tracer(Protocol):
    def enqueue(self, queue: str, specs: Sequence[JobSpec]) -> EnqueueScope: ...


_tracer: Tracer | None = None


def install(tracer: Tracer | None) -> Tracer | None:
    """Make ``tracer`` the process's (None: tracing off); returns the one it replaces."""
    global _tracer  # one per process, as OpenTelemetry's tracer provider is
    previous, _tracer = _tracer, tracer
    return previous


def installed() -> Tracer | None:
    return _tracer


def enqueue_scope(queue: str, specs: Sequence[JobSpec]) -> EnqueueScope | None:
    """A scope for an add call, or None: no tracer, or every job carries a trace context of
    its caller's already (the service opens a span per submission itself)."""
    tracer = _tracer
    if tracer is None or all(spec.trace_context is not None for spec in specs):
        return None
    try:
        return tracer.enqueue(queue, specs)
    except Exception:
        log.warning("the tracer failed to open an enqueue span; the jobs are added untraced", exc_info=True)
        return None


def close_enqueue(scope: EnqueueScope, job_ids: Sequence[str] | None, error: BaseException | None) -> None:
    try:
        scope.done(job_ids, error)
    except Exception:
        log.warning("the tracer failed to close an enqueue span", exc_info=True)
