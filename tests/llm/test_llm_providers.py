"""The HTTP providers against loopback servers that speak their protocols (real HTTP, own processes).

Each provider meets its server (sluice.testing.provider for OpenAI's protocol,
sluice.testing.llm_servers for Anthropic's and Gemini's): completions with usage, embeddings,
and every way a call fails, scripted through the servers' fault endpoint: 429 with the
provider's own headers, 5xx, a slow answer past the client's timeout, a wrong key, an unknown
model. Then the environment's choice of provider, and a canary key that must appear nowhere.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

from sluice.errors import ConfigurationError, PermanentError, Throttled
from sluice.llm.anthropic import AnthropicProvider
from sluice.llm.gemini import GeminiProvider
from sluice.llm.http import HTTPProvider
from sluice.llm.keys import MAX_MESSAGE_CHARS
from sluice.llm.limit_headers import FALLBACK_RETRY_AFTER, MAX_RETRY_AFTER, MIN_RETRY_AFTER, parse_duration
from sluice.llm.openai import OpenAIProvider
from sluice.llm.provider import (
    Message,
    Provider,
    ProviderError,
    ProviderRejected,
    ProviderThrottled,
    ProviderUnavailable,
    Usage,
)
from sluice.llm.providers import KNOWN_PROVIDERS, model_from_env, ollama_url, provider_for, provider_from_env
from sluice.local.embedded import free_port
from sluice.testing.llm_servers import serve_anthropic, serve_gemini
from sluice.testing.provider import format_duration, serve_provider
from sluice.testing.simulated_model import count_text_tokens, hashed_embedding
from sluice.testing.simulated_server import FAULTS_PATH, REQUESTS_PATH, ProviderLimits

pytestmark = pytest.mark.slow

KEYS = {name: f"test-{name}-{secrets.token_hex(8)}" for name in ("openai", "anthropic", "gemini")}
MODELS = {"openai": "gpt-test", "anthropic": "claude-test", "gemini": "gemini-test"}
#: Models the pricing table knows, so that a cost is computed (or, without usage, must not be).
PRICED = {"openai": "gpt-4o-mini", "anthropic": "claude-haiku-4-5", "gemini": "gemini-2.5-flash"}
#: OpenAI's models that take max_completion_tokens, not max_tokens.
REASONING_MODELS = ("gpt-5-mini", "o3")
EMBEDDING_MODEL = "embed-test"
DIMENSIONS = 32
#: Generous limits: the servers send their rate-limit headers, and never refuse.
ROOMY = ProviderLimits(requests=100_000, tokens=100_000_000, window=60.0)
SYSTEM = "You answer in one short sentence, in plain English, without lists. " * 3
CHAT: list[Message] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is a queue?"},
    {"role": "assistant", "content": "A line of work."},
    {"role": "user", "content": "And a dead-letter queue?"},
]


@pytest.fixture(scope="module")
def openai_url() -> Iterator[str]:
    models = (
        MODELS["openai"],
        PRICED["openai"],
        *REASONING_MODELS,
        EMBEDDING_MODEL,
        "text-embedding-3-small",
    )
    with serve_provider(ROOMY, api_key=KEYS["openai"], models=models, embedding_dimensions=DIMENSIONS) as url:
        yield url


@pytest.fixture(scope="module")
def anthropic_url() -> Iterator[str]:
    models = [MODELS["anthropic"], PRICED["anthropic"]]
    with serve_anthropic(ROOMY, api_key=KEYS["anthropic"], models=models) as url:
        yield url


@pytest.fixture(scope="module")
def gemini_url() -> Iterator[str]:
    models = (MODELS["gemini"], PRICED["gemini"], EMBEDDING_MODEL)
    with serve_gemini(None, api_key=KEYS["gemini"], models=models) as url:
        yield url


def make(name: str, url: str, key: str | None = None, timeout: float | None = None) -> HTTPProvider:
    """The provider ``name`` pointed at its loopback server, its key in a private environment."""
    key = KEYS[name] if key is None else key
    if name == "openai":
        env = {"OPENAI_API_KEY": key}
        return OpenAIProvider(base_url=f"{url}/v1", api_key_env="OPENAI_API_KEY", env=env, timeout=timeout)
    if name == "anthropic":
        return AnthropicProvider(base_url=url, env={"ANTHROPIC_API_KEY": key}, timeout=timeout)
    return GeminiProvider(base_url=url, env={"GEMINI_API_KEY": key}, timeout=timeout)


@dataclass
class Target:
    name: str
    url: str

    @property
    def model(self) -> str:
        return MODELS[self.name]

    def provider(self, key: str | None = None, timeout: float | None = None) -> HTTPProvider:
        return make(self.name, self.url, key, timeout)


@pytest.fixture(params=["openai", "anthropic", "gemini"])
def target(request: pytest.FixtureRequest) -> Target:
    return Target(request.param, request.getfixturevalue(f"{request.param}_url"))


async def script(url: str, *faults: dict[str, Any]) -> None:
    """Make the server's next API requests fail as ``faults`` say."""
    async with httpx.AsyncClient() as client:
        (await client.post(url + FAULTS_PATH, json=list(faults))).raise_for_status()


async def received(url: str) -> list[dict[str, Any]]:
    """The last requests the server received (without keys)."""
    async with httpx.AsyncClient() as client:
        reply = await client.get(url + REQUESTS_PATH)
    reply.raise_for_status()
    answer: list[dict[str, Any]] = reply.json()
    return answer


async def ask(provider: HTTPProvider, model: str, max_tokens: int = 5) -> Any:
    assert isinstance(provider, OpenAIProvider | AnthropicProvider | GeminiProvider)
    return await provider.complete(CHAT, model=model, max_tokens=max_tokens)


