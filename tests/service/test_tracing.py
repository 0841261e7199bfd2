"""Traces across real processes: the producer (library or API) here, a worker process of its own,
the simulated OpenAI server in a third; every span exported over OTLP/HTTP to a loopback
receiver that decodes the protobuf, as a collector would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from redis.asyncio import Redis

from sluice import Backoff, JobSpec, Queue, tracing
from sluice.engine.job import MAX_TRACE_CONTEXT_LENGTH, valid_trace_context
from sluice.errors import ConfigurationError
from sluice.llm.inference import inference_job
from sluice.settings import ENV_REDIS_URL, Settings
from sluice.testing.provider import serve_provider
from sluice.testing.simulated_server import FAULTS_PATH, ProviderLimits
from tests.conftest import running
from tests.docs.test_using import block
from tests.harness.otlp import Collector, Span, otlp_collector
from tests.harness.proc_harness import REPO
from tests.harness.service_harness import running_service

pytestmark = pytest.mark.slow

QUEUE = "traced"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
FAST = Backoff("fixed", 0.05, 0.05, 0.0)
WORKER = [sys.executable, "-m", "sluice", "worker", "tests.harness.traced_workers:worker"]


@pytest.fixture
def collector() -> Iterator[Collector]:
    with otlp_collector() as found:
        yield found


@pytest.fixture
def producer(collector: Collector) -> Iterator[TracerProvider]:
    """Tracing on in this process: spans exported one by one to the collector."""
    provider = TracerProvider(resource=Resource.create({"service.name": "test-producer"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{collector.url}/v1/traces")))
    tracing.enable(provider)
    yield provider
    tracing.disable()
    provider.shutdown()


@pytest.fixture(scope="module")
def provider_url() -> Iterator[str]:
    # No key: OpenAI's key goes to api.openai.com only, and this one is "openai" at another
    # address (as a proxy in front of OpenAI is), so that its answers are priced.
    with serve_provider(ProviderLimits()) as url:
        yield url


@pytest.fixture
async def queue(redis_url: str, prefix: str) -> AsyncIterator[Queue]:
    async with Queue.from_url(redis_url, QUEUE, prefix=prefix) as q:
        yield q


def traced_env(collector: Collector) -> dict[str, str]:
    """A worker that traces: OTLP over HTTP to the collector, batches sent every 50 ms."""
    return {
        "SLUICE_TRACING": "on",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "sluice-worker",
    }


@contextlib.contextmanager
def worker_process(
    redis_url: str, prefix: str, tmp_path: Path, env: Mapping[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """``sluice worker tests.harness.traced_workers:worker`` in a process of its own, stopped (SIGTERM: a
    clean exit, which flushes its spans) on leaving; its stderr is shown if the test fails."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "SLUICE_TRACING"}
    log = tmp_path / "worker.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [*WORKER, "--queue", QUEUE, "--prefix", prefix, "--worker-id", "tw-1"],
            env={**clean, **env, ENV_REDIS_URL: redis_url},
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        assert code == 0, log.read_text()


def one(spans: list[Span]) -> Span:
    assert len(spans) == 1, spans
    return spans[0]


def attempts(collector: Collector, job_id: str) -> list[Span]:
    found = [s for s in collector.named(f"process {QUEUE}") if s.attributes.get("sluice.job.id") == job_id]
    return sorted(found, key=lambda s: int(s.attributes["sluice.job.attempt"]))


