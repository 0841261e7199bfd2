"""The goodput benchmark's worker: one provider call per job, three ways of staying under the limits.

Started as ``sluice worker sluice_lab.goodput_worker:worker``; the
benchmark passes the provider's base URL, the Redis URL and a hash key in
the environment (and, for ``call_client_limited``, the process's share of
the limits). The job's name picks the variant, so one worker serves all:

* ``call_limited``: the queue holds the provider's limits; a 429 (which the
  limits should make rare) raises :class:`sluice.Throttled` with the
  provider's ``retry-after-ms``, which pauses the whole queue and puts the
  job back uncounted; a success reports its usage to the token window.
* ``call_retry``: no limits; a 429 is an ordinary failure, retried with the
  job's backoff like any other error (the usual retry-on-429 client).
* ``call_client_limited``: no limits in the queue; each process waits in its
  own aiolimiter buckets for its share of the provider's limits
  (:mod:`sluice_lab.goodput_limiter`) before it calls, and a 429 is retried
  with the job's backoff as ``call_retry``'s is.

The call goes through Sluice's own OpenAI-compatible provider
(:class:`sluice.llm.openai.OpenAIProvider`, one per process, its 429s read
from the provider's headers), or, with ``SLUICE_GOODPUT_CLIENT=raw``, through
a bare httpx client per call in flight (the figure of the queue alone).

``warm_up`` jobs, run first, open the connections (see :func:`warm_up`).
A job that gets its answer counts itself (``HINCRBY <runs key> <job id> 1``),
so a lost or twice-run job shows whatever the engine's counters say.
Calls and 429s are counted by the provider, which is what one pays for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from sluice import Throttled
from sluice.engine.connection import connect
from sluice.engine.context import JobContext
from sluice.engine.worker import Worker
from sluice.llm.limit_headers import rate_limits, transit_ms
from sluice.settings import (
    ENV_GOODPUT_CLIENT,
    ENV_GOODPUT_CLIENT_LIMITS,
    ENV_GOODPUT_PROVIDER,
    ENV_GOODPUT_REDIS,
    ENV_GOODPUT_RUNS_KEY,
)
from sluice.testing.provider import COMPLETIONS_PATH, REQUEST_ID_HEADER
from sluice.testing.simulated_model import count_prompt_tokens
from sluice.testing.simulated_server import STATS_PATH
from sluice_lab.goodput_limiter import ClientLimiter, ClientLimits

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.llm.openai import OpenAIProvider

ENV_PROVIDER = ENV_GOODPUT_PROVIDER
ENV_REDIS = ENV_GOODPUT_REDIS
ENV_RUNS_KEY = ENV_GOODPUT_RUNS_KEY
ENV_CLIENT = ENV_GOODPUT_CLIENT
ENV_CLIENT_LIMITS = ENV_GOODPUT_CLIENT_LIMITS
#: how calls are made: Sluice's provider (the default) or a bare httpx client
CLIENTS = ("provider", "raw")
#: After the runs key: job id -> Unix time its answered call left the client-side limiter.
SENT_SUFFIX = ":sent"
MODEL = "simulated"

#: The benchmark passes --queue and --concurrency; these are only defaults.
worker = Worker("bench-goodput", concurrency=32, shutdown_grace=5.0)


class ProviderRateLimited(Exception):
    """The provider answered 429: an ordinary error, retried with the job's backoff."""


class _Clients:
    """Per event loop: one Redis client, and HTTP clients lent one per call in flight.

    One shared httpx client serves dozens of concurrent calls badly: its
    connection pool costs more CPU per call than a client per call in flight,
    and that queueing showed as dispatch-to-arrival jitter. So each call
    borrows a client (with its one kept-alive connection) and gives it back.
    """

    def __init__(self) -> None:
        self._redis: dict[int, Redis] = {}
        self._idle: dict[int, list[httpx.AsyncClient]] = {}
        self._providers: dict[int, OpenAIProvider] = {}
        self._limiters: dict[int, ClientLimiter] = {}

    def provider(self) -> OpenAIProvider:
        from sluice.llm.openai import OpenAIProvider

        loop_id = id(asyncio.get_running_loop())
        found = self._providers.get(loop_id)
        if found is None:
            base = os.environ[ENV_PROVIDER] + "/v1"
            found = self._providers[loop_id] = OpenAIProvider(
                base_url=base, api_key_env=None, name="simulated"
            )
        return found

    def limiter(self) -> ClientLimiter:
        """This process's buckets (one pair per event loop: aiolimiter binds to its loop)."""
        loop_id = id(asyncio.get_running_loop())
        found = self._limiters.get(loop_id)
        if found is None:
            found = self._limiters[loop_id] = ClientLimiter(
                ClientLimits.from_json(os.environ[ENV_CLIENT_LIMITS])
            )
        return found

    def redis(self) -> Redis:
        loop_id = id(asyncio.get_running_loop())
        client = self._redis.get(loop_id)
        if client is None:
            client = self._redis[loop_id] = connect(os.environ[ENV_REDIS])
        return client

    @contextlib.asynccontextmanager
    async def http(self) -> AsyncIterator[httpx.AsyncClient]:
        idle = self._idle.setdefault(id(asyncio.get_running_loop()), [])
        client = idle.pop() if idle else httpx.AsyncClient(base_url=os.environ[ENV_PROVIDER], timeout=60.0)
        try:
            yield client
        finally:
            idle.append(client)


