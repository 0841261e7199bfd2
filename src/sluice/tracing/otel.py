"""The OpenTelemetry side of :mod:`sluice.tracing`: imported only once tracing is on.

Names follow OpenTelemetry's semantic conventions where they have one
(messaging for the queue, GenAI for the provider call), and ``sluice.*``
where they do not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import sluice
from sluice.tracing import LLMCall

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.trace import Span, TracerProvider

    from sluice.engine.context import JobContext
    from sluice.engine.job import JobSpec

_PROPAGATOR = TraceContextTextMapPropagator()
#: Attempt outcomes whose span is an error: the handler failed (and will run again, or not).
_FAILED = ("retry", "dead")


def provider_for(exporters: Sequence[str]) -> TracerProvider:
    """The global tracer provider if the program set one up; else a new SDK provider (made the
    global one) exporting in batches to ``exporters`` (otlp: OTLP over HTTP, configured by the
    standard ``OTEL_EXPORTER_OTLP_*`` variables; console: stdout)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

    current = trace.get_tracer_provider()
    if isinstance(current, SdkTracerProvider):
        return current
    # The SDK reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; without a name, "sluice".
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = Resource.create({"service.name": "sluice"})
    provider = SdkTracerProvider(resource=resource)
    _add_exporters(provider, exporters)
    trace.set_tracer_provider(provider)
    return provider


def _add_exporters(provider: SdkTracerProvider, exporters: Sequence[str]) -> None:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    for name in exporters:
        exporter: SpanExporter
        if name == "console":
            exporter = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))


def _parent(trace_context: str | None) -> Context:
    """The context a job's span continues: its enqueue span's, or a new trace (an empty
    context, not whatever the worker's task had)."""
    if trace_context is None:
        return Context()
    return _PROPAGATOR.extract({"traceparent": trace_context}, context=Context())


def _traceparent(span: Span) -> str | None:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span, Context()))
    return carrier.get("traceparent")


class _Enqueue:
    """A ``sluice.enqueue`` span (tracehooks.EnqueueScope)."""

    __slots__ = ("span", "trace_context")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.trace_context = _traceparent(span)

    def done(self, job_ids: Sequence[str] | None, error: BaseException | None) -> None:
        span = self.span
        if job_ids is not None and len(job_ids) == 1:
            span.set_attribute("messaging.message.id", job_ids[0])
            span.set_attribute("sluice.job.id", job_ids[0])
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()


class _Attempt:
    """A ``process <queue>`` span, current on the attempt's task from its opening (in
    AttemptSpans.before_attempt) to :meth:`done` (in after_attempt, on the same task)."""

    __slots__ = ("ctx", "span", "token")

    def __init__(self, span: Span, ctx: JobContext) -> None:
        self.span = span
        self.ctx = ctx
        self.token = otel_context.attach(trace.set_span_in_context(span))

    def done(self, outcome: str, error: str | None) -> None:
        """The attempt ended: ``outcome`` as ``AttemptEnd.outcome`` names it; ``error`` the
        error text its job record keeps, for a failure."""
        span, ctx = self.span, self.ctx
        try:
            span.set_attribute("sluice.outcome", outcome)
            tenant = ctx.payload.get("tenant") if isinstance(ctx.payload, dict) else None
            if isinstance(tenant, str):
                span.set_attribute("sluice.tenant", tenant)
            if ctx.usage >= 0:
                span.set_attribute("sluice.job.usage_tokens", ctx.usage)
            if outcome in _FAILED:
                first, _, rest = (error or outcome).partition("\n")
                kind = first.split(":", 1)[0][:200]
                span.set_attribute("error.type", kind)
                span.set_status(Status(StatusCode.ERROR, first[:500]))
                # As record_exception would have it, from the error the attempt reports.
                event = {"exception.type": kind, "exception.message": first[:500]}
                if rest:
                    event["exception.stacktrace"] = rest
                span.add_event("exception", event)
            span.end()
        finally:
            otel_context.detach(self.token)