async def test_one_trace_from_the_producer_through_retries_to_the_provider_call(
    queue: Queue, redis_url: str, prefix: str, tmp_path: Path, collector: Collector,
    producer: TracerProvider, provider_url: str,
) -> None:  # fmt: skip
    # Given a provider whose first answer is a 500: attempt 1 fails, attempt 2 is answered
    async with httpx.AsyncClient() as client:
        (await client.post(provider_url + FAULTS_PATH, json=[{"status": 500}])).raise_for_status()
    env = {
        **traced_env(collector),
        "SLUICE_LLM_PROVIDER": "openai",
        "SLUICE_LLM_BASE_URL": f"{provider_url}/v1",
    }
    # When the job is added inside a span of the producer's own
    with producer.get_tracer("test").start_as_current_span("checkout") as root:
        spec = inference_job(
            "Say hello.", max_tokens=8, cache=False, tenant="acme", max_attempts=3, backoff=FAST,
            correlation_id="req-trace-7",
        )  # fmt: skip
        (job,) = await queue.add_bulk([spec])
    trace_id = format(root.get_span_context().trace_id, "032x")
    record = await job.info()
    assert record.trace_context is not None and record.trace_context.startswith(f"00-{trace_id}-")
    with worker_process(redis_url, prefix, tmp_path, env):
        result = await job.result(timeout=30)
    assert isinstance(result, dict) and result["usage"]["completion_tokens"] == 8

    # Then one trace: enqueue (child of the producer's span) -> two sibling attempts -> the calls
    collector.wait_for(lambda spans: len([s for s in spans if s.name == "chat gpt-4o-mini"]) >= 2)
    enqueue = one(collector.named("sluice.enqueue"))
    assert (enqueue.trace_id, enqueue.parent_id) == (
        trace_id,
        format(root.get_span_context().span_id, "016x"),
    )
    assert enqueue.kind == "producer" and enqueue.service == "test-producer"
    assert enqueue.attributes["sluice.correlation_id"] == "req-trace-7"
    assert enqueue.attributes["sluice.job.id"] == job.id
    assert record.trace_context.split("-")[2] == enqueue.span_id

    first, second = attempts(collector, job.id)
    for attempt in (first, second):
        assert attempt.trace_id == trace_id and attempt.parent_id == enqueue.span_id  # siblings
        assert attempt.kind == "consumer" and attempt.service == "sluice-worker"
        assert attempt.attributes["sluice.queue"] == QUEUE
        assert attempt.attributes["sluice.job.type"] == "llm-inference"
        assert attempt.attributes["sluice.correlation_id"] == "req-trace-7"
        assert attempt.attributes["sluice.tenant"] == "acme"
    assert [first.attributes["sluice.job.attempt"], second.attributes["sluice.job.attempt"]] == [1, 2]
    assert first.attributes["sluice.outcome"] == "retry" and first.status == 2  # an error
    assert first.attributes["error.type"] == "ProviderUnavailable"
    ((event, about),) = first.events
    assert event == "exception" and about["exception.type"] == "ProviderUnavailable"
    assert "HTTP 500" in about["exception.message"]
    assert second.attributes["sluice.outcome"] == "completed" and second.status != 2

    calls = {s.parent_id: s for s in collector.named("chat gpt-4o-mini")}
    assert set(calls) == {first.span_id, second.span_id}
    failed, answered = calls[first.span_id], calls[second.span_id]
    assert failed.status == 2 and answered.status != 2
    assert answered.trace_id == trace_id and answered.kind == "client"
    assert answered.attributes["gen_ai.provider.name"] == "openai"
    assert answered.attributes["gen_ai.request.model"] == "gpt-4o-mini"
    assert answered.attributes["gen_ai.usage.output_tokens"] == 8
    assert answered.attributes["sluice.llm.total_tokens"] == result["usage"]["total_tokens"]
    assert answered.attributes["sluice.llm.cost_usd"] == pytest.approx(result["cost"])
    assert answered.attributes["sluice.llm.cache_hit"] is False


@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "routes"])
async def test_an_api_request_continues_the_callers_trace_into_the_worker(
    redis_url: str, sluice_database_url: str, prefix: str, tmp_path: Path, collector: Collector,
    producer: TracerProvider, fast_lane: bool,
) -> None:  # fmt: skip
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-ID": "req-api-1"}
    async with running_service(
        redis_url, sluice_database_url, prefix, fast_lane=fast_lane, queue=QUEUE
    ) as api:
        resp = await api.client.post(
            "/v1/jobs",
            json={"type": "flaky", "payload": {"succeed_on": 2}, "max_attempts": 2},
            headers=headers,
        )
        assert resp.status_code == 201, resp.text
        body = resp.json()
        with worker_process(redis_url, prefix, tmp_path, traced_env(collector)):
            collector.wait_for(lambda spans: len([s for s in spans if s.name == f"process {QUEUE}"]) >= 2)

    server = one([s for s in collector.spans if s.kind == "server"])
    assert (server.trace_id, server.parent_id) == (TRACE_ID, PARENT_ID)
    assert server.attributes["sluice.correlation_id"] == "req-api-1"
    enqueue = one(collector.named("sluice.enqueue"))
    assert enqueue.trace_id == TRACE_ID
    assert server.span_id in ancestors(collector.spans, enqueue)
    assert enqueue.attributes["sluice.correlation_id"] == "req-api-1"
    assert enqueue.attributes["sluice.tenant"] == "default"
    assert enqueue.attributes["sluice.job.uuid"] == body["id"]
    runs = [s for s in collector.named(f"process {QUEUE}")]
    assert sorted(s.attributes["sluice.outcome"] for s in runs) == ["completed", "retry"]
    for run in runs:
        assert run.trace_id == TRACE_ID and run.parent_id == enqueue.span_id
        assert run.attributes["sluice.correlation_id"] == "req-api-1"
        assert run.attributes["sluice.job.type"] == "flaky"


