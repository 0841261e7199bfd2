"""What a handler receives: the job it runs, and how to be idempotent about it; and which job
a log line is about, wherever in the handler's call tree it was written."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

from sluice.engine.job import MAX_TOKENS
from sluice.engine.lag import LagMeter
from sluice.engine.provider_view import ProviderView

#: The attempt running in this task (or in the thread of a sync handler): set by the worker
#: before the handler starts, in the job's own task, so that it never leaks to another job.
_current: ContextVar[JobContext | None] = ContextVar("sluice_current_job", default=None)


def current_job() -> JobContext | None:
    """The job attempt whose handler is running here (None outside one).

    Code deep in a handler's call tree (a provider client, a helper library)
    can name the job it works for without the context being passed down.
    """
    return _current.get()


def set_current_job(ctx: JobContext | None) -> None:
    """For the worker: make ``ctx`` the current job of this task."""
    _current.set(ctx)


class JobLogFilter(logging.Filter):
    """Adds the running job to every log record written while its handler runs: ``job_id``,
    ``job_name``, ``attempt``, and ``correlation_id`` (the request that made it).

    Put it on a handler (``handler.addFilter(JobLogFilter())``): a formatter
    or structlog's ``ExtraAdder`` then shows them. ``sluice worker`` does this
    itself. A field the record already has is left alone.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        add_job_fields(record.__dict__)
        return True