_clients = _Clients()


async def _call(job: JobContext) -> httpx.Response:
    payload: dict[str, Any] = job.payload
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": payload["prompt"]}],
        "max_tokens": payload["max_tokens"],
    }
    async with _clients.http() as http:
        job.note_sent()  # the queue's measured headroom (Sluice's providers do this themselves)
        sent = time.monotonic()
        # The job id lets the benchmark match the provider's arrival time with the job's dispatch.
        reply = await http.post(COMPLETIONS_PATH, json=body, headers={REQUEST_ID_HEADER: job.id})
    if reply.is_success:  # what Sluice's providers pass on to the queue, done by hand here
        limits = rate_limits(reply.headers)
        job.note_provider_limits(
            limit_requests=limits.limit_requests,
            remaining_requests=limits.remaining_requests,
            limit_tokens=limits.limit_tokens,
            remaining_tokens=limits.remaining_tokens,
            transit_ms=transit_ms(reply.headers, (time.monotonic() - sent) * 1000),
        )
    return reply


def _through_provider() -> bool:
    return os.environ.get(ENV_CLIENT, "provider") == "provider"


async def _provider_call(job: JobContext) -> int:
    """The call through OpenAIProvider: its 429 is a ProviderThrottled (a Throttled) with the wait
    the provider's headers gave; the job id goes as X-Client-Request-Id (arrival matching)."""
    payload: dict[str, Any] = job.payload
    answer = await _clients.provider().complete(
        [{"role": "user", "content": payload["prompt"]}],
        model=MODEL,
        max_tokens=payload["max_tokens"],
        idempotency_key=job.id,
    )
    await _clients.redis().hincrby(os.environ[ENV_RUNS_KEY], job.id, 1)
    return answer.usage.total_tokens


async def _answered(job: JobContext, reply: httpx.Response) -> int:
    """Check the answer, count this run of the job, return the tokens it used."""
    reply.raise_for_status()
    total = int(reply.json()["usage"]["total_tokens"])
    await _clients.redis().hincrby(os.environ[ENV_RUNS_KEY], job.id, 1)
    return total


@worker.handler
async def warm_up(job: JobContext) -> None:
    """Open one connection to the provider (GET /stats costs nothing against its limits).

    The benchmark runs one per slot before the workload, so the calls start
    from warm clients and open connections, as in a long-running worker: the
    first call of a cold process spends tens of milliseconds building its
    client, which would show as dispatch-to-arrival jitter.
    """
    if _through_provider():
        # Built before the workload, and its own connection pool opened, as a long-running
        # worker's are (the GET below warms the provider's client, not only ours).
        http_client = _clients.provider()._client  # (private: the lab's warm-up only)
        stats = os.environ[ENV_PROVIDER] + STATS_PATH
        (await http_client.get(stats)).raise_for_status()
        await asyncio.sleep(0.05)  # held, so that concurrent warm-ups open distinct connections
        return
    async with _clients.http() as http:
        (await http.get(STATS_PATH)).raise_for_status()
        # Holding the client a moment makes concurrent warm-ups build distinct clients.
        await asyncio.sleep(0.05)


@worker.handler
async def call_limited(job: JobContext) -> int:
    """One call under the queue's limits: a 429 pauses the queue for as long as the provider says."""
    if _through_provider():
        total = await _provider_call(job)  # a 429 raises ProviderThrottled: the queue pauses
        job.record_usage(total)
        return total
    reply = await _call(job)
    if reply.status_code == 429:
        raise Throttled(retry_after=int(reply.headers["retry-after-ms"]) / 1000)
    total = await _answered(job, reply)
    job.record_usage(total)
    return total


@worker.handler
async def call_retry(job: JobContext) -> int:
    """One call with no limits: a 429 fails the attempt, and the job's backoff decides when to retry."""
    return await _call_retrying(job)


@worker.handler
async def call_client_limited(job: JobContext) -> int:
    """One call once this process's aiolimiter buckets allow it; a 429 is retried as call_retry's.

    The cost is what the provider's token limit counts, ``prompt + max_tokens``,
    with the provider's own token count (as a client would use its tokenizer).
    """
    payload: dict[str, Any] = job.payload
    cost = count_prompt_tokens([{"role": "user", "content": payload["prompt"]}]) + payload["max_tokens"]
    await _clients.limiter().acquire(cost)
    # The call's dispatch is here, not at the job's start: the benchmark measures from it to arrival.
    released = time.time()
    total = await _call_retrying(job)
    await _clients.redis().hset(os.environ[ENV_RUNS_KEY] + SENT_SUFFIX, job.id, released)
    return total


async def _call_retrying(job: JobContext) -> int:
    """The call; a 429 raises ProviderRateLimited, an ordinary error the job's backoff retries."""
    if _through_provider():
        from sluice.llm.provider import ProviderThrottled

        try:
            return await _provider_call(job)
        except ProviderThrottled as exc:
            raise ProviderRateLimited(f"429 from the provider, retry after {exc.retry_after:g} s") from None
    reply = await _call(job)
    if reply.status_code == 429:
        raise ProviderRateLimited(
            f"429 from the provider, retry-after-ms {reply.headers.get('retry-after-ms')}"
        )
    return await _answered(job, reply)