# ---- completions and embeddings ----------------------------------------------------------------


async def test_openai_completion_reports_usage_cached_tokens_and_limits(openai_url: str) -> None:
    async with make("openai", openai_url) as provider:
        assert isinstance(provider, OpenAIProvider) and isinstance(provider, Provider)
        first = await provider.complete(
            CHAT, model="gpt-test", max_tokens=7, idempotency_key="job-1:attempt-1"
        )
        second = await provider.complete(CHAT, model="gpt-test", max_tokens=7, temperature=0.2)
    prompt = count_text_tokens([m["content"] for m in CHAT])
    assert first.text == "(7 simulated tokens)"
    assert (first.provider, first.model, first.finish_reason) == ("openai", "gpt-test", "length")
    assert first.response_id is not None and first.response_id.startswith("chatcmpl-sim-")
    assert first.usage == Usage(prompt_tokens=prompt, completion_tokens=7, cached_tokens=0)
    # The same conversation again: its first three messages come from the prompt cache.
    cached = sum(len(m["content"]) for m in CHAT[:3]) // 4
    assert second.usage == Usage(prompt_tokens=prompt, completion_tokens=7, cached_tokens=cached)
    assert first.limits.limit_requests == 100_000 and first.limits.limit_tokens == 100_000_000
    assert first.limits.remaining_requests is not None and first.limits.remaining_requests < 100_000
    assert first.limits.reset_requests is not None and 59 < first.limits.reset_requests <= 60
    sent = (await received(openai_url))[-2:]
    assert sent[0]["path"] == "/v1/chat/completions"
    assert sent[0]["headers"]["x-client-request-id"] == "job-1:attempt-1"
    assert sent[0]["body"] == {"model": "gpt-test", "messages": CHAT, "max_tokens": 7}
    assert sent[1]["body"]["temperature"] == 0.2 and "x-client-request-id" not in sent[1]["headers"]


async def test_openai_reasoning_models_get_max_completion_tokens(openai_url: str) -> None:
    async with make("openai", openai_url) as provider:
        assert isinstance(provider, OpenAIProvider)
        answers = [await provider.complete(CHAT, model=m, max_tokens=7) for m in REASONING_MODELS]
        plain = await provider.complete(CHAT, model="gpt-test", max_tokens=7)
    assert [a.usage.completion_tokens for a in [*answers, plain]] == [7, 7, 7]
    bodies = [r["body"] for r in (await received(openai_url))[-3:]]
    for body in bodies[:2]:
        assert body["max_completion_tokens"] == 7 and "max_tokens" not in body
    assert bodies[2]["max_tokens"] == 7 and "max_completion_tokens" not in bodies[2]
    # A field fixed by the caller, and another server than OpenAI's, keep max_tokens.
    env = {"OPENAI_API_KEY": KEYS["openai"]}
    fixed = OpenAIProvider(
        base_url=f"{openai_url}/v1", api_key_env="OPENAI_API_KEY", env=env, max_tokens_field="max_tokens"
    )
    other = OpenAIProvider(base_url=f"{openai_url}/v1", api_key_env="OPENAI_API_KEY", env=env, name="vllm")
    for provider in (fixed, other):
        async with provider:
            assert (await provider.complete(CHAT, model="o3", max_tokens=5)).usage.completion_tokens == 5
        assert provider.max_tokens_field_for("gpt-5-mini") == "max_tokens"
    assert all("max_tokens" in r["body"] for r in (await received(openai_url))[-2:])
    # The environment's choice of a reasoning model gets the field too.
    chosen = provider_from_env({"SLUICE_LLM_MODEL": "gpt-5-mini", "OPENAI_API_KEY": "k"})
    assert isinstance(chosen, OpenAIProvider)
    assert [
        chosen.max_tokens_field_for(m) for m in ("gpt-5-mini", "o4-mini-2025-04-16", "gpt-5.1", "o1")
    ] == ["max_completion_tokens"] * 4
    assert [chosen.max_tokens_field_for(m) for m in ("gpt-4o-mini", "gpt-50", "omni-moderation-latest")] == [
        "max_tokens"
    ] * 3
    ollama = provider_from_env({"SLUICE_LLM_PROVIDER": "ollama", "SLUICE_LLM_MODEL": "o3"})
    assert isinstance(ollama, OpenAIProvider) and ollama.max_tokens_field_for("o3") == "max_tokens"


async def test_openai_embeddings_are_one_vector_per_text_in_order(openai_url: str) -> None:
    texts = ["the cat sat on the mat", "stock prices fell sharply", "the cat sat on the mat"]
    async with make("openai", openai_url) as provider:
        assert isinstance(provider, OpenAIProvider)
        result = await provider.embed(texts, model=EMBEDDING_MODEL)
        assert (await provider.embed([], model=EMBEDDING_MODEL)).vectors == []
    assert result.vectors == [hashed_embedding(t, DIMENSIONS) for t in texts]
    assert result.vectors[0] == result.vectors[2] != result.vectors[1]
    assert all(math.isclose(math.hypot(*v), 1.0) for v in result.vectors)
    assert result.usage == Usage(prompt_tokens=sum(count_text_tokens([t]) for t in texts))
    assert (result.provider, result.model) == ("openai", EMBEDDING_MODEL)


