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

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice import tracing
from sluice.engine.budgets import Budgets
from sluice.engine.job import JobSpec
from sluice.engine.queue import Queue
from sluice.errors import BudgetNotFound, ConfigurationError, MissingExtra, PermanentError, Throttled
from sluice.llm.cache import CachePolicy, SemanticCache, cache_scope
from sluice.llm.pricing import to_micro_usd, worst_case_cost
from sluice.llm.provider import (
    Message,
    Provider,
    ProviderRejected,
    ProviderUnavailable,
    complete_observed,
)
from sluice.llm.tokens import count_prompt_tokens, estimate_prompt_tokens
from sluice.probes import probe
from sluice.settings import environment

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.context import JobContext
    from sluice.engine.worker import Worker
    from sluice.llm.embedder import Embedder

log = logging.getLogger("sluice.llm")

JOB_TYPE = "llm-inference"
DEFAULT_MAX_TOKENS = 256
MAX_MAX_TOKENS = 100_000
DEFAULT_TENANT = "default"
_ROLES = ("system", "user", "assistant")


class InvalidInference(PermanentError, ValueError):
    """An llm-inference payload that cannot be run (retrying it cannot help)."""


@dataclass(frozen=True, slots=True)
class CacheChoice:
    enabled: bool = True
    threshold: float | None = None
    ttl_ms: int | None = None


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """A checked payload."""

    messages: list[Message]
    model: str | None
    provider: str | None
    max_tokens: int
    temperature: float | None
    cache: CacheChoice
    tenant: str
    #: a budget in micro-dollars the call's cost is reserved from and charged to (None: none)
    budget_usd: str | None = None


def _field(payload: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if name in payload:
            return payload[name]
    return None


def parse_request(payload: Any) -> InferenceRequest:
    """The payload checked, or :class:`InvalidInference` naming the field and what it needs."""
    if not isinstance(payload, Mapping):
        raise InvalidInference(f"llm-inference jobs need an object payload, got {type(payload).__name__}")
    max_tokens = _field(payload, "max_tokens", "maxTokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= MAX_MAX_TOKENS
    ):
        raise InvalidInference(f"payload.max_tokens must be an integer from 1 to {MAX_MAX_TOKENS}")
    temperature = payload.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not (math.isfinite(temperature) and 0 <= temperature <= 2)
    ):
        raise InvalidInference("payload.temperature must be a number from 0 to 2")
    model, provider, tenant, budget_usd = (
        _name(payload, "model"),
        _name(payload, "provider"),
        _name(payload, "tenant") or DEFAULT_TENANT,
        _name(payload, "budget_usd", "budgetUsd"),
    )
    if provider is not None:
        from sluice.llm.providers import KNOWN_PROVIDERS

        provider = provider.lower()
        if provider not in KNOWN_PROVIDERS and provider != "offline":
            known = ", ".join(sorted(KNOWN_PROVIDERS))
            raise InvalidInference(f"payload.provider {provider!r} is not a provider Sluice knows: {known}")
    return InferenceRequest(
        _chat(payload),
        model,
        provider,
        max_tokens,
        float(temperature) if temperature is not None else None,
        _cache_choice(payload.get("cache", True)),
        tenant,
        budget_usd,
    )


def _name(payload: Mapping[str, Any], *names: str) -> str | None:
    """A field that, when given, is a non-empty string."""
    value = _field(payload, *names)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise InvalidInference(f"payload.{names[0]} must be a non-empty string")
    return value


def _chat(payload: Mapping[str, Any]) -> list[Message]:
    prompt, messages = payload.get("prompt"), payload.get("messages")
    if prompt is not None and messages is not None:
        raise InvalidInference("give payload.prompt or payload.messages, not both")
    if messages is not None:
        return _messages(messages)
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidInference("llm-inference jobs need payload.prompt, a non-empty string (or messages)")
    system = payload.get("system")
    if system is not None and not isinstance(system, str):
        raise InvalidInference("payload.system must be a string")
    chat: list[Message] = [{"role": "system", "content": system}] if system else []
    chat.append({"role": "user", "content": prompt})
    return chat


def _messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise InvalidInference("payload.messages must be a non-empty list of {role, content}")
    out: list[Message] = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise InvalidInference(
                f"payload.messages[{i}] must be {{'role': one of {', '.join(_ROLES)}, 'content': a string}}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise InvalidInference("the last of payload.messages must be the user's")
    return out


def _cache_choice(raw: Any) -> CacheChoice:
    if isinstance(raw, bool):
        return CacheChoice(enabled=raw)
    if not isinstance(raw, Mapping):
        raise InvalidInference('payload.cache must be true, false or {"threshold": 0.92, "ttl_ms": 86400000}')
    enabled = raw.get("enabled", True)
    threshold = raw.get("threshold")
    ttl = _field(raw, "ttl_ms", "ttlMs")
    if not isinstance(enabled, bool):
        raise InvalidInference("payload.cache.enabled must be true or false")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1
    ):
        raise InvalidInference("payload.cache.threshold must be a number in (0, 1]")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise InvalidInference("payload.cache.ttl_ms must be a whole number of ms >= 1")
    return CacheChoice(enabled, float(threshold) if threshold is not None else None, ttl)