def add_job_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Add the running job's ``job_id``, ``job_name``, ``attempt`` and ``correlation_id`` to
    ``fields`` (a log record's or event's), leaving any it has alone; returns ``fields``."""
    ctx = _current.get()
    if ctx is not None:
        fields.setdefault("job_id", ctx.id)
        fields.setdefault("job_name", ctx.name)
        fields.setdefault("attempt", ctx.attempt)
        if ctx.correlation_id is not None:
            fields.setdefault("correlation_id", ctx.correlation_id)
    return fields


class JobContext:
    """One running attempt of a job, passed to its handler.

    ``attempt`` counts from 1 and grows with every retry (and with every run
    after a lost lease), so a handler can tell a first try from a repeat.
    ``idempotency_key`` is the same for every attempt of the job: pass it to
    a provider that deduplicates requests, since delivery is at-least-once.
    ``tokens`` is the job's token estimate (what the dispatch reserved for this
    attempt when the job has a budget or the queue a token-rate limit) and
    ``budget`` the budget it spends from (None: none): a handler can cap the
    provider's ``max_tokens`` so that the call cannot cost more than it reserved.
    ``stop_requested`` turns true when the worker wants the attempt to end (its
    timeout, a cancel request, a lost lease, shutdown): an async handler is
    cancelled as well, but a sync one (``def``) runs in a thread that cannot
    be interrupted, so a long one checks it between steps.
    """

    __slots__ = (
        "attempt",
        "budget",
        "correlation_id",
        "created_ms",
        "dispatched_ms",
        "epoch",
        "id",
        "lag",
        "max_attempts",
        "name",
        "payload",
        "prefix",
        "provider_view",
        "queue",
        "sent_delay",
        "sent_noted",
        "stop_requested",
        "token",
        "tokens",
        "trace_context",
        "usage",
        "worker_id",
    )

    def __init__(
        self,
        queue: str,
        job_id: str,
        name: str,
        payload: Any,
        attempt: int,
        max_attempts: int,
        created_ms: int,
        worker_id: str,
        token: bytes | int,
        *,
        prefix: str = "sluice",
        epoch: str = "",
        tokens: int = 0,
        budget: str | None = None,
        correlation_id: str | None = None,
        trace_context: str | None = None,
        dispatched_ms: int = 0,
        lag: LagMeter | None = None,
        provider_view: ProviderView | None = None,
    ) -> None:
        self.queue = queue
        self.id = job_id
        self.name = name
        self.payload = payload
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.created_ms = created_ms
        self.worker_id = worker_id
        self.token = token
        self.prefix = prefix
        #: the queue's epoch when the job was leased (see idempotency_key)
        self.epoch = epoch
        #: the job's token estimate, reserved for this attempt if it has a budget
        self.tokens = tokens
        #: the budget the job spends from, or None
        self.budget = budget
        #: the id of the request that made the job (JobSpec.correlation_id), or None
        self.correlation_id = correlation_id
        #: the W3C traceparent of the span that added the job (JobSpec.trace_context), or None
        self.trace_context = trace_context
        #: tokens this attempt used, as reported with record_usage (-1: not reported)
        self.usage = -1
        #: set by the worker (from its event loop) when it wants this attempt to end; a plain
        #: flag, so that a sync handler can read it from its thread
        self.stop_requested = False
        #: when the dispatch leased this attempt (ms, Redis's clock; 0: unknown)
        self.dispatched_ms = dispatched_ms
        #: the worker's meter of dispatch-to-send delays (None outside a worker)
        self.lag = lag
        self.sent_noted = False
        #: this attempt's send delay (ms) as the meter took it (None: not sent, or not measured)
        self.sent_delay: float | None = None
        #: where the worker gathers what providers said of their limits (None outside a worker)
        self.provider_view = provider_view

    def note_sent(self) -> bool:
        """Say that the call this job was dispatched for is leaving now.

        Call it right before sending the request that counts against the
        provider's limits (Sluice's own providers do it for you); only the
        first call of an attempt counts. The worker measures how late calls
        leave after their dispatch, and the queue's pacer widens its windows
        by the spread of those delays, so that calls that arrive closer
        together than they were started still fit the provider's window
        (docs/architecture.md, "The pacer"). A handler that never says is
        not measured: the queue's least headroom is all it gets. Returns whether
        this was the attempt's first call (the one the queue's windows counted).
        """
        if self.sent_noted:
            return False
        self.sent_noted = True
        if self.lag is not None and self.dispatched_ms:
            self.sent_delay = self.lag.sent(self.dispatched_ms)
        return True

    def note_provider_limits(
        self,
        *,
        limit_requests: int | None = None,
        remaining_requests: int | None = None,
        limit_tokens: int | None = None,
        remaining_tokens: int | None = None,
        transit_ms: float | None = None,
    ) -> None:
        """Pass on what the provider's answer said of its limits (its rate-limit headers).

        Sluice's providers call it for every completion. The queue compares the
        provider's use (limit - remaining) with its own windows at this job's
        dispatch and counts what it did not see (another program on the same
        key), and lowers a limit the provider states lower than the queue's
        (docs/architecture.md, "The provider's view"; ``Queue.follow_provider``
        turns it off). Figures the answer did not give are None.

        ``transit_ms``: the call's round trip less the time the provider says it
        spent on it (OpenAI's ``openai-processing-ms``). With the send's own
        delay it tells how late this call reached the provider, and the queue
        keeps it that much longer in its windows, as the provider does
        (docs/architecture.md, "Late calls stay longer").
        """
        if self.provider_view is None or not self.dispatched_ms:
            return
        late = 0.0 if self.lag is None else self.lag.lateness(self.sent_delay, transit_ms)
        token = self.token.decode() if isinstance(self.token, bytes) else str(self.token)
        self.provider_view.add(
            self.dispatched_ms,
            member=f"{self.id}:{token}",
            tokens=self.tokens,
            late_ms=round(late),
            limit_requests=limit_requests,
            remaining_requests=remaining_requests,
            limit_tokens=limit_tokens,
            remaining_tokens=remaining_tokens,
        )

    def record_usage(self, tokens: int) -> None:
        """Report the tokens this attempt actually used (e.g. the provider's usage.total_tokens).

        When the attempt ends, whatever its outcome (completed, failed, timed
        out, cancelled, throttled), the job's reservation is corrected to it:
        the provider billed what it served. Less than the estimate goes back to
        the budget and the token-rate window; more is charged in full, past the
        budget's limit if need be (the budget then admits nothing more). Report
        0 when the provider was never called. Without a report, a completed
        attempt keeps its whole estimate charged, a throttled one is refunded
        (the provider refused the call), and any other outcome keeps it charged
        as "unknown outcome" (safe with money).
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS:
            raise ValueError(f"tokens must be an integer from 0 to {MAX_TOKENS}, got {tokens!r}")
        self.usage = tokens

    @property
    def reservation_id(self) -> str:
        """``<job id>:<attempt token>``: the id the dispatch script reserves this
        attempt's tokens under (for a job with a budget, or on a queue with a
        token-rate limit), unique per attempt: a throttled attempt is not
        counted, so the attempt number repeats; the token never does.

        It is also a good id for reservations of your own in the handler
        (``queue.budgets.reserve``): those are kept apart from the dispatch
        script's, so the two never meet."""
        token = self.token.decode() if isinstance(self.token, bytes) else str(self.token)
        return f"{self.id}:{token}"

    @property
    def idempotency_key(self) -> str:
        """``<prefix>:<queue>:<epoch>:<job id>``: the same for every attempt of the job, and
        never the same for two jobs anywhere.

        Job ids are per queue and start again from 1 if Redis loses its data,
        so the key carries the key prefix (two environments on one provider
        account), the queue, and the queue's epoch: a random value stored in
        Redis, made anew when it is missing (a new Redis, or one that lost
        its data).
        """
        return f"{self.prefix}:{self.queue}:{self.epoch}:{self.id}"

    @property
    def is_last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    def __repr__(self) -> str:
        return f"JobContext(queue={self.queue!r}, id={self.id!r}, name={self.name!r}, attempt={self.attempt})"