async def test_anthropic_completion_moves_the_system_prompt_and_counts_cached_input(
    anthropic_url: str,
) -> None:
    async with make("anthropic", anthropic_url) as provider:
        assert isinstance(provider, AnthropicProvider) and isinstance(provider, Provider)
        first = await provider.complete(CHAT, model="claude-test", max_tokens=9, temperature=0.5)
        second = await provider.complete(CHAT, model="claude-test", max_tokens=9)
    prompt = count_text_tokens([m["content"] for m in CHAT])
    assert first.text == "(9 simulated tokens)" and first.finish_reason == "max_tokens"
    assert first.usage == Usage(prompt_tokens=prompt, completion_tokens=9, cached_tokens=0)
    # Anthropic reports cached input apart from input_tokens; the prompt counts both.
    cached = sum(len(m["content"]) for m in CHAT[:3]) // 4
    assert second.usage == Usage(prompt_tokens=prompt, completion_tokens=9, cached_tokens=cached)
    assert first.response_id is not None and first.response_id.startswith("msg_")
    assert first.limits.limit_requests == 100_000 and first.limits.limit_tokens == 100_000_000
    assert first.limits.reset_requests is not None and 58 < first.limits.reset_requests <= 60
    body = (await received(anthropic_url))[-2]["body"]
    assert body["system"] == SYSTEM
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["max_tokens"] == 9 and body["temperature"] == 0.5


async def test_anthropic_has_no_embeddings_and_says_what_to_use(anthropic_url: str) -> None:
    before = len(await received(anthropic_url))
    async with make("anthropic", anthropic_url) as provider:
        assert isinstance(provider, AnthropicProvider)
        with pytest.raises(ProviderRejected) as caught:
            await provider.embed(["text"], model="any")
    assert caught.value.kind == "unsupported" and isinstance(caught.value, PermanentError)
    assert "no embeddings endpoint" in str(caught.value) and "Voyage" in str(caught.value)
    assert len(await received(anthropic_url)) == before  # nothing was sent


async def test_gemini_completion_translates_roles_system_and_limits(gemini_url: str) -> None:
    async with make("gemini", gemini_url) as provider:
        assert isinstance(provider, GeminiProvider) and isinstance(provider, Provider)
        first = await provider.complete(CHAT, model="gemini-test", max_tokens=6, temperature=0.1)
        second = await provider.complete(CHAT, model="models/gemini-test", max_tokens=6)
    prompt = count_text_tokens([m["content"] for m in CHAT])
    assert first.text == "(6 simulated tokens)" and first.finish_reason == "MAX_TOKENS"
    assert first.usage == Usage(prompt_tokens=prompt, completion_tokens=6, cached_tokens=0)
    cached = sum(len(m["content"]) for m in CHAT[:3]) // 4
    assert second.usage == Usage(prompt_tokens=prompt, completion_tokens=6, cached_tokens=cached)
    assert first.response_id is not None and first.model == "gemini-test"
    sent = (await received(gemini_url))[-2]
    assert sent["path"] == "/v1beta/models/gemini-test:generateContent"
    assert sent["body"]["systemInstruction"] == {"parts": [{"text": SYSTEM}]}
    assert [c["role"] for c in sent["body"]["contents"]] == ["user", "model", "user"]
    assert sent["body"]["generationConfig"] == {"maxOutputTokens": 6, "temperature": 0.1}


async def test_gemini_embeddings_are_sent_in_batches_of_a_hundred(gemini_url: str) -> None:
    texts = [f"document number {i} about topic {i % 7}" for i in range(150)]
    async with make("gemini", gemini_url) as provider:
        assert isinstance(provider, GeminiProvider)
        result = await provider.embed(texts, model="embed-test")
    assert result.vectors == [hashed_embedding(t, 64) for t in texts]
    # Gemini reports no usage for embeddings: unknown, not free.
    assert result.usage == Usage(reported=False) and result.cost is None
    batches = [r["body"]["requests"] for r in (await received(gemini_url))[-2:]]
    assert [len(b) for b in batches] == [100, 50]
    assert batches[0][0] == {"model": "models/embed-test", "content": {"parts": [{"text": texts[0]}]}}


async def test_an_answer_without_usage_is_unreported_and_of_unknown_cost(target: Target) -> None:
    # A proxy or server that leaves the usage out: the zeros are unknown, not a free call.
    await script(target.url, {"status": 200, "omit_usage": True})
    async with target.provider() as provider:
        bare = await ask(provider, PRICED[target.name], max_tokens=4)
        full = await ask(provider, PRICED[target.name], max_tokens=4)
    assert bare.text == "(4 simulated tokens)"
    assert bare.usage == Usage(0, 0, 0, reported=False) and bare.cost is None
    assert full.usage.reported and full.usage.completion_tokens == 4
    assert full.cost is not None and full.cost > 0


async def test_openai_null_usage_and_embeddings_without_usage_are_unreported(openai_url: str) -> None:
    await script(openai_url, {"omit_usage": "null"}, {"status": 200, "omit_usage": True})
    async with make("openai", openai_url) as provider:
        assert isinstance(provider, OpenAIProvider)
        answer = await provider.complete(CHAT, model=PRICED["openai"], max_tokens=3)
        vectors = await provider.embed(["a text", "another"], model="text-embedding-3-small")
        counted = await provider.embed(["a text", "another"], model="text-embedding-3-small")
    assert answer.usage == Usage(reported=False) and answer.cost is None
    assert vectors.usage == Usage(reported=False) and vectors.cost is None
    assert counted.usage.reported and counted.usage.prompt_tokens > 0 and counted.cost is not None


