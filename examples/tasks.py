"""A worker with two handlers; run it with `sluice worker examples.tasks:worker`.

Then, in another shell: `sluice enqueue shout '{"text": "hello"}' --wait 10`.
"""

from __future__ import annotations

import asyncio

from sluice import JobContext, PermanentError, Worker

worker = Worker("default", concurrency=10)


@worker.handler
async def shout(job: JobContext) -> str:
    text = job.payload.get("text") if isinstance(job.payload, dict) else None
    if not isinstance(text, str):
        raise PermanentError('payload must be {"text": "..."}')
    await asyncio.sleep(0.01)  # stands in for an LLM call
    return text.upper()


@worker.handler
async def flaky(job: JobContext) -> str:
    if job.attempt < 2:
        raise RuntimeError("a transient provider error; retried with backoff")
    return f"succeeded on attempt {job.attempt}"
