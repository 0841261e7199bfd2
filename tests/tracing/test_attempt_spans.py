"""The attempts' spans as a worker hook (``sluice.tracing.AttemptSpans``), in this process: a
real worker on the test's Redis, spans kept by OpenTelemetry's in-memory exporter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from redis.asyncio import Redis

from sluice import Backoff, JobContext, JobFailed, Queue, Worker, tracing
from tests.conftest import running

FAST = Backoff.fixed(0.05)


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)  # the producer's side: Queue.add's enqueue span
    yield exporter
    tracing.disable()
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def parent_of(span: ReadableSpan) -> tuple[int, int] | None:
    return None if span.parent is None else (span.parent.trace_id, span.parent.span_id)


def ids(span: ReadableSpan) -> tuple[int, int]:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_the_attempt_is_the_enqueue_spans_child_and_the_handlers_spans_are_its_children(
    queue: Queue, redis: Redis, prefix: str, exported: InMemorySpanExporter
) -> None:
    provider = tracing.tracer_provider()
    assert provider is not None
    # The hook made before tracing is on, as a module-level Worker's is: it takes the provider
    # tracing was enabled with when the worker starts.
    tracing.disable()
    w = Worker("q", prefix=prefix, hooks=[tracing.AttemptSpans()])
    tracing.enable(provider)
    app = provider.get_tracer("app")  # the handlers' own spans, as an application makes them

    @w.handler
    async def summarize(job: JobContext) -> str:
        with app.start_as_current_span("summarize work"):
            await asyncio.sleep(0)
        return "ok"

    @w.handler
    def resize(job: JobContext) -> str:  # in a thread: the attempt's context goes with it
        with app.start_as_current_span("resize work"):
            return "ok"

    async with running(w, redis):
        jobs = {name: await queue.add(name, correlation_id=f"req-{name}") for name in ("summarize", "resize")}
        for job in jobs.values():
            assert await job.result(timeout=10) == "ok"

    enqueues = {attrs(s)["sluice.job.id"]: s for s in named(exported, "sluice.enqueue")}
    attempts = {attrs(s)["sluice.job.id"]: s for s in named(exported, "process q")}
    for name, job in jobs.items():
        enqueue, attempt = enqueues[job.id], attempts[job.id]
        (inner,) = named(exported, f"{name} work")
        assert parent_of(attempt) == ids(enqueue)
        assert parent_of(inner) == ids(attempt)
        assert attempt.kind == SpanKind.CONSUMER
        assert attrs(attempt)["sluice.outcome"] == "completed"
        assert attrs(attempt)["sluice.correlation_id"] == f"req-{name}"
        assert attempt.status.status_code != StatusCode.ERROR
    # Closed on its own task: nothing of the attempt's is current in the test's afterwards.
    assert not trace.get_current_span().get_span_context().is_valid


async def test_a_retried_job_has_sibling_attempts_and_the_failure_is_an_error(
    queue: Queue, redis: Redis, prefix: str, exported: InMemorySpanExporter
) -> None:
    provider = tracing.tracer_provider()
    assert provider is not None
    w = Worker("q", prefix=prefix, hooks=[tracing.AttemptSpans(provider)])

    @w.handler
    async def flaky(job: JobContext) -> int:
        if job.attempt == 1:
            raise RuntimeError("first attempt fails")
        return job.attempt

    async with running(w, redis):
        job = await queue.add("flaky", max_attempts=2, backoff=FAST)
        assert await job.result(timeout=10) == 2
    (enqueue,) = named(exported, "sluice.enqueue")
    first, second = sorted(named(exported, "process q"), key=lambda s: attrs(s)["sluice.job.attempt"])
    assert parent_of(first) == parent_of(second) == ids(enqueue)
    assert attrs(first)["sluice.outcome"] == "retry" and first.status.status_code == StatusCode.ERROR
    assert attrs(first)["error.type"] == "RuntimeError"
    assert attrs(second)["sluice.outcome"] == "completed"


async def test_a_job_added_untraced_starts_a_trace_of_its_own(
    queue: Queue, redis: Redis, prefix: str, exported: InMemorySpanExporter
) -> None:
    tracing.disable()  # the producer traces nothing: the job carries no trace context
    job = await queue.add("work")
    w = Worker("q", prefix=prefix, hooks=[tracing.AttemptSpans(_provider(exported))])
    w.register("work", lambda job: "ok")
    async with running(w, redis):
        assert await job.result(timeout=10) == "ok"
    (attempt,) = named(exported, "process q")
    assert attempt.parent is None


def _provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


class _Refusing(TracerProvider):
    """A provider whose tracer cannot open spans: its failures must not be the job's."""

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        tracer = super().get_tracer(*args, **kwargs)

        def start_span(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no spans today")

        tracer.start_span = start_span  # type: ignore[method-assign]
        return tracer


async def test_a_tracer_that_fails_fails_no_attempt(
    queue: Queue, redis: Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = Worker("q", prefix=prefix, hooks=[tracing.AttemptSpans(_Refusing())])

    @w.handler
    async def boom(job: JobContext) -> None:
        raise ValueError("the handler's own")

    w.register("work", lambda job: "ok")
    async with running(w, redis):
        assert await (await queue.add("work")).result(timeout=10) == "ok"
        with pytest.raises(JobFailed, match="the handler's own"):
            await (await queue.add("boom", max_attempts=1)).result(timeout=10)
    assert "no spans today" in caplog.text and "failed before job" in caplog.text