# ---- throttling --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "wait"),
    [
        ({"retry_after_ms": 700}, 0.7),  # retry-after-ms, the most precise
        ({"retry_after_ms": 2500, "headers": {"retry-after-ms": None}}, 3.0),  # retry-after: whole seconds
        (
            {
                "headers": {
                    "x-ratelimit-remaining-requests": "12",
                    "x-ratelimit-reset-requests": "20ms",
                    "x-ratelimit-remaining-tokens": "0",
                    "x-ratelimit-reset-tokens": "1m30.5s",
                }
            },
            90.5,  # only the resets: the exhausted limit's
        ),
        ({}, 1.0),  # nothing said: the fallback
    ],
)
async def test_openai_429_is_throttled_for_what_the_headers_say(
    openai_url: str, fault: dict[str, Any], wait: float
) -> None:
    await script(openai_url, {"status": 429, **fault})
    async with make("openai", openai_url) as provider:
        with pytest.raises(ProviderThrottled) as caught:
            await ask(provider, "gpt-test")
    assert isinstance(caught.value, Throttled)
    assert caught.value.retry_after == pytest.approx(wait)
    assert "Rate limit reached" in str(caught.value) and str(caught.value).startswith("openai: ")


async def test_a_retry_after_date_is_read_as_the_time_until_then(openai_url: str) -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    await script(openai_url, {"status": 429, "headers": {"retry-after": when}})
    async with make("openai", openai_url) as provider:
        with pytest.raises(ProviderThrottled) as caught:
            await ask(provider, "gpt-test")
    assert 28 <= caught.value.retry_after <= 30


async def test_the_real_window_refuses_with_a_retry_after_that_works() -> None:
    with serve_provider(ProviderLimits(requests=1, window=1.5), api_key=KEYS["openai"]) as url:
        async with make("openai", url) as provider:
            await ask(provider, "any-model")
            with pytest.raises(ProviderThrottled) as caught:
                await ask(provider, "any-model")
            assert 1.0 < caught.value.retry_after <= 1.5
            assert caught.value.limits.remaining_requests == 0 and caught.value.limits.limit_requests == 1
            await asyncio.sleep(caught.value.retry_after)
            assert (await ask(provider, "any-model")).usage.completion_tokens == 5


async def test_anthropic_429_reads_retry_after_then_the_reset_times(anthropic_url: str) -> None:
    await script(
        anthropic_url,
        {"status": 429, "retry_after_ms": 2000},
        {"status": 429, "retry_after_ms": 4000, "headers": {"retry-after": None}},
    )
    async with make("anthropic", anthropic_url) as provider:
        with pytest.raises(ProviderThrottled) as first:
            await ask(provider, "claude-test")
        with pytest.raises(ProviderThrottled) as second:
            await ask(provider, "claude-test")
    assert first.value.retry_after == 2.0 and "exceeded your rate limit" in str(first.value)
    # Only anthropic-ratelimit-requests-reset (an RFC 3339 time, 4 s ahead) said when.
    assert 3.0 < second.value.retry_after <= 4.0
    assert second.value.limits.remaining_requests == 0


async def test_gemini_resource_exhausted_waits_its_retry_delay(gemini_url: str) -> None:
    await script(gemini_url, {"status": 429, "retry_after_ms": 2000})
    async with make("gemini", gemini_url) as provider:
        with pytest.raises(ProviderThrottled) as caught:
            await ask(provider, "gemini-test")
    assert caught.value.retry_after == 2.0 and "Resource has been exhausted" in str(caught.value)


async def test_a_quota_only_money_fixes_is_rejected_not_throttled(openai_url: str) -> None:
    message = "You exceeded your current quota, please check your plan and billing details."
    await script(openai_url, {"status": 429, "code": "insufficient_quota", "message": message})
    async with make("openai", openai_url) as provider:
        with pytest.raises(ProviderRejected) as caught:
            await ask(provider, "gpt-test")
    assert caught.value.status == 429 and caught.value.kind == "auth"
    assert "no credit or quota left" in str(caught.value)


def _past_http_date() -> str:
    return format_datetime(datetime.now(UTC) - timedelta(seconds=30), usegmt=True)


def _past_rfc3339() -> str:
    return (datetime.now(UTC) - timedelta(seconds=30)).isoformat(timespec="milliseconds")


@pytest.mark.parametrize(
    ("name", "fault", "wait"),
    [
        # A wait of zero says nothing usable: the fallback, never an immediate return.
        ("openai", {"headers": {"retry-after": "0"}}, FALLBACK_RETRY_AFTER),
        ("openai", {"retry_after_ms": 0}, FALLBACK_RETRY_AFTER),  # retry-after-ms: 0, resets "0s"
        ("openai", {"headers": {"retry-after": "past"}}, FALLBACK_RETRY_AFTER),  # an HTTP date gone by
        # A past Anthropic reset (our clock ahead of theirs) and no retry-after.
        (
            "anthropic",
            {
                "headers": {
                    "anthropic-ratelimit-requests-remaining": "0",
                    "anthropic-ratelimit-requests-reset": "past-rfc3339",
                }
            },
            FALLBACK_RETRY_AFTER,
        ),
        ("gemini", {"retry_after_ms": 0}, FALLBACK_RETRY_AFTER),  # RetryInfo retryDelay "0s"
        # A wait above zero but shorter than the floor gets the floor.
        ("openai", {"headers": {"retry-after-ms": "1"}}, MIN_RETRY_AFTER),
        ("gemini", {"retry_after_ms": 20}, MIN_RETRY_AFTER),
        # An absurd wait gets the ceiling.
        ("openai", {"headers": {"retry-after": "1e12"}}, MAX_RETRY_AFTER),
        ("anthropic", {"headers": {"retry-after": "86400"}}, MAX_RETRY_AFTER),
    ],
)
async def test_a_429_pauses_between_the_floor_and_the_ceiling_whatever_it_says(
    name: str, fault: dict[str, Any], wait: float, request: pytest.FixtureRequest
) -> None:
    url: str = request.getfixturevalue(f"{name}_url")
    headers = dict(fault.get("headers", {}))
    for header, value in headers.items():
        headers[header] = {"past": _past_http_date(), "past-rfc3339": _past_rfc3339()}.get(value, value)
    await script(url, {"status": 429, **fault, "headers": headers})
    async with make(name, url) as provider:
        with pytest.raises(ProviderThrottled) as caught:
            await ask(provider, MODELS[name])
    assert caught.value.retry_after == pytest.approx(wait)
    assert f"retry in {wait:g} s" in str(caught.value)
    if wait == MAX_RETRY_AFTER:
        assert f"one pause is at most {MAX_RETRY_AFTER:g} s" in str(caught.value)


