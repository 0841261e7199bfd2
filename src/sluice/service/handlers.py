"""The job types the service runs out of the box, and the worker that runs them.

``generic`` (any object payload; ``payload.fail = true`` fails the attempt,
for trying retries and the dead-letter queue), ``email`` (simulated: about a
second, and a log line naming ``payload.to``; ``send_email`` is the same) and
``llm-inference`` (``payload.prompt`` required; answered by a simulated model
until the LLM layer wires real providers). Teams add their own handlers to
the same worker: ``worker = service_worker(); @worker.handler ...``, then
``sluice worker app:worker``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from sluice.engine.context import JobContext
from sluice.engine.worker import Worker
from sluice.errors import PermanentError
from sluice.service.config import EVENTS_MAXLEN
from sluice.settings import DEFAULT_PREFIX

log = logging.getLogger("sluice.jobs")

#: Seconds the simulated email takes.
EMAIL_SECONDS = 1.0
#: The simulated model's speed: a base latency and seconds per output token.
LLM_BASE_SECONDS = 0.05
LLM_SECONDS_PER_TOKEN = 0.0005


class JobFailed(Exception):
    """A generic job asked to fail (``payload.fail = true``)."""


def _object(job: JobContext) -> dict[str, Any]:
    if not isinstance(job.payload, dict):
        raise PermanentError(f"{job.name} jobs need an object payload, got {type(job.payload).__name__}")
    return job.payload


async def generic(job: JobContext) -> dict[str, Any]:
    payload = _object(job)
    if payload.get("fail") is True:
        raise JobFailed(f"payload.fail is true (attempt {job.attempt} of {job.max_attempts})")
    return {"ok": True, "attempt": job.attempt}


async def email(job: JobContext) -> dict[str, Any]:
    payload = _object(job)
    to = payload.get("to")
    if not isinstance(to, str) or not to:
        raise PermanentError("email jobs need payload.to, the address to send to")
    await asyncio.sleep(EMAIL_SECONDS)
    log.info("email sent to %s (simulated)", to, extra={"to": to})
    return {"sent": True, "to": to}


def prompt_tokens(prompt: str) -> int:
    """The usual estimate: a quarter of the characters, rounded up."""
    return max(1, math.ceil(len(prompt) / 4))


async def llm_inference(job: JobContext) -> dict[str, Any]:
    payload = _object(job)
    prompt = payload.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PermanentError("llm-inference jobs need payload.prompt, a non-empty string")
    max_tokens = payload.get("max_tokens", 64)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 100_000:
        raise PermanentError("payload.max_tokens must be an integer from 1 to 100000")
    completion = min(max_tokens, 16 + len(prompt) // 8)
    await asyncio.sleep(LLM_BASE_SECONDS + LLM_SECONDS_PER_TOKEN * completion)
    usage = {"prompt_tokens": prompt_tokens(prompt), "completion_tokens": completion}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    job.record_usage(usage["total_tokens"])
    words = prompt.split()
    return {
        "response": f"(simulated) {' '.join(words[:12])}",
        "model": str(payload.get("model", "simulated")),
        "usage": usage,
        "cost": 0.0,
        "cacheHit": False,
    }


def service_worker(
    queue: str = "jobs",
    *,
    prefix: str = DEFAULT_PREFIX,
    concurrency: int = 20,
    events_maxlen: int = EVENTS_MAXLEN,
    **options: Any,
) -> Worker:
    """A worker for the service's queue with the built-in job types registered.

    It keeps the events stream as long as the API does: a worker trimming to
    the engine's default (10,000) would cut events the transition sink has
    not read yet during a fast drain, and those jobs would reach the store
    only through the reconciler.
    """
    worker = Worker(queue, prefix=prefix, concurrency=concurrency, events_maxlen=events_maxlen, **options)
    worker.handler(name="generic")(generic)
    worker.handler(name="email")(email)
    worker.handler(name="send_email")(email)
    worker.handler(name="llm-inference")(llm_inference)
    return worker


#: ``sluice worker sluice.service.handlers:worker`` runs the built-in types on the queue "jobs".
worker = service_worker()