def configured(env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The provider and model jobs run with by default, as the environment names them, without
    building the provider (the API counts reservations with it, and holds no provider key)."""
    env = environment() if env is None else env
    provider = (env.get("SLUICE_LLM_PROVIDER") or env.get("AI_PROVIDER") or "offline").lower()
    return provider, env.get("SLUICE_LLM_MODEL") or env.get("AI_MODEL") or None


def prepare_payload(
    payload: Any, tenant: str, tokens: int, env: Mapping[str, str] | None = None
) -> tuple[Any, int]:
    """An llm-inference job as the service accepts it: the payload checked, its ``tenant`` set to
    the caller's (the cache partition it may read), and the reservation raised to what the
    prompt and ``max_tokens`` can cost. Raises :class:`InvalidInference`."""
    request = parse_request(payload)
    if "tenant" in payload and payload["tenant"] != tenant:
        raise InvalidInference("payload.tenant is set by the service to your key's tenant: leave it out")
    provider, model = configured(env)
    if request.provider == "offline" and provider != "offline":
        raise InvalidInference(f"payload.provider 'offline' is not this service's provider ({provider})")
    need = reservation(request, provider=request.provider or provider, model=request.model or model or "")
    return {**payload, "tenant": tenant}, max(tokens, need)


def inference_job(
    prompt: str | None = None,
    *,
    messages: list[Message] | None = None,
    system: str | None = None,
    model: str | None = None,
    provider: str | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float | None = None,
    cache: bool | Mapping[str, Any] = True,
    tenant: str = DEFAULT_TENANT,
    budget: str | None = None,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> JobSpec:
    """An ``llm-inference`` job for :meth:`Queue.add`, its reservation counted: what the API
    does for a submission, for producers in Python. ``options`` go to :class:`JobSpec`
    (priority, max_attempts, idempotency_key...). Raises :class:`InvalidInference`."""
    payload: dict[str, Any] = {"max_tokens": max_tokens, "cache": cache, "tenant": tenant}
    for name, value in (
        ("prompt", prompt),
        ("messages", messages),
        ("system", system),
        ("model", model),
        ("provider", provider),
        ("temperature", temperature),
    ):
        if value is not None:
            payload[name] = value
    request = parse_request(payload)
    default_provider, default_model = configured(env)
    tokens = reservation(
        request, provider=request.provider or default_provider, model=request.model or default_model or ""
    )
    return JobSpec(JOB_TYPE, payload, tokens=tokens, budget=budget, **options)


def reservation(request: InferenceRequest, *, provider: str, model: str) -> int:
    """Tokens to reserve for the job: the prompt's upper bound plus ``max_tokens``."""
    return _prompt_bound(request.messages, provider, model) + request.max_tokens


def _prompt_bound(messages: list[Message], provider: str, model: str) -> int:
    """The prompt's tokens as an upper bound: exact for OpenAI models when tiktoken is installed
    (the ``llm`` extra), else the estimate, which is a bound for every tokenizer."""
    try:
        return count_prompt_tokens(messages, provider=provider, model=model)
    except MissingExtra:
        return estimate_prompt_tokens(messages)


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
    prompt = _prompt_bound(request.messages, provider.name, model)
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


#: per event loop: a runtime's connections belong to the loop that made them (entries of closed
#: loops are dropped when the next runtime is built)
_runtimes: dict[asyncio.AbstractEventLoop, LLMRuntime] = {}


async def runtime_from_env(env: Mapping[str, str] | None = None) -> LLMRuntime:
    """The process's runtime, built once per event loop from the environment: the provider
    (``SLUICE_LLM_PROVIDER``/``AI_PROVIDER``; the offline model when neither is set), the model,
    and the cache when ``SLUICE_DATABASE_URL`` names the store (``SLUICE_CACHE=off`` turns it
    off; ``SLUICE_REDIS_URL`` makes its single flight hold across processes)."""
    loop = asyncio.get_running_loop()
    found = _runtimes.get(loop)
    if found is not None:
        return found
    for stale in [old for old in _runtimes if old.is_closed()]:
        del _runtimes[stale]
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
    runtime = _runtimes[loop] = LLMRuntime(provider, model=model, cache=cache, env=env, redis=redis)
    if db is not None:
        runtime.closers.append(db.close)
    if redis is not None:
        runtime.closers.append(redis.aclose)
    return runtime


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


async def llm_inference(job: JobContext) -> dict[str, Any]:
    """The built-in ``llm-inference`` handler (the runtime from the environment)."""
    return await handle(await runtime_from_env(), job)


def register_inference(worker: Worker, runtime: LLMRuntime | None = None) -> None:
    """Register ``llm-inference`` on ``worker``: with ``runtime`` (tests, embedding programs), or
    the one :func:`runtime_from_env` builds."""
    if runtime is None:
        worker.handler(name=JOB_TYPE)(llm_inference)
        return
    fixed = runtime

    async def llm_inference_with(job: JobContext) -> dict[str, Any]:
        return await handle(fixed, job)

    worker.handler(name=JOB_TYPE)(llm_inference_with)