def _gemini_quota_error(quota_id: str) -> dict[str, Any]:
    """Gemini's 429 for an exhausted quota, as the API writes it (free tier)."""
    return {
        "error": {
            "code": 429,
            "message": (
                "You exceeded your current quota, please check your plan and billing details. For more "
                "information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.\n"
                "* Quota exceeded for metric: generativelanguage.googleapis.com/"
                "generate_content_free_tier_requests, limit: 250, model: gemini-2.5-flash\n"
                "Please retry in 32.5s."
            ),
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [
                        {
                            "quotaMetric": (
                                "generativelanguage.googleapis.com/generate_content_free_tier_requests"
                            ),
                            "quotaId": quota_id,
                            "quotaDimensions": {"location": "global", "model": "gemini-2.5-flash"},
                            "quotaValue": "250",
                        }
                    ],
                },
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "32s"},
            ],
        }
    }


async def test_gemini_per_day_quota_is_rejected_not_throttled_all_day(gemini_url: str) -> None:
    per_day = "GenerateRequestsPerDayPerProjectPerModel-FreeTier"
    per_minute = "GenerateRequestsPerMinutePerProjectPerModel-FreeTier"
    await script(
        gemini_url,
        {"status": 429, "body": _gemini_quota_error(per_day)},
        {"status": 429, "message": "Quota exceeded for quota metric 'Generate Content API requests per day'"},
        {"status": 429, "body": _gemini_quota_error(per_minute)},
    )
    async with make("gemini", gemini_url) as provider:
        for _ in range(2):  # the QuotaFailure's quotaId, then the message, names the day
            with pytest.raises(ProviderRejected) as caught:
                await ask(provider, "gemini-test")
            assert caught.value.status == 429 and caught.value.kind == "auth"
            assert "per-day quota is used up" in str(caught.value)
        # A per-minute quota is a throttle, for the RetryInfo's delay.
        with pytest.raises(ProviderThrottled) as throttled:
            await ask(provider, "gemini-test")
    assert throttled.value.retry_after == 32.0


# ---- failures --------------------------------------------------------------------------------


async def test_server_errors_are_unavailable(target: Target) -> None:
    statuses = {"openai": [500, 503], "anthropic": [500, 529], "gemini": [500, 503]}[target.name]
    await script(target.url, *({"status": s} for s in statuses))
    async with target.provider() as provider:
        for status in statuses:
            with pytest.raises(ProviderUnavailable) as caught:
                await ask(provider, target.model)
            assert caught.value.status == status and caught.value.provider == target.name
            assert not isinstance(caught.value, PermanentError | Throttled)
            assert "try again later" in str(caught.value)
        assert (await ask(provider, target.model)).text  # the faults are spent: served again


async def test_an_answer_slower_than_the_timeout_is_unavailable(target: Target) -> None:
    await script(target.url, {"delay": 2.0})
    async with target.provider(timeout=0.3) as provider:
        started = time.monotonic()
        with pytest.raises(ProviderUnavailable) as caught:
            await ask(provider, target.model)
        assert time.monotonic() - started < 1.5
    assert "no answer within the timeout of 0.3 s" in str(caught.value) and caught.value.status is None


async def test_a_refused_connection_is_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with make("openai", url) as provider:
        with pytest.raises(ProviderUnavailable) as caught:
            await ask(provider, "gpt-test")
    assert "cannot connect" in str(caught.value) and "base URL" in str(caught.value)


async def test_a_wrong_key_is_rejected_as_auth_without_repeating_it(target: Target) -> None:
    wrong = f"wrong-{secrets.token_hex(10)}"
    async with target.provider(key=wrong) as provider:
        with pytest.raises(ProviderRejected) as caught:
            await ask(provider, target.model)
    error = caught.value
    # Gemini answers a wrong key with 400 INVALID_ARGUMENT (reason API_KEY_INVALID), as Google does.
    assert error.kind == "auth" and error.status == (400 if target.name == "gemini" else 401)
    assert {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY", "gemini": "GEMINI_API_KEY"}[
        target.name
    ] in str(error)
    assert wrong not in str(error) and wrong not in repr(error)
    if target.name == "openai":  # this server echoes the key it got: our message must not
        assert "Incorrect API key provided: [redacted]" in str(error)


def _pieces(key: str, size: int = 8) -> list[str]:
    return [key[i : i + size] for i in range(len(key) - size + 1)]