def ancestors(spans: list[Span], span: Span) -> list[str]:
    by_id = {s.span_id: s for s in spans}
    found: list[str] = []
    parent = by_id.get(span.parent_id)
    while parent is not None:
        found.append(parent.span_id)
        parent = by_id.get(parent.parent_id)
    return found


async def test_tracing_off_writes_no_field_and_imports_no_opentelemetry(
    queue: Queue, redis: Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    job = await queue.add("loaded", correlation_id="req-off")
    assert not await redis.hexists(queue.keys.job(job.id), "trace")
    with worker_process(redis_url, prefix, tmp_path, {"SLUICE_TRACING": "auto"}):
        result = await job.result(timeout=30)
    assert result == {
        "tracer": False,
        "hooks": ["RuntimeFromEnv", "FreezeAfterStartup"],
        "modules": [],
        "trace_context": None,
    }


async def test_a_malformed_trace_context_in_redis_is_ignored(
    queue: Queue, redis: Redis, redis_url: str, prefix: str, tmp_path: Path, collector: Collector
) -> None:
    # Given jobs whose stored trace context was changed behind the engine's back
    bad = await queue.add("flaky", {"succeed_on": 1})
    good = await queue.add("flaky", {"succeed_on": 1})
    probe = await queue.add("loaded")
    given = f"00-{TRACE_ID}-{PARENT_ID}-01"
    await redis.hset(queue.keys.job(bad.id), "trace", "00-not-a-trace-context")
    await redis.hset(queue.keys.job(good.id), "trace", given)
    assert (await bad.info()).trace_context is None
    # When a tracing worker runs them
    with worker_process(redis_url, prefix, tmp_path, traced_env(collector)):
        assert await bad.result(timeout=30) == {"attempt": 1, "trace_context": None}
        assert await good.result(timeout=30) == {"attempt": 1, "trace_context": given}
        traced = await probe.result(timeout=30)
        collector.wait_for(lambda spans: len(spans) >= 3)
    # (what the test with tracing off counts is there when it is on)
    assert isinstance(traced, dict) and traced["tracer"] is True
    assert traced["hooks"] == ["AttemptSpans", "RuntimeFromEnv", "FreezeAfterStartup"]  # around the others
    assert {"sluice.tracing.otel", "opentelemetry.sdk.trace"} <= set(traced["modules"])
    # Then the bad one's attempt starts a trace of its own; the good one's continues the stored one
    (lone,) = attempts(collector, bad.id)
    assert lone.parent_id == "" and lone.trace_id != TRACE_ID
    (joined,) = attempts(collector, good.id)
    assert (joined.trace_id, joined.parent_id) == (TRACE_ID, PARENT_ID)


@pytest.mark.parametrize(
    "value",
    [
        "00-not-a-trace-context",
        f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",  # W3C hex is lowercase
        f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is invalid
        f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 has four fields
        f"00-{TRACE_ID}-{PARENT_ID}-01\n",  # a line break (it would reach log lines)
        f"01-{TRACE_ID}-{PARENT_ID}-01-" + "x" * MAX_TRACE_CONTEXT_LENGTH,  # too long
        42,
    ],
)
def test_a_bad_trace_context_is_dropped_not_refused(value: Any) -> None:
    assert valid_trace_context(value) is None
    assert JobSpec("a", trace_context=value).trace_context is None


def test_a_good_trace_context_is_kept() -> None:
    for value in (f"00-{TRACE_ID}-{PARENT_ID}-01", f"01-{TRACE_ID}-{PARENT_ID}-00-future-field"):
        assert JobSpec("a", trace_context=value).trace_context == value


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ("console", "otlp")),
        ({"SLUICE_TRACING": "on"}, ("otlp",)),
        ({"SLUICE_TRACING": "off", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
        ({"OTEL_SDK_DISABLED": "true", "SLUICE_TRACING": "on"}, ()),
    ],
)
def test_tracing_is_on_only_when_asked_for(env: dict[str, str], exporters: tuple[str, ...]) -> None:
    assert Settings.from_env(env).trace_exporters == exporters


