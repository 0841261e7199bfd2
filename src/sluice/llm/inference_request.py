"""What an ``llm-inference`` job asks: its payload checked, and the tokens it reserves.

The producer side of :mod:`sluice.llm.inference` (the API, ``inference_job``
in Python): it parses and counts without a provider, a cache or a worker.
The payload's fields are listed in :mod:`sluice.llm.inference`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.engine.job import JobSpec
from sluice.errors import MissingExtra, PermanentError
from sluice.llm.provider import Message
from sluice.llm.tokens import count_prompt_tokens, estimate_prompt_tokens
from sluice.settings import environment

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
    return prompt_bound(request.messages, provider, model) + request.max_tokens


def prompt_bound(messages: list[Message], provider: str, model: str) -> int:
    """The prompt's tokens as an upper bound: exact for OpenAI models when tiktoken is installed
    (the ``llm`` extra), else the estimate, which is a bound for every tokenizer."""
    try:
        return count_prompt_tokens(messages, provider=provider, model=model)
    except MissingExtra:
        return estimate_prompt_tokens(messages)
