"""``llm-inference`` jobs: a prompt in, an answer out, through the cache, under the budget.

The payload (JSON object; camelCase spellings are accepted where the NestJS
design used them)::

    prompt        the question (or ``messages``: [{"role", "content"}, ...], not both)
    system        optional system prompt (with ``prompt``)
    model         the model (default: SLUICE_LLM_MODEL / AI_MODEL, else the provider's)
    provider      optional; default SLUICE_LLM_PROVIDER / AI_PROVIDER (offline model if unset)
    max_tokens    output limit (maxTokens; default 256)
    temperature   optional, 0 to 2
    cache         true (default) / false / {"threshold": 0.95, "ttl_ms": 3600000}
    tenant        whose cache entries it may see (the API sets it to the caller's tenant)

The job's reservation (``JobSpec.tokens``) is :func:`reservation`: the
prompt counted as an upper bound plus ``max_tokens``, so the usage the
provider reports can never exceed it; the handler reports that usage
(``job.record_usage``), and a cache hit reports 0: it cost nothing.

The result (field names of the NestJS design's result)::

    {"response": "...", "model": "...", "provider": "...",
     "usage": {"prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens"},
     "cost": 0.000123, "cacheHit": false}            # and "similarity" on a hit
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from sluice import tracing
from sluice.engine.budgets import Budgets
from sluice.engine.hooks import Hook
from sluice.engine.queue import Queue
from sluice.errors import BudgetNotFound, ConfigurationError, PermanentError, Throttled
from sluice.llm.cache import CachePolicy, SemanticCache, cache_scope
from sluice.llm.inference_request import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TENANT,
    JOB_TYPE,
    MAX_MAX_TOKENS,
    CacheChoice,
    InferenceRequest,
    InvalidInference,
    configured,
    inference_job,
    parse_request,
    prepare_payload,
    prompt_bound,
    reservation,
)
from sluice.llm.pricing import to_micro_usd, worst_case_cost
from sluice.llm.provider import (
    Provider,
    ProviderRejected,
    ProviderUnavailable,
    complete_observed,
)
from sluice.probes import probe
from sluice.settings import environment

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.context import JobContext
    from sluice.engine.worker import Worker
    from sluice.llm.embedder import Embedder

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_TENANT",
    "JOB_TYPE",
    "MAX_MAX_TOKENS",
    "CacheChoice",
    "InferenceRequest",
    "InvalidInference",
    "LLMRuntime",
    "RuntimeFromEnv",
    "configured",
    "embedder_from_env",
    "handle",
    "inference_job",
    "parse_request",
    "prepare_payload",
    "register_inference",
    "reservation",
    "runtime_from_env",
]

log = logging.getLogger("sluice.llm")


class LLMRuntime:
    """What ``llm-inference`` handlers share in a process: the providers (built from the
    environment on first use, one per name), the default model, and the cache (when a
    store is configured)."""

    def __init__(
        self,
        provider: Provider,
        *,
        model: str,
        cache: SemanticCache | None = None,
        providers: Mapping[str, Provider] | None = None,
        env: Mapping[str, str] | None = None,
        redis: Redis | None = None,
    ) -> None:
        self.provider = provider
        self.model = model
        self.cache = cache
        #: where the jobs' queues live: money budgets are reserved there (``budget_usd``)
        self.redis = redis
        self._providers: dict[str, Provider] = {provider.name: provider, **(providers or {})}
        self._env = env
        #: closed by :meth:`aclose` after the providers and the cache
        self.closers: list[Callable[[], Awaitable[Any]]] = []

    def provider_named(self, name: str | None) -> Provider:
        """The configured provider, or another one a payload names, built from the environment
        with only its own key: the configured provider's address and model are never lent to
        another (they would carry its key to that address)."""
        if name is None or name == self.provider.name:
            return self.provider
        found = self._providers.get(name)
        if found is None:
            if name == "offline":
                raise PermanentError(
                    "payload.provider 'offline' is not this service's provider; leave it out"
                )
            from sluice.llm.providers import provider_for

            found = self._providers[name] = provider_for(name, self._env)
        return found

    async def run(
        self,
        request: InferenceRequest,
        *,
        idempotency_key: str | None = None,
        before_call: Callable[[Provider, str], Awaitable[None]] | None = None,
    ) -> dict[str, Any]:
        """Answer one request: through the cache when it may, else from the provider. The
        result carries ``cacheHit`` (and ``similarity`` on a hit). ``before_call`` runs right
        before the provider is called (not for a hit): where a money budget is reserved."""
        provider = self.provider_named(request.provider)
        model = request.model or (self.model if provider is self.provider else _default_model(provider))

        async def call() -> dict[str, Any]:
            if before_call is not None:
                await before_call(provider, model)
            answer = await complete_observed(
                provider,
                request.messages,
                model=model,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                idempotency_key=idempotency_key,
            )
            usage = answer.usage
            return {
                "response": answer.text,
                "model": answer.model,
                "provider": answer.provider,
                "usage": {
                    "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "cached_tokens": usage.cached_tokens,
                    "total_tokens": usage.total_tokens,
                    "reported": usage.reported,
                },
                "cost": answer.cost,
                "finishReason": answer.finish_reason,
            }

        if self.cache is None or not request.cache.enabled:
            probe().cache_lookup("bypass")
            return {**await call(), "cacheHit": False}
        overrides: dict[str, Any] = {}
        if request.cache.threshold is not None:
            overrides["threshold"] = request.cache.threshold
        if request.cache.ttl_ms is not None:
            overrides["ttl_ms"] = request.cache.ttl_ms
        policy = CachePolicy(**{**_policy_fields(self.cache.policy), **overrides}) if overrides else None
        scope = cache_scope(
            provider.name,
            model,
            context=request.messages[:-1],
            params={"max_tokens": request.max_tokens, "temperature": request.temperature},
        )
        try:
            response, hit = await self.cache.through(
                request.tenant, scope, request.messages[-1]["content"], call, policy=policy
            )
        except Exception:
            probe().cache_lookup("miss")  # a hit raises nothing: the call behind a miss failed
            raise
        probe().cache_lookup("miss" if hit is None else "exact_hit" if hit.exact else "semantic_hit")
        if hit is None:
            return {**response, "cacheHit": False}
        # This job spent nothing: its usage and cost are zero; what the answer cost when it was
        # made (and so what this hit saved) is kept apart.
        return {
            **response,
            "usage": {
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "cached_tokens": 0,
                "total_tokens": 0,
                "reported": True,
            },
            "cost": 0.0,
            "cacheHit": True,
            "similarity": round(hit.similarity, 4),
            "cached": {"usage": response.get("usage"), "cost": response.get("cost"), "prompt": hit.prompt},
        }

    async def aclose(self) -> None:
        """Close the providers, the cache, and what the runtime was handed to close (the
        database and Redis clients :func:`runtime_from_env` made)."""
        for provider in self._providers.values():
            await provider.aclose()
        if self.cache is not None:
            await self.cache.aclose()
        for close in self.closers:
            await close()


def _policy_fields(policy: CachePolicy) -> dict[str, Any]:
    return {name: getattr(policy, name) for name in policy.__dataclass_fields__}


def _default_model(provider: Provider) -> str:
    return str(getattr(provider, "default_model", None) or "default")


def _span_names(runtime: LLMRuntime, request: InferenceRequest) -> tuple[str, str]:
    """The provider and model a request asks for, by name (its trace span's)."""
    provider = request.provider or runtime.provider.name
    return provider, request.model or (runtime.model if provider == runtime.provider.name else "default")


async def handle(runtime: LLMRuntime, job: JobContext) -> dict[str, Any]:
    """The ``llm-inference`` handler body, given the process's runtime.

    What the budgets are charged, by outcome: the usage the provider reported; 0 for a cache
    hit; nothing for a call the provider refused (429, a rejected request) or answered with a
    5xx (it billed nothing); the whole reservation, kept, when the outcome is unknown (a
    timeout, a broken connection, an answer with no usage): the provider may have billed it.
    """
    request = parse_request(job.payload)
    money: list[tuple[Budgets, str, int]] = []

    async def reserve(provider: Provider, model: str) -> None:
        if request.budget_usd is not None:
            money.append(await _reserve_money(runtime, job, request, provider, model))

    try:
        with tracing.llm_call(*_span_names(runtime, request), max_tokens=request.max_tokens) as traced:
            result = await runtime.run(request, idempotency_key=job.idempotency_key, before_call=reserve)
            traced.record(result)
    except Throttled:
        await _refund(money)  # the engine refunds the tokens of a throttled attempt itself
        raise
    except ProviderRejected:
        job.record_usage(0)
        await _refund(money)
        raise
    except ProviderUnavailable as exc:
        if exc.status is not None:  # answered 5xx: nothing billed
            job.record_usage(0)
            await _refund(money)
        raise  # no answer: unknown, the reservations stay charged (money lapses as unknown)
    except ConfigurationError as exc:  # a provider named but not configured here: retrying cannot help
        job.record_usage(0)
        raise PermanentError(str(exc)) from None
    usage = result.get("usage") or {}
    reported = result["cacheHit"] or usage.get("reported", True)
    if reported:
        job.record_usage(0 if result["cacheHit"] else int(usage.get("total_tokens", 0)))
    for budgets, reservation_id, reserved in money:
        cost = result.get("cost")
        spent = to_micro_usd(cost) if reported and cost is not None else reserved
        try:
            await budgets.commit(reservation_id, spent)
        except Exception:  # the answer stands; the hold lapses as an unknown outcome, charged
            log.warning("llm-inference: settling the money budget failed", exc_info=True)
    return result


async def _refund(money: list[tuple[Budgets, str, int]]) -> None:
    for budgets, reservation_id, _ in money:
        try:
            await budgets.refund(reservation_id)
        except Exception:
            log.warning("llm-inference: refunding the money budget failed", exc_info=True)


#: How long a money reservation is held before an unsettled one counts as an unknown outcome.
MONEY_HOLD_SECONDS = 900.0


async def _reserve_money(
    runtime: LLMRuntime, job: JobContext, request: InferenceRequest, provider: Provider, model: str
) -> tuple[Budgets, str, int]:
    """Reserve the call's worst case, in micro-dollars, from ``budget_usd`` (and every budget above
    it), before the provider is called: a money budget, like a token budget, stops admitting
    before its limit is passed. The price is the model's list price (``SLUICE_PRICING_FILE``)."""
    assert request.budget_usd is not None
    if runtime.redis is None:
        raise PermanentError("payload.budget_usd needs the worker's Redis (SLUICE_REDIS_URL) to reserve from")
    prompt = prompt_bound(request.messages, provider.name, model)
    worst = worst_case_cost(provider.name, model, prompt, request.max_tokens)
    if worst is None:
        raise PermanentError(
            f"{provider.name}/{model} has no price, so a budget in money cannot be charged for it: "
            "add its price with SLUICE_PRICING_FILE, or use a token budget"
        )
    budgets = Queue(job.queue, redis=runtime.redis, prefix=job.prefix).budgets
    reservation_id = f"{job.reservation_id}:usd"
    try:
        answer = await budgets.reserve(
            request.budget_usd, to_micro_usd(worst), reservation_id, job_id=job.id, hold=MONEY_HOLD_SECONDS
        )
    except BudgetNotFound as exc:
        raise PermanentError(f"payload.budget_usd: {exc}") from None
    if not answer.accepted:
        raise PermanentError(
            f"budget {answer.refused_by or request.budget_usd!r} cannot admit this call's worst case, "
            f"${worst:.6f} ({to_micro_usd(worst):,} micro-dollars): credit it or raise its limit"
        )
    return budgets, reservation_id, to_micro_usd(worst)


def runtime_from_env(env: Mapping[str, str] | None = None) -> LLMRuntime:
    """A runtime built from the environment: the provider (``SLUICE_LLM_PROVIDER``/
    ``AI_PROVIDER``; the offline model when neither is set), the model, and the cache when
    ``SLUICE_DATABASE_URL`` names the store (``SLUICE_CACHE=off`` turns it off;
    ``SLUICE_REDIS_URL`` makes its single flight hold across processes). Its connections
    belong to the event loop that uses them first: :class:`RuntimeFromEnv` keeps one per run."""
    env = environment() if env is None else env
    provider: Provider
    if env.get("SLUICE_LLM_PROVIDER") or env.get("AI_PROVIDER"):
        from sluice.llm.providers import provider_from_env

        provider = provider_from_env(env)
        model = env.get("SLUICE_LLM_MODEL") or env.get("AI_MODEL") or _default_model(provider)
    else:
        from sluice.llm.offline import OfflineProvider

        provider, model = OfflineProvider(), env.get("SLUICE_LLM_MODEL") or env.get("AI_MODEL") or "offline"
    from redis.asyncio import Redis

    redis_url = env.get("SLUICE_REDIS_URL")
    redis = Redis.from_url(redis_url) if redis_url else None
    cache = None
    database_url = env.get("SLUICE_DATABASE_URL")
    db = None
    if database_url and env.get("SLUICE_CACHE", "on").lower() not in ("off", "0", "false", "no"):
        from sluice.store.database import Database

        db = Database(database_url, pool_size=4)
        cache = SemanticCache(
            db,
            embedder_from_env(provider, env),
            policy=CachePolicy.from_env(env),
            redis=redis,
            prefix=env.get("SLUICE_PREFIX", "sluice"),
        )
    runtime = LLMRuntime(provider, model=model, cache=cache, env=env, redis=redis)
    if db is not None:
        runtime.closers.append(db.close)
    if redis is not None:
        runtime.closers.append(redis.aclose)
    return runtime


#: The key of a worker's state that holds its llm-inference runtime, once built.
RUNTIME_STATE = "sluice.llm.runtime"


class RuntimeFromEnv(Hook):
    """A worker's llm-inference runtime (:func:`runtime_from_env`), kept in the worker's
    state: built on the run's first such job, so a worker that never runs one never reads
    the provider's settings, and closed when the run shuts down. A module global would be
    shared by every worker of the process, and outlive the event loop its connections
    belong to."""

    def __init__(self, state: dict[str, Any], env: Mapping[str, str] | None = None) -> None:
        self._state = state
        self._env = env
        #: the handler to register (one object, so that registering it again is no conflict)
        self.handler: Callable[[JobContext], Awaitable[dict[str, Any]]] = self.llm_inference

    async def shutdown(self, state: dict[str, Any]) -> None:
        runtime = state.pop(RUNTIME_STATE, None)
        if runtime is not None:
            await runtime.aclose()

    async def llm_inference(self, job: JobContext) -> dict[str, Any]:
        """The built-in ``llm-inference`` handler."""
        runtime = self._state.get(RUNTIME_STATE)
        if runtime is None:  # built at once (no await): concurrent first jobs share it
            runtime = self._state[RUNTIME_STATE] = runtime_from_env(self._env)
        return await handle(runtime, job)


#: The embedding model each provider's embedder uses unless SLUICE_CACHE_EMBEDDING_MODEL names one.
EMBEDDING_MODELS = {"openai": "text-embedding-3-small", "gemini": "text-embedding-004"}


def embedder_from_env(provider: Provider, env: Mapping[str, str]) -> Embedder:
    """``SLUICE_CACHE_EMBEDDER``: ``local`` (the default: all-MiniLM-L6-v2 on this machine, no
    call, no cost) or ``provider`` (the provider's embeddings endpoint, asked for the cache's
    384 dimensions; ``SLUICE_CACHE_EMBEDDING_MODEL`` names the model)."""
    from sluice.llm.embedder import LocalEmbedder, ProviderEmbedder
    from sluice.store.schema import CACHE_DIMENSIONS

    kind = env.get("SLUICE_CACHE_EMBEDDER", "local").strip().lower() or "local"
    if kind == "local":
        return LocalEmbedder()
    if kind != "provider":
        raise ConfigurationError(f"SLUICE_CACHE_EMBEDDER={kind!r}: use local or provider")
    model = env.get("SLUICE_CACHE_EMBEDDING_MODEL") or EMBEDDING_MODELS.get(provider.name)
    if not model:
        raise ConfigurationError(
            f"SLUICE_CACHE_EMBEDDER=provider: {provider.name} has no default embedding model; "
            "set SLUICE_CACHE_EMBEDDING_MODEL (one that can return 384 dimensions), or use local"
        )
    return ProviderEmbedder(provider, model, CACHE_DIMENSIONS)


def register_inference(worker: Worker, runtime: LLMRuntime | None = None) -> None:
    """Register ``llm-inference`` on ``worker``: with ``runtime`` (tests, embedding programs), or
    the one the worker's :class:`RuntimeFromEnv` hook builds."""
    if runtime is None:
        hook = next((h for h in worker.hooks if isinstance(h, RuntimeFromEnv)), None)
        if hook is None:
            hook = RuntimeFromEnv(worker.state)
            worker.add_hook(hook)
        worker.handler(name=JOB_TYPE)(hook.handler)
        return
    fixed = runtime

    async def llm_inference_with(job: JobContext) -> dict[str, Any]:
        return await handle(fixed, job)

    worker.handler(name=JOB_TYPE)(llm_inference_with)
