"""The Worker the tracing tests run in a process of their own:
``python -m sluice worker tests.harness.traced_workers:worker --queue Q --prefix P`` (cwd: the repository).

Its handlers: ``llm-inference`` (the built-in one, its provider from the environment:
``SLUICE_LLM_PROVIDER``, ``SLUICE_LLM_BASE_URL``...), ``flaky`` (raises on attempts before
``payload["succeed_on"]``), and ``loaded``, which answers whether this process traces: its
tracer, the worker's hooks (``sluice worker`` adds AttemptSpans when tracing is on), and the
OpenTelemetry tracing modules it imported (none while tracing is off; redis-py 8 imports
OpenTelemetry's API and metrics SDK itself when they are installed, so those are not counted).
"""

from __future__ import annotations

import sys
from typing import Any

from sluice import JobContext, Worker
from sluice.engine import tracehooks
from sluice.llm.inference import register_inference

worker = Worker(queue="traced", concurrency=4, lease=5.0)
register_inference(worker)


@worker.handler
async def flaky(job: JobContext) -> dict[str, Any]:
    if job.attempt < int(job.payload["succeed_on"]):
        raise RuntimeError(f"flaky: attempt {job.attempt} fails")
    return {"attempt": job.attempt, "trace_context": job.trace_context}


@worker.handler
async def loaded(job: JobContext) -> dict[str, Any]:
    tracing_modules = ("sluice.tracing.otel", "opentelemetry.sdk.trace", "opentelemetry.exporter")
    return {
        "tracer": tracehooks.installed() is not None,
        "hooks": [type(hook).__name__ for hook in worker.hooks],
        "modules": sorted(m for m in sys.modules if m.startswith(tracing_modules)),
        "trace_context": job.trace_context,
    }
