"""Anthropic's Messages API: ``POST {base}/v1/messages``.

Its differences from OpenAI's protocol, translated here: the system prompt is a top-level
``system`` field, not a message; ``max_tokens`` is required; the key goes in ``x-api-key``
with an ``anthropic-version``; and ``usage.input_tokens`` leaves out the tokens the prompt
cache read or wrote, which are reported apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from sluice.llm.http import DEFAULT_MAX_CONNECTIONS, HTTPProvider, check_base_url, cost_of
from sluice.llm.keys import read_key
from sluice.llm.provider import Completion, Embeddings, Message, ProviderRejected, Usage
from sluice.settings import environment

DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_KEY_ENV = "ANTHROPIC_API_KEY"
API_VERSION = "2023-06-01"


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def anthropic_usage(data: Mapping[str, Any]) -> Usage:
    """Usage of a Messages answer. Every input token counts as a prompt token: the uncached
    ``input_tokens``, those written to the cache and those read from it (``cached_tokens``).
    An answer without ``usage`` (a proxy that drops it) gives ``reported=False``: unknown, not zero."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return Usage(reported=False)
    read = _int(usage.get("cache_read_input_tokens"))
    written = _int(usage.get("cache_creation_input_tokens"))
    prompt = _int(usage.get("input_tokens")) + written + read
    return Usage(prompt, _int(usage.get("output_tokens")), read, cache_write_tokens=written)


class AnthropicProvider(HTTPProvider):
    """Claude through Anthropic's Messages API.

    The key is read from the variable ``api_key_env`` of ``env`` (default: the process
    environment) when the provider is built; a missing key is a ConfigurationError then.
    Anthropic offers no idempotency keys, so ``idempotency_key`` is not sent.
    """

    def __init__(
        self,
        *,
        base_url: str = DEFAULT_BASE_URL,
        api_key_env: str = DEFAULT_KEY_ENV,
        env: Mapping[str, str] | None = None,
        default_model: str | None = None,
        timeout: float | httpx.Timeout | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        key_hint: str = "",
    ) -> None:
        name = "anthropic"
        key, key_env = read_key(
            environment() if env is None else env, [api_key_env], provider=name, required=True, hint=key_hint
        )
        assert key is not None
        super().__init__(
            name=name,
            base_url=check_base_url(name, base_url),
            headers={"x-api-key": key.reveal(), "anthropic-version": API_VERSION},
            key=key,
            key_env=key_env,
            default_model=default_model,
            timeout=timeout,
            max_connections=max_connections,
        )

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str,
        max_tokens: int,
        temperature: float | None = None,
        idempotency_key: str | None = None,
    ) -> Completion:
        system = [m["content"] for m in messages if m["role"] == "system"]
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [
                {"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"
            ],
        }
        if system:
            body["system"] = "\n\n".join(system)
        if temperature is not None:
            body["temperature"] = temperature
        path = "/v1/messages"
        data, limits = await self.post(path, body, model=model)
        blocks = data.get("content")
        if not isinstance(blocks, list):
            raise self.unexpected(path, "it has no 'content'")
        text = "".join(
            b["text"]
            for b in blocks
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
        usage = anthropic_usage(data)
        reported = data.get("model") if isinstance(data.get("model"), str) else None
        return Completion(
            text=text,
            model=reported or model,
            provider=self.name,
            usage=usage,
            cost=cost_of(self.name, reported, model, usage),
            finish_reason=data.get("stop_reason") if isinstance(data.get("stop_reason"), str) else None,
            response_id=data.get("id") if isinstance(data.get("id"), str) else None,
            limits=limits,
        )

    async def embed(self, texts: Sequence[str], *, model: str, dimensions: int | None = None) -> Embeddings:
        raise ProviderRejected(
            self.name,
            "Anthropic has no embeddings endpoint: embed with another provider (OpenAI's "
            "text-embedding-3-small, Gemini's embedding models, Voyage AI as Anthropic suggests, "
            "or a local model through Ollama) and keep Anthropic for completions",
            kind="unsupported",
        )
