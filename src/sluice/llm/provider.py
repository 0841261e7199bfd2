"""What every LLM provider is to the rest of Sluice: two calls, and what they cost.

A provider answers ``complete`` (a chat completion) and ``embed`` (vectors
for texts). Every answer carries the usage the provider reported and its
cost, so that the handler can charge the budget what was really spent.
Failures come out as three kinds, because a queue must do three different
things with them:

* :class:`ProviderThrottled` (a 429, or a quota error): the engine's
  :class:`~sluice.errors.Throttled`, so raising it from a handler pauses the
  queue for ``retry_after`` and returns the job to waiting without counting
  a failure;
* :class:`ProviderUnavailable` (a 5xx, a timeout, a broken connection): an
  ordinary exception, retried with the job's backoff;
* :class:`ProviderRejected` (a 4xx the request itself caused: a bad key, an
  unknown model, a malformed request): a
  :class:`~sluice.errors.PermanentError`, so the job is dead-lettered at once
  instead of retried ten times into the same answer.

Provider keys are read from the environment by the provider's constructor
and are never part of an error message, a log line or a repr.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypedDict, runtime_checkable

from sluice.errors import PermanentError, SluiceError, Throttled
from sluice.probes import probe

Role = Literal["system", "user", "assistant"]


class Message(TypedDict):
    """One chat message, as OpenAI's protocol spells it (the others are translated)."""

    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens an answer used, as the provider reported them. ``cached_tokens`` is the part of
    ``prompt_tokens`` served from the provider's prompt cache (billed at the cached price).

    ``cache_write_tokens`` is the part written to the cache, billed at the cache-write price.
    ``reported`` is False when the answer carried no usage at all (a proxy or server that
    leaves it out): the zeros are then unknown, not free, and whoever charges a budget keeps
    the reservation rather than refund it.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reported: bool = True
    #: the part of ``prompt_tokens`` written to the provider's prompt cache (Anthropic bills it
    #: above the input price)
    cache_write_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class RateLimits:
    """What the provider said about its limits in an answer's headers (None: not said).

    ``reset_*`` are seconds from the answer until that window is full again.
    """

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A chat completion: the text, the usage reported, and its cost in US dollars (None: the
    model has no price in the pricing table)."""

    text: str
    model: str
    provider: str
    usage: Usage
    cost: float | None = None
    finish_reason: str | None = None
    #: the provider's id of the answer (for support tickets), if it gave one
    response_id: str | None = None
    limits: RateLimits = field(default_factory=RateLimits)


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One vector per input text, in input order."""

    vectors: list[list[float]]
    model: str
    provider: str
    usage: Usage = field(default_factory=Usage)
    cost: float | None = None


class ProviderError(SluiceError):
    """A provider call failed in a way that is neither a throttle nor the request's fault.

    ``provider`` names it (``openai``, ``anthropic``, ``gemini``, ...); ``status``
    is the HTTP status, or None when no answer came.
    """

    def __init__(self, provider: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{provider}: {message}")
        self.provider = provider
        self.status = status


class ProviderUnavailable(ProviderError):
    """A 5xx, a timeout or a broken connection: worth retrying later (the job's backoff)."""


class ProviderRejected(PermanentError):
    """The provider refused the request itself (bad key, unknown model, invalid request):
    retrying the same request cannot help, so the job goes to the dead-letter queue.

    ``kind`` is ``"auth"``, ``"model"``, ``"request"`` or ``"unsupported"``: the
    failure analysis classifies the first two as configuration errors.
    """

    def __init__(
        self, provider: str, message: str, *, status: int | None = None, kind: str = "request"
    ) -> None:
        super().__init__(f"{provider}: {message}")
        self.provider = provider
        self.status = status
        self.kind = kind


class ProviderThrottled(Throttled):
    """The provider said "too many requests" (429, or a quota error): the queue pauses for
    ``retry_after`` seconds and the job waits again, its attempt not counted."""

    def __init__(
        self,
        provider: str,
        retry_after: float,
        message: str = "",
        limits: RateLimits | None = None,
        *,
        asked: float | None = None,
    ) -> None:
        super().__init__(
            min(max(retry_after, 0.0), 86_400.0),
            f"{provider}: {message or 'rate limited'}",
            asked=None if asked is None or not math.isfinite(asked) else min(max(asked, 0.0), 86_400.0),
        )
        self.provider = provider
        self.limits = limits or RateLimits()


@runtime_checkable
class Provider(Protocol):
    """An LLM provider. Implementations: :mod:`sluice.llm.openai` (any OpenAI-compatible
    server), :mod:`sluice.llm.anthropic`, :mod:`sluice.llm.gemini`, and the simulated one of
    :mod:`sluice.testing`."""

    #: short lowercase name: "openai", "anthropic", "gemini", "simulated", ...
    name: str

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str,
        max_tokens: int,
        temperature: float | None = None,
        idempotency_key: str | None = None,
    ) -> Completion:
        """One chat completion of at most ``max_tokens`` output tokens."""
        ...

    async def embed(self, texts: Sequence[str], *, model: str, dimensions: int | None = None) -> Embeddings:
        """One vector per text, of ``dimensions`` floats when given (models that can shorten
        their vectors: OpenAI's text-embedding-3, Gemini's); raises
        ProviderRejected(kind="unsupported") if the provider has no embeddings."""
        ...

    async def aclose(self) -> None:
        """Close connections (the provider is not used afterwards)."""
        ...


async def complete_observed(
    provider: Provider,
    messages: Sequence[Message],
    *,
    model: str,
    max_tokens: int,
    temperature: float | None = None,
    idempotency_key: str | None = None,
) -> Completion:
    """``provider.complete``, reported to the running attempt's probe (sluice/probes.py: the
    worker's metrics hook attaches it, so nothing is passed down to here): the call's
    outcome, the answer's tokens by kind and its cost. Every chat call of Sluice's own
    handlers (llm-inference, failure-analysis) goes through here."""
    try:
        answer = await provider.complete(
            messages,
            model=model,
            max_tokens=max_tokens,
            temperature=temperature,
            idempotency_key=idempotency_key,
        )
    except Exception as exc:
        probe().provider_call(provider.name, model, _call_outcome(exc))
        raise
    listener = probe()
    usage = answer.usage
    listener.provider_call(provider.name, model, "ok")
    # prompt_tokens include the cached part; 'prompt' counts the rest, so the kinds add up.
    listener.tokens(provider.name, model, "prompt", max(usage.prompt_tokens - usage.cached_tokens, 0))
    listener.tokens(provider.name, model, "completion", usage.completion_tokens)
    listener.tokens(provider.name, model, "cached", usage.cached_tokens)
    if answer.cost is not None:
        listener.cost(provider.name, model, answer.cost)
    return answer


def _call_outcome(exc: Exception) -> str:
    """A failed provider call as ``sluice_provider_calls_total`` names it."""
    if isinstance(exc, Throttled):
        return "throttled"
    if isinstance(exc, ProviderUnavailable):
        return "unavailable"
    if isinstance(exc, ProviderRejected):
        return "rejected"
    return "error"
