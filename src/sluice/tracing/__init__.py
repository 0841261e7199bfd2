"""Traces: OpenTelemetry spans for a job's life, from the request that made it to the provider call.

Optional twice over: the ``otel`` extra brings OpenTelemetry's SDK and its
OTLP/HTTP exporter, and nothing is traced until tracing is switched on, by
:func:`configure` (what ``sluice worker``, ``serve``, ``dev`` and ``enqueue``
call with the environment's settings: ``SLUICE_TRACING``, ``OTEL_*``) or by
:func:`enable` (a program of your own, with your tracer provider). Off,
nothing here imports OpenTelemetry and each traced place costs a global read.

One trace per job: the span that adds it (``sluice.enqueue``, a child of
the API request's span or of whatever was current in your code) puts its W3C
``traceparent`` in the job (``JobSpec.trace_context``, stored in Redis by the
engine, which imports no tracing library); each attempt's ``process <queue>``
span on the worker is its child, so retries are siblings, and a provider call
(``chat <model>``) is the attempt's child. See docs/using.md, Tracing.

The producer's spans and the provider calls' follow the process's switch
(:func:`enable`): a job may be added by any program, and OpenTelemetry's
provider is one per process anyway. The attempts' spans belong to a worker:
its :class:`AttemptSpans` hook, which ``sluice worker`` adds when tracing is
on and a program of your own passes in ``Worker(hooks=[...])``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from sluice.engine import tracehooks
from sluice.engine.hooks import Hook
from sluice.errors import ConfigurationError
from sluice.extras import require
from sluice.settings import TRACE_EXPORTERS, Settings

if TYPE_CHECKING:
    from fastapi.telemetry import TelemetryConfig
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import TracerProvider as AnyTracerProvider

    from sluice.engine.context import JobContext
    from sluice.engine.hooks import AttemptEnd
    from sluice.engine.job import JobSpec
    from sluice.engine.tracehooks import EnqueueScope
    from sluice.tracing.otel import OtelTracer

_FEATURE = "tracing (SLUICE_TRACING, OTEL_*)"

log = logging.getLogger("sluice.tracing")


def configure(settings: Settings) -> bool:
    """Switch tracing on if the settings ask for it (``Settings.trace_exporters``); True if on.

    Raises :class:`~sluice.errors.MissingExtra` when they do and the ``otel``
    extra is not installed, and ConfigurationError for an exporter or OTLP
    protocol it does not bring. Spans go to the exporters named (OTLP over HTTP by
    default, to ``OTEL_EXPORTER_OTLP_ENDPOINT``), in batches, flushed when the
    process exits; a tracer provider the program set already is used as is.
    """
    if not settings.trace_exporters:
        return False
    unknown = [name for name in settings.trace_exporters if name not in TRACE_EXPORTERS]
    if unknown:
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER={','.join(settings.trace_exporters)!r}: Sluice exports spans with "
            f"{' or '.join(TRACE_EXPORTERS)} (or none: tracing off)"
        )
    protocol = settings.otlp_protocol
    if "otlp" in settings.trace_exporters and protocol and protocol.strip().lower() != "http/protobuf":
        raise ConfigurationError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: the 'otel' extra exports OTLP over HTTP; "
            "set it to http/protobuf (a collector listens on port 4318 for it)"
        )
    require("otel", _FEATURE, "opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http")
    from sluice.tracing.otel import provider_for

    enable(provider_for(settings.trace_exporters))
    return True


def enable(tracer_provider: AnyTracerProvider | None = None) -> None:
    """Trace with ``tracer_provider`` (default: OpenTelemetry's global one, as your program set
    it up): the jobs this process adds and the provider calls it makes. A worker's attempts
    are traced by its :class:`AttemptSpans` hook. Needs the ``otel`` extra (opentelemetry-api
    at least)."""
    require("otel", _FEATURE, "opentelemetry.trace")
    from sluice.tracing.otel import OtelTracer

    tracehooks.install(OtelTracer(tracer_provider))


def disable() -> None:
    """Stop tracing (spans already made are still exported by their provider)."""
    tracehooks.install(None)


def _tracer() -> OtelTracer | None:
    tracer = tracehooks.installed()
    if tracer is None:
        return None
    from sluice.tracing.otel import OtelTracer

    return tracer if isinstance(tracer, OtelTracer) else None


def tracer_provider() -> TracerProvider | AnyTracerProvider | None:
    """The provider spans go to, or None when tracing is off."""
    tracer = _tracer()
    return None if tracer is None else tracer.provider


class AttemptSpans(Hook):
    """A ``process <queue>`` span around each attempt of a worker (``sluice worker`` adds one
    when tracing is on; a program of your own passes it in ``Worker(hooks=[...])``).

    Opened in ``before_attempt``, on the attempt's own task just before the handler, and
    made current there: what the handler traces (a provider call's ``chat`` span) is its
    child. Its parent is the job's enqueue span (the job's trace context), so a job's
    retries are siblings. Closed in ``after_attempt`` with the outcome; a failed attempt's
    has an error status and the error. Added with ``outermost=True``, it also encloses what
    the worker's other hooks do around the handler.

    ``tracer_provider``: where the spans go; default: the one :func:`enable` (or
    :func:`configure`) was given, else OpenTelemetry's global one, as found when the worker
    starts (a provider your program sets up after making its Worker is the one used).
    """

    def __init__(self, tracer_provider: AnyTracerProvider | None = None) -> None:
        require("otel", _FEATURE, "opentelemetry.trace")
        self._provider = tracer_provider
        self._tracer: OtelTracer | None = None

    async def startup(self, state: dict[str, Any]) -> None:
        from sluice.tracing.otel import OtelTracer

        provider = self._provider if self._provider is not None else tracer_provider()
        self._tracer = OtelTracer(provider)

    def before_attempt(self, job: JobContext) -> Any:
        tracer = self._tracer
        return None if tracer is None else tracer.attempt(job)

    def after_attempt(self, job: JobContext, end: AttemptEnd, before: Any) -> None:
        if before is not None:  # None: started without the worker (no tracer), or opening failed
            before.done(end.outcome, end.error)


def fastapi_telemetry() -> TelemetryConfig:
    """``FastAPI(telemetry=...)``: request spans (continuing a caller's ``traceparent``) when
    tracing is on; all of FastAPI's telemetry off otherwise (it would look for providers on
    every request)."""
    provider = tracer_provider()
    if provider is None:
        return {"tracing": False, "metrics": False, "logs": False}
    return {"tracer_provider": provider, "metrics": False, "logs": False}


def enqueue_scope(
    queue: str, spec: JobSpec, *, tenant: str | None = None, job_uuid: str | None = None
) -> EnqueueScope | None:
    """A ``sluice.enqueue`` span for one job a service accepts (``job_uuid``: the id the API
    answers), a child of the current span (the request's); None when tracing is off. Its
    trace context goes into the job (``dataclasses.replace(spec, trace_context=...)``); end
    it with ``tracehooks.close_enqueue``."""
    tracer = _tracer()
    if tracer is None:
        return None
    try:
        return tracer.enqueue(queue, [spec], tenant=tenant, job_uuid=job_uuid)
    except Exception:  # a tracer's failure never refuses a job
        log.warning("the tracer failed to open an enqueue span", exc_info=True)
        return None


def tag_request(correlation_id: str) -> None:
    """Name the request's correlation id (its ``X-Request-ID``) on the current span: the API
    request's server span, so that every span of a job's trace carries it."""
    tracer = _tracer()
    if tracer is not None:
        try:
            tracer.tag_current_span(correlation_id)
        except Exception:
            log.warning("the tracer failed to tag a request's span", exc_info=True)


class LLMCall:
    """What a traced provider call learns once it answered (a no-op when tracing is off)."""

    def record(self, result: Mapping[str, Any]) -> None:
        """The answer: its model, token usage, cost and whether the cache served it."""


_UNTRACED = LLMCall()


class _Guarded(LLMCall):
    """A tracer's call record whose failures are logged: the provider has answered (and may
    have been paid) by the time it is told, so nothing here may fail the attempt."""

    def __init__(self, call: LLMCall) -> None:
        self._call = call

    def record(self, result: Mapping[str, Any]) -> None:
        try:
            self._call.record(result)
        except Exception:
            log.warning("the tracer failed to record a provider call", exc_info=True)


@contextlib.contextmanager
def llm_call(provider: str, model: str, *, max_tokens: int | None = None) -> Iterator[LLMCall]:
    """A ``chat <model>`` client span around one provider call (or cache lookup), a child of
    the running attempt's span. The tracer's own failures are logged, never raised: the
    call's errors are the only ones that come out."""
    tracer = _tracer()
    if tracer is None:
        yield _UNTRACED
        return
    try:
        span = tracer.llm_call(provider, model, max_tokens=max_tokens)
        call = span.__enter__()
    except Exception:
        log.warning("the tracer failed to open a provider call's span", exc_info=True)
        yield _UNTRACED
        return
    try:
        yield _Guarded(call)
    except BaseException as exc:
        _close(span, exc)
        raise
    _close(span, None)


def _close(span: contextlib.AbstractContextManager[Any], exc: BaseException | None) -> None:
    try:
        span.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
    except Exception:
        log.warning("the tracer failed to close a provider call's span", exc_info=True)