def test_a_bad_tracing_switch_is_an_error() -> None:
    with pytest.raises(ConfigurationError, match="SLUICE_TRACING='maybe': use on, off or auto"):
        Settings.from_env({"SLUICE_TRACING": "maybe"})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
        ({"SLUICE_TRACING": "on", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "set it to http/protobuf"),
    ],
)
def test_an_exporter_sluice_does_not_bring_stops_only_what_traces(env: dict[str, str], named: str) -> None:
    # A variable meant for another program on the machine does not stop `sluice info`...
    settings = Settings.from_env(env)
    # ...but a command that would trace says what it cannot do
    with pytest.raises(ConfigurationError, match=named):
        tracing.configure(settings)
    assert tracing.tracer_provider() is None


def test_tracing_off_costs_fastapi_nothing() -> None:
    assert tracing.tracer_provider() is None
    assert tracing.fastapi_telemetry() == {"tracing": False, "metrics": False, "logs": False}


async def test_submissions_written_in_one_batch_keep_their_own_traces(
    redis_url: str, sluice_database_url: str, prefix: str, collector: Collector, producer: TracerProvider
) -> None:
    # The intake writes the jobs that arrive together in one batch, from a task of its own:
    # each job still carries the trace of the request that sent it.
    traces = {f"req-{i}": f"{i + 1:032x}" for i in range(6)}
    async with running_service(redis_url, sluice_database_url, prefix, queue=QUEUE) as api:

        async def send(rid: str, trace_id: str) -> str:
            headers = {"traceparent": f"00-{trace_id}-{PARENT_ID}-01", "X-Request-ID": rid}
            resp = await api.client.post("/v1/jobs", json={"type": "flaky", "payload": {}}, headers=headers)
            assert resp.status_code == 201, resp.text
            return str(resp.json()["id"])

        ids = await asyncio.gather(*(send(rid, trace_id) for rid, trace_id in traces.items()))
        assert api.svc.intake.batches < len(traces)  # some were written together
        records = await api.svc.queue.get_jobs(ids)
    seen = {}
    for record in records:
        assert record is not None and record.trace_context is not None and record.correlation_id is not None
        seen[record.correlation_id] = record.trace_context.split("-")[1]
    assert seen == traces
    spans = collector.wait_for(
        lambda spans: len([s for s in spans if s.name == "sluice.enqueue"]) == len(traces)
    )
    assert {
        s.attributes["sluice.correlation_id"]: s.trace_id for s in spans if s.name == "sluice.enqueue"
    } == traces