async def test_a_key_in_an_error_is_scrubbed_before_the_message_is_shortened(openai_url: str) -> None:
    key = "sk" + secrets.token_hex(20)
    # The key straddles the cut at MAX_MESSAGE_CHARS: in a plain-text body, in a message that is
    # not a string, and in a string message.
    await script(
        openai_url,
        {"status": 502, "body": "x" * (MAX_MESSAGE_CHARS - 10) + key + " was refused"},
        {"status": 400, "body": {"error": {"message": {"detail": "y" * (MAX_MESSAGE_CHARS - 20) + key}}}},
        {"status": 401, "message": "z" * (MAX_MESSAGE_CHARS - 5) + key, "code": "invalid_api_key"},
    )
    async with make("openai", openai_url, key=key) as provider:
        said: list[str] = []
        for expected in (ProviderUnavailable, ProviderRejected, ProviderRejected):
            with pytest.raises(expected) as caught:
                await ask(provider, "gpt-test")
            said.append(str(caught.value))
    for text in said:
        assert not [piece for piece in _pieces(key) if piece in text], text
        assert "[r" in text  # the redaction, cut where the key began


async def test_a_key_json_would_escape_is_scrubbed_from_a_message_that_is_not_a_string(
    openai_url: str,
) -> None:
    # JSON writes " and \ escaped: the rendered message no longer holds the key as sent.
    parts = [secrets.token_hex(8) for _ in range(3)]
    key = f'sk"{parts[0]}\\{parts[1]}"{parts[2]}'
    body = {"error": {"message": ["Incorrect API key provided:", key], "type": "invalid_request_error"}}
    await script(openai_url, {"status": 401, "body": body})
    async with make("openai", openai_url, key=key) as provider:
        with pytest.raises(ProviderRejected) as caught:
            await ask(provider, "gpt-test")
    text = _everything_said_about(caught.value)
    assert caught.value.kind == "auth" and "Incorrect API key provided" in str(caught.value)
    assert not [part for part in parts if part in text]
    assert "[redacted]" in str(caught.value)


async def test_the_default_openai_key_goes_to_api_openai_com_only(openai_url: str) -> None:
    env = {"OPENAI_API_KEY": KEYS["openai"]}
    async with OpenAIProvider(base_url=f"{openai_url}/v1", env=env) as elsewhere:
        assert "key=none" in repr(elsewhere)
        with pytest.raises(ProviderRejected) as caught:
            await ask(elsewhere, "gpt-test")
    assert caught.value.kind == "auth" and "You didn't provide an API key" in str(caught.value)
    assert "key=from OPENAI_API_KEY" in repr(OpenAIProvider(env=env))


async def test_an_unknown_model_is_rejected_as_model(target: Target) -> None:
    async with target.provider() as provider:
        with pytest.raises(ProviderRejected) as caught:
            await ask(provider, "no-such-model")
    assert caught.value.kind == "model" and caught.value.status == 404
    assert "no-such-model" in str(caught.value) and "Check the model name" in str(caught.value)


async def test_a_bad_request_is_rejected_as_request(openai_url: str, anthropic_url: str) -> None:
    async with make("openai", openai_url) as provider:
        with pytest.raises(ProviderRejected) as caught:
            await ask(provider, "gpt-test", max_tokens=0)
    assert caught.value.kind == "request" and caught.value.status == 400
    assert "max_tokens" in str(caught.value) and "retrying it cannot help" in str(caught.value)
    async with make("anthropic", anthropic_url) as provider:
        assert isinstance(provider, AnthropicProvider)
        with pytest.raises(ProviderRejected) as caught:
            await provider.complete(CHAT, model="claude-test", max_tokens=5, temperature=1.5)
    assert caught.value.kind == "request" and "temperature" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("20ms", 0.02), ("1s", 1.0), ("6m0s", 360.0), ("1h2m3.5s", 3723.5), ("0.5", 0.5), ("12s", 12.0)],
)
def test_durations_read_as_openai_and_google_write_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)


def test_unreadable_durations_are_none() -> None:
    assert [parse_duration(t) for t in ("", "soon", "5 s", "1x", "-3", "nan")] == [None] * 6


# ---- the environment's choice ------------------------------------------------------------------


def test_provider_from_env_builds_the_chosen_provider_with_its_model() -> None:
    key = "k-" + secrets.token_hex(4)
    openai = provider_from_env({"OPENAI_API_KEY": key})
    assert isinstance(openai, OpenAIProvider) and openai.base_url == "https://api.openai.com/v1"
    assert (openai.name, openai.default_model) == ("openai", "gpt-4o-mini")
    # ArQueue's names, when Sluice's are not set; Sluice's win.
    claude = provider_from_env({"AI_PROVIDER": "anthropic", "AI_MODEL": "claude-x", "ANTHROPIC_API_KEY": key})
    assert isinstance(claude, AnthropicProvider) and claude.default_model == "claude-x"
    env = {"SLUICE_LLM_PROVIDER": "gemini", "AI_PROVIDER": "anthropic", "GOOGLE_API_KEY": key}
    gemini = provider_from_env(env)
    assert isinstance(gemini, GeminiProvider) and gemini.default_model == "gemini-2.5-flash"
    assert "GOOGLE_API_KEY" in repr(gemini) and key not in repr(gemini)
    assert "GEMINI_API_KEY" in repr(provider_from_env({**env, "GEMINI_API_KEY": key}))
    assert model_from_env({"SLUICE_LLM_PROVIDER": "claude"}) == "claude-haiku-4-5"
    assert model_from_env({"SLUICE_LLM_MODEL": "m1", "AI_MODEL": "m2"}) == "m1"
    for built in (openai, claude, gemini):
        assert isinstance(built, Provider)


def test_ollama_needs_no_key_and_finds_its_host() -> None:
    ollama = provider_from_env({"SLUICE_LLM_PROVIDER": "ollama"})
    assert isinstance(ollama, OpenAIProvider)
    assert (ollama.name, ollama.base_url, ollama.default_model) == (
        "ollama",
        "http://localhost:11434/v1",
        "llama3.2",
    )
    assert "key=none" in repr(ollama)
    remote = provider_from_env({"AI_PROVIDER": "ollama", "OLLAMA_HOST": "gpu-box"})
    assert isinstance(remote, OpenAIProvider) and remote.base_url == "http://gpu-box:11434/v1"
    assert ollama_url("0.0.0.0:9999") == "http://0.0.0.0:9999/v1"
    assert ollama_url("https://ollama.example.com/") == "https://ollama.example.com/v1"


