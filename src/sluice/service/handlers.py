"""The job types the service runs out of the box, and the worker that runs them.

``generic`` (any object payload; ``payload.fail = true`` fails the attempt,
for trying retries and the dead-letter queue), ``email`` (simulated: about a
second, and a log line naming ``payload.to``; ``send_email`` is the same) and
``llm-inference`` (``payload.prompt`` or ``messages``; the provider named by
``SLUICE_LLM_PROVIDER``/``AI_PROVIDER``, else an offline stand-in model, through the
semantic cache: :mod:`sluice.llm.inference`). Teams add their own handlers to
the same worker: ``worker = service_worker(); @worker.handler ...``, then
``sluice worker app:worker``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sluice.engine.context import JobContext
from sluice.engine.worker import Worker
from sluice.errors import PermanentError
from sluice.llm.analysis import ProviderSource, register_analysis
from sluice.llm.inference import LLMRuntime, register_inference
from sluice.service.config import EVENTS_MAXLEN
from sluice.settings import DEFAULT_PREFIX

log = logging.getLogger("sluice.jobs")

#: Seconds the simulated email takes.
EMAIL_SECONDS = 1.0


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


def service_worker(
    queue: str = "jobs",
    *,
    prefix: str = DEFAULT_PREFIX,
    concurrency: int = 20,
    events_maxlen: int = EVENTS_MAXLEN,
    llm: LLMRuntime | None = None,
    analysis: ProviderSource = None,
    **options: Any,
) -> Worker:
    """A worker for the service's queue with the built-in job types registered.

    It keeps the events stream as long as the API does: a worker trimming to
    the engine's default (10,000) would cut events the transition sink has
    not read yet during a fast drain, and those jobs would reach the store
    only through the reconciler. ``llm``: the providers and cache ``llm-inference`` jobs
    use (default: built from the environment on the first such job); ``analysis``: the provider
    ``failure-analysis`` jobs ask (default: the environment's, built for each job).
    """
    worker = Worker(queue, prefix=prefix, concurrency=concurrency, events_maxlen=events_maxlen, **options)
    worker.handler(name="generic")(generic)
    worker.handler(name="email")(email)
    worker.handler(name="send_email")(email)
    register_inference(worker, llm)
    register_analysis(worker, provider=analysis)
    return worker


#: ``sluice worker sluice.service.handlers:worker`` runs the built-in types on the queue "jobs".
worker = service_worker()