class _LLMCall(LLMCall):
    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def record(self, result: Mapping[str, Any]) -> None:
        span = self.span
        usage = result.get("usage") or {}
        hit = bool(result.get("cacheHit"))
        attributes: dict[str, Any] = {"sluice.llm.cache_hit": hit}
        if isinstance(result.get("model"), str):
            attributes["gen_ai.response.model"] = result["model"]
        for key, name in (
            ("prompt_tokens", "gen_ai.usage.input_tokens"),
            ("completion_tokens", "gen_ai.usage.output_tokens"),
            ("total_tokens", "sluice.llm.total_tokens"),
        ):
            if isinstance(usage.get(key), int):
                attributes[name] = usage[key]
        if isinstance(result.get("cost"), int | float):
            attributes["sluice.llm.cost_usd"] = float(result["cost"])
        if isinstance(result.get("finishReason"), str):
            attributes["gen_ai.response.finish_reasons"] = [result["finishReason"]]
        span.set_attributes(attributes)


class OtelTracer:
    """The tracer :func:`sluice.tracing.enable` installs in the engine (tracehooks.Tracer), and
    the one each :class:`~sluice.tracing.AttemptSpans` hook opens its spans with."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.provider = provider if provider is not None else trace.get_tracer_provider()
        self.tracer = self.provider.get_tracer("sluice", sluice.__version__)

    def enqueue(
        self,
        queue: str,
        specs: Sequence[JobSpec],
        *,
        tenant: str | None = None,
        job_uuid: str | None = None,
    ) -> _Enqueue:
        attributes: dict[str, Any] = {
            "messaging.system": "sluice",
            "messaging.operation.type": "send",
            "messaging.operation.name": "enqueue",
            "messaging.destination.name": queue,
            "sluice.queue": queue,
        }
        if len(specs) == 1:
            spec = specs[0]
            attributes["sluice.job.type"] = spec.name
            if spec.correlation_id is not None:
                attributes["sluice.correlation_id"] = spec.correlation_id
        else:
            attributes["messaging.batch.message_count"] = len(specs)
            names = sorted({spec.name for spec in specs})
            attributes["sluice.job.types"] = names[:20]
            ids = sorted({spec.correlation_id for spec in specs if spec.correlation_id is not None})
            if len(ids) == 1:
                attributes["sluice.correlation_id"] = ids[0]
        if tenant is not None:
            attributes["sluice.tenant"] = tenant
        if job_uuid is not None:
            attributes["sluice.job.uuid"] = job_uuid
        span = self.tracer.start_span("sluice.enqueue", kind=SpanKind.PRODUCER, attributes=attributes)
        return _Enqueue(span)

    def attempt(self, ctx: JobContext) -> _Attempt:
        attributes: dict[str, Any] = {
            "messaging.system": "sluice",
            "messaging.operation.type": "process",
            "messaging.destination.name": ctx.queue,
            "messaging.message.id": ctx.id,
            "messaging.consumer.group.name": ctx.worker_id,
            "sluice.queue": ctx.queue,
            "sluice.job.id": ctx.id,
            "sluice.job.type": ctx.name,
            "sluice.job.attempt": ctx.attempt,
            "sluice.job.max_attempts": ctx.max_attempts,
            "sluice.worker.id": ctx.worker_id,
        }
        if ctx.correlation_id is not None:
            attributes["sluice.correlation_id"] = ctx.correlation_id
        if ctx.budget is not None:
            attributes["sluice.budget"] = ctx.budget
        span = self.tracer.start_span(
            f"process {ctx.queue}",
            context=_parent(ctx.trace_context),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
        )
        return _Attempt(span, ctx)

    @staticmethod
    def tag_current_span(correlation_id: str) -> None:
        trace.get_current_span().set_attribute("sluice.correlation_id", correlation_id)

    @contextlib.contextmanager
    def llm_call(self, provider: str, model: str, *, max_tokens: int | None = None) -> Iterator[LLMCall]:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
        }
        if max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = max_tokens
        with self.tracer.start_as_current_span(
            f"chat {model}", kind=SpanKind.CLIENT, attributes=attributes
        ) as span:
            yield _LLMCall(span)