async def test_the_tracing_library_example(
    queue: Queue, redis: Redis, prefix: str, collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/using.md, Tracing: the program's own provider, its exporter configured by the
    # variable; its Worker (on the test's queue here) traces its attempts with a hook
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    namespace: dict[str, Any] = {}
    exec(compile(block("tracing-library"), "docs/using.md", "exec"), namespace)  # noqa: S102 - the doc's code
    provider = namespace["provider"]
    worker = namespace["worker"].configure(queue=queue.name, prefix=prefix)
    try:
        job_id = await namespace["summarize_later"](queue, "A long text to summarize.")
        async with running(worker, redis):
            assert await queue.job(job_id).result(timeout=10) == "A long text to summarize."
        provider.force_flush()
    finally:
        tracing.disable()
        provider.shutdown()
    collector.wait_for(lambda spans: len(spans) >= 4)
    request = one(collector.named("summarize request"))
    enqueue = one(collector.named("sluice.enqueue"))
    assert (enqueue.trace_id, enqueue.parent_id) == (request.trace_id, request.span_id)
    assert enqueue.attributes["sluice.correlation_id"] == "req-42"
    record = await queue.get_job(job_id)
    assert record is not None and record.trace_context is not None
    assert record.trace_context.startswith(f"00-{enqueue.trace_id}-{enqueue.span_id}-")
    attempt = one(collector.named(f"process {QUEUE}"))
    assert (attempt.trace_id, attempt.parent_id) == (enqueue.trace_id, enqueue.span_id)
    handler = one(collector.named("summarize"))
    assert (handler.trace_id, handler.parent_id) == (attempt.trace_id, attempt.span_id)


async def test_the_tracing_worker_example(
    queue: Queue, redis_url: str, prefix: str, tmp_path: Path, collector: Collector
) -> None:
    # docs/using.md, Tracing: the extra, two variables, the usual command (the endpoint here is
    # the test's collector, the Worker the tests' own)
    lines = block("tracing-worker").strip().splitlines()
    assert lines[0] == "pip install 'sluice-queue[otel]'"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("opentelemetry-exporter-otlp-proto-http") for dep in extras["otel"])
    env = dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))
    assert set(env) == {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME"}
    assert shlex.split(lines[-1])[:2] == ["sluice", "worker"]
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector.url
    job = await queue.add("flaky", {"succeed_on": 1})
    with worker_process(redis_url, prefix, tmp_path, env):
        await job.result(timeout=30)
        (run,) = collector.wait_for(lambda spans: len(spans) >= 1)
    assert run.name == f"process {QUEUE}" and run.service == env["OTEL_SERVICE_NAME"]
    assert run.attributes["sluice.job.id"] == job.id


def test_each_api_process_traces_when_the_environment_says_so(redis_url: str) -> None:
    # `sluice serve` runs the ASGI factory in each API process: it reads the variables itself.
    code = (
        "import asyncio, httpx\n"
        "from opentelemetry import trace\n"
        "from sluice.service import asgi\n"
        "app = asgi.app()\n"
        "async def main():\n"
        "    transport = httpx.ASGITransport(app=app)\n"
        "    async with httpx.AsyncClient(transport=transport, base_url='http://api') as client:\n"
        f"        headers = {{'traceparent': '00-{TRACE_ID}-{PARENT_ID}-01', 'X-Request-ID': 'req-serve'}}\n"
        "        assert (await client.get('/healthz', headers=headers)).status_code == 200\n"
        "asyncio.run(main())\n"
        "trace.get_tracer_provider().force_flush()\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "SLUICE_TRACING"}
    env = {
        **clean,
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "sluice-api",
        ENV_REDIS_URL: redis_url,
        "SLUICE_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",  # not reached: no lifespan
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    spans = [json.loads(chunk) for chunk in re.findall(r"^\{.*?^\}", out.stdout, re.S | re.M)]
    (server,) = [s for s in spans if s["kind"] == "SpanKind.SERVER"]
    assert server["name"] == "GET /healthz"
    assert (server["context"]["trace_id"], server["parent_id"]) == (f"0x{TRACE_ID}", f"0x{PARENT_ID}")
    assert server["attributes"]["sluice.correlation_id"] == "req-serve"
    assert server["resource"]["attributes"]["service.name"] == "sluice-api"


def test_a_tracer_that_fails_never_fails_the_work(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tracer's own errors are logged, never raised: a submission, a request and a provider
    call (already paid for when the span is told) go on; the call's own errors still come out."""

    class Broken:
        def enqueue(self, *args: object, **kwargs: object) -> object:
            raise RuntimeError("tracer down")

        def tag_current_span(self, correlation_id: str) -> None:
            raise RuntimeError("tracer down")

        @contextlib.contextmanager
        def llm_call(self, *args: object, **kwargs: object) -> Iterator[object]:
            class Call:
                def record(self, result: object) -> None:
                    raise RuntimeError("tracer down")

            yield Call()
            raise RuntimeError("tracer down on close")

    monkeypatch.setattr(tracing, "_tracer", Broken)
    spec = JobSpec("generic", {})
    assert tracing.enqueue_scope("q", spec) is None
    tracing.tag_request("req-1")
    with tracing.llm_call("openai", "gpt-4o-mini") as call:
        call.record({"usage": {}})
    with pytest.raises(ValueError, match="the call's own"), tracing.llm_call("openai", "m"):
        raise ValueError("the call's own")
    assert sum("the tracer failed" in r.getMessage() for r in caplog.records) >= 4