def test_an_openai_compatible_server_needs_its_url_and_names_its_model() -> None:
    with pytest.raises(ConfigurationError, match="SLUICE_LLM_BASE_URL"):
        provider_from_env({"SLUICE_LLM_PROVIDER": "openai-compatible"})
    env = {"SLUICE_LLM_PROVIDER": "openai-compatible", "SLUICE_LLM_BASE_URL": "http://localhost:8000/v1/"}
    vllm = provider_from_env(env)
    assert isinstance(vllm, OpenAIProvider) and vllm.base_url == "http://localhost:8000/v1"
    assert vllm.default_model is None and "key=none" in repr(vllm)
    with pytest.raises(ConfigurationError, match="SLUICE_LLM_MODEL"):
        model_from_env(env)
    assert "SLUICE_LLM_API_KEY" in repr(provider_from_env({**env, "SLUICE_LLM_API_KEY": "k"}))
    with pytest.raises(ConfigurationError, match="http:// or https://"):
        provider_from_env({**env, "SLUICE_LLM_BASE_URL": "localhost:8000"})


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({}, "OPENAI_API_KEY"),
        ({"SLUICE_LLM_PROVIDER": "openai", "OPENAI_API_KEY": "  "}, "OPENAI_API_KEY"),
        ({"SLUICE_LLM_PROVIDER": "anthropic", "OPENAI_API_KEY": "k"}, "ANTHROPIC_API_KEY"),
        ({"AI_PROVIDER": "google"}, "GEMINI_API_KEY (or GOOGLE_API_KEY)"),
    ],
)
def test_a_missing_key_names_the_variable_to_set(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        provider_from_env(env)
    assert f"set {variable} in the environment" in str(caught.value)
    assert "SLUICE_LLM_PROVIDER" in str(caught.value)  # or choose another provider


def test_an_unknown_provider_or_a_mangled_key_is_a_configuration_error() -> None:
    with pytest.raises(
        ConfigurationError, match="one of openai, anthropic, gemini, ollama, openai-compatible"
    ):
        provider_from_env({"AI_PROVIDER": "watson"})
    mangled = "sk-" + secrets.token_hex(8) + "\nsecond-line"
    with pytest.raises(ConfigurationError) as caught:
        provider_from_env({"OPENAI_API_KEY": mangled})
    assert "OPENAI_API_KEY holds characters an HTTP header cannot carry" in str(caught.value)
    assert mangled.split("\n")[0] not in str(caught.value)
    # Whitespace around a key (a pasted newline) is dropped, not refused.
    assert isinstance(provider_from_env({"OPENAI_API_KEY": " sk-good\n"}), OpenAIProvider)


async def test_provider_from_env_reaches_a_server_at_the_base_url_it_names(anthropic_url: str) -> None:
    env = {
        "SLUICE_LLM_PROVIDER": "anthropic",
        "ANTHROPIC_API_KEY": KEYS["anthropic"],
        "SLUICE_LLM_BASE_URL": anthropic_url,
        "SLUICE_LLM_MODEL": "claude-test",
    }
    provider = provider_from_env(env)
    assert isinstance(provider, AnthropicProvider) and provider.default_model is not None
    async with provider:
        answer = await provider.complete(CHAT, model=provider.default_model, max_tokens=3)
    assert answer.usage.completion_tokens == 3 and answer.provider == "anthropic"


def test_provider_for_gives_the_base_url_and_model_to_the_configured_provider_only() -> None:
    key = "k-" + secrets.token_hex(4)
    env = {
        "SLUICE_LLM_PROVIDER": "anthropic",
        "SLUICE_LLM_BASE_URL": "http://proxy.internal:8080",
        "SLUICE_LLM_MODEL": "claude-x",
        "ANTHROPIC_API_KEY": key,
        "OPENAI_API_KEY": key,
        "GEMINI_API_KEY": key,
        "OLLAMA_HOST": "gpu-box",
    }
    configured = provider_for("Claude", env)
    assert isinstance(configured, AnthropicProvider)
    assert (configured.base_url, configured.default_model) == ("http://proxy.internal:8080", "claude-x")
    built = [provider_for(name, env) for name in ("openai", "google", "ollama")]
    assert [type(p) for p in built] == [OpenAIProvider, GeminiProvider, OpenAIProvider]
    assert [(p.name, p.base_url, p.default_model) for p in built if isinstance(p, HTTPProvider)] == [
        ("openai", "https://api.openai.com/v1", "gpt-4o-mini"),
        ("gemini", "https://generativelanguage.googleapis.com", "gemini-2.5-flash"),
        ("ollama", "http://gpu-box:11434/v1", "llama3.2"),
    ]
    # An OpenAI-compatible server has no URL but the configured provider's.
    with pytest.raises(ConfigurationError, match="SLUICE_LLM_PROVIDER=openai-compatible"):
        provider_for("openai-compatible", env)
    with pytest.raises(ConfigurationError, match="not a provider Sluice knows"):
        provider_for("watson", env)
    with pytest.raises(ConfigurationError, match="set GEMINI_API_KEY"):
        provider_for("gemini", {})
    # With no provider configured, the settings are openai's (as provider_from_env reads them).
    unset = {"OPENAI_API_KEY": key, "SLUICE_LLM_MODEL": "gpt-x", "SLUICE_LLM_BASE_URL": "http://gw:1/v1"}
    openai = provider_for("openai", unset)
    assert isinstance(openai, HTTPProvider) and (openai.base_url, openai.default_model) == (
        "http://gw:1/v1",
        "gpt-x",
    )
    compatible = {"AI_PROVIDER": "openai_compatible", "SLUICE_LLM_BASE_URL": "http://localhost:8000/v1"}
    vllm = provider_for("compatible", compatible)
    assert isinstance(vllm, OpenAIProvider) and vllm.base_url == "http://localhost:8000/v1"
    # An unknown configured provider configures none: the named one still gets its defaults.
    other = provider_for("anthropic", {**env, "SLUICE_LLM_PROVIDER": "watson"})
    assert isinstance(other, AnthropicProvider) and other.base_url == "https://api.anthropic.com"
    assert sorted(KNOWN_PROVIDERS) == [
        "anthropic",
        "claude",
        "compatible",
        "gemini",
        "google",
        "ollama",
        "openai",
        "openai-compatible",
        "openai_compatible",
    ]


async def test_provider_for_reaches_the_configured_server_and_not_another_provider_there(
    anthropic_url: str, openai_url: str
) -> None:
    env = {
        "SLUICE_LLM_PROVIDER": "anthropic",
        "SLUICE_LLM_BASE_URL": anthropic_url,
        "SLUICE_LLM_MODEL": "claude-test",
        "ANTHROPIC_API_KEY": KEYS["anthropic"],
        "OPENAI_API_KEY": KEYS["openai"],
    }
    configured = provider_for("anthropic", env)
    assert isinstance(configured, AnthropicProvider) and configured.default_model == "claude-test"
    async with configured:
        answer = await configured.complete(CHAT, model=configured.default_model, max_tokens=2)
    assert answer.usage.completion_tokens == 2
    # Another provider keeps its own API: the OpenAI key does not go to the configured proxy.
    before = await received(anthropic_url)
    openai = provider_for("openai", env)
    assert isinstance(openai, OpenAIProvider) and openai.base_url == "https://api.openai.com/v1"
    assert openai.default_model == "gpt-4o-mini"
    await openai.aclose()
    assert await received(anthropic_url) == before


# ---- the canary -------------------------------------------------------------------------------


def _everything_said_about(exc: BaseException) -> str:
    """str, repr, attributes and the formatted traceback (with its chain) of an exception."""
    return "\n".join([str(exc), repr(exc), repr(exc.args), repr(vars(exc)), *traceback.format_exception(exc)])


async def test_a_canary_key_appears_in_no_log_error_or_repr(
    openai_url: str,
    anthropic_url: str,
    gemini_url: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    canaries = {name: f"sk-canary-{secrets.token_hex(16)}" for name in ("openai", "anthropic", "gemini")}
    for variable, name in (
        ("OPENAI_API_KEY", "openai"),
        ("ANTHROPIC_API_KEY", "anthropic"),
        ("GEMINI_API_KEY", "gemini"),
    ):
        monkeypatch.setenv(variable, canaries[name])
    caplog.set_level(logging.DEBUG)
    for logger in ("httpx", "httpcore", "sluice"):
        caplog.set_level(logging.DEBUG, logger=logger)
    providers: list[tuple[str, HTTPProvider]] = [
        ("openai", OpenAIProvider(base_url=f"{openai_url}/v1", api_key_env="OPENAI_API_KEY", timeout=0.3)),
        ("anthropic", AnthropicProvider(base_url=anthropic_url, timeout=0.3)),
        ("gemini", GeminiProvider(base_url=gemini_url, timeout=0.3)),
        (
            "openai",
            OpenAIProvider(
                base_url=f"http://127.0.0.1:{free_port()}/v1", api_key_env="OPENAI_API_KEY", timeout=0.3
            ),
        ),
    ]
    urls = {"openai": openai_url, "anthropic": anthropic_url, "gemini": gemini_url}
    said: list[str] = []
    raised: set[type[Exception]] = set()
    for name, provider in providers:
        said += [repr(provider), str(provider)]
        await script(
            urls[name],
            {"status": 429, "retry_after_ms": 50},
            {"status": 500},
            {"delay": 1.0},
            {"status": 404},
        )
        async with provider:
            assert isinstance(provider, OpenAIProvider | AnthropicProvider | GeminiProvider)
            # Four scripted faults, then the servers' own refusal of the canary (a wrong key).
            for _ in range(5):
                with pytest.raises((ProviderError, ProviderRejected, ProviderThrottled)) as caught:
                    await provider.complete(CHAT, model=MODELS[name], max_tokens=5)
                raised.add(type(caught.value))
                said.append(_everything_said_about(caught.value))
            with pytest.raises((ProviderError, ProviderRejected)) as caught_embed:
                await provider.embed(["text"], model=EMBEDDING_MODEL)
            said.append(_everything_said_about(caught_embed.value))
    with pytest.raises(ConfigurationError) as config:
        OpenAIProvider(env={"OPENAI_API_KEY": canaries["openai"] + " trailing words"})
    said.append(_everything_said_about(config.value))
    logged = [caplog.text, *(r.getMessage() for r in caplog.records), *(repr(r.args) for r in caplog.records)]
    for canary in canaries.values():
        for text in said + logged:
            assert canary not in text
    # The test saw what it should: every kind of failure, the wire logged, the echo redacted.
    assert raised == {ProviderThrottled, ProviderUnavailable, ProviderRejected}
    assert any(r.name.startswith("httpcore") for r in caplog.records)
    assert any(r.name == "httpx" for r in caplog.records)
    assert any("[redacted]" in text for text in said)
