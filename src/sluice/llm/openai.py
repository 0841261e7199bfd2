"""OpenAI, and every server that speaks its protocol (Ollama, vLLM, LM Studio, OpenRouter, ...).

``POST {base}/chat/completions`` and ``POST {base}/embeddings``, over httpx: the official SDK
is not needed for two calls, and this way every compatible server is served by one class
(``OpenAIProvider(base_url="http://localhost:11434/v1")`` is Ollama, which wants no key).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from sluice.llm.http import (
    DEFAULT_MAX_CONNECTIONS,
    HTTPProvider,
    check_base_url,
    cost_of,
    read_key,
)
from sluice.llm.provider import Completion, Embeddings, Message, Usage
from sluice.settings import environment

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_KEY_ENV = "OPENAI_API_KEY"
#: OpenAI's own header for a client's id of a request (it has no idempotency keys): at most
#: 512 printable ASCII characters, or OpenAI refuses the request.
REQUEST_ID_HEADER = "X-Client-Request-Id"
#: Inputs per embeddings request (OpenAI's limit); more are sent in several requests.
MAX_EMBEDDING_INPUTS = 2048


class _DefaultKeyEnv(str):
    """The default key variable: told apart from the same name given explicitly, because it is
    sent to api.openai.com only."""

    __slots__ = ()


_DEFAULT_KEY_ENV = _DefaultKeyEnv(DEFAULT_KEY_ENV)


def _request_id(key: str) -> str:
    if len(key) <= 512 and key.isascii() and key.isprintable():
        return key
    return hashlib.sha256(key.encode()).hexdigest()


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def openai_usage(data: Mapping[str, Any]) -> Usage:
    """Usage of an OpenAI answer: ``prompt_tokens`` (cached ones included, as
    ``prompt_tokens_details.cached_tokens``) and ``completion_tokens`` (reasoning included)."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return Usage()
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), cached)


class OpenAIProvider(HTTPProvider):
    """A provider speaking OpenAI's chat-completions and embeddings protocol.

    ``base_url``: the API root, ending in ``/v1`` for OpenAI and most compatible servers. The
    key is read from the variable ``api_key_env`` of ``env`` (default: the process
    environment) when the provider is built; it is required at ``api.openai.com`` and optional
    elsewhere (a local server wants none); ``api_key_env=None`` sends none. Left at its
    default, ``OPENAI_API_KEY`` goes to api.openai.com only, so that an OpenAI key never
    reaches another server by accident: name the variable to send one elsewhere. ``name`` is the
    provider's name in errors and for pricing (``ollama``, ``vllm``, ...).
    ``max_tokens_field``: OpenAI's reasoning models (o-series, gpt-5) refuse ``max_tokens``
    and want ``max_completion_tokens``; every compatible server accepts ``max_tokens``.
    """

    def __init__(
        self,
        *,
        base_url: str = DEFAULT_BASE_URL,
        api_key_env: str | None = _DEFAULT_KEY_ENV,
        env: Mapping[str, str] | None = None,
        name: str = "openai",
        default_model: str | None = None,
        timeout: float | httpx.Timeout | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_tokens_field: str = "max_tokens",
        key_hint: str = "",
    ) -> None:
        base_url = check_base_url(name, base_url)
        at_openai = httpx.URL(base_url).host == httpx.URL(DEFAULT_BASE_URL).host
        if api_key_env is _DEFAULT_KEY_ENV and not at_openai:
            api_key_env = None
        key, key_env = (None, None)
        if api_key_env is not None:
            key, key_env = read_key(
                environment() if env is None else env,
                [api_key_env],
                provider=name,
                required=at_openai,
                hint=key_hint,
            )
        headers = {"Authorization": f"Bearer {key.reveal()}"} if key is not None else {}
        super().__init__(
            name=name,
            base_url=base_url,
            headers=headers,
            key=key,
            key_env=key_env or api_key_env,
            default_model=default_model,
            timeout=timeout,
            max_connections=max_connections,
        )
        if max_tokens_field not in ("max_tokens", "max_completion_tokens"):
            raise ValueError("max_tokens_field must be 'max_tokens' or 'max_completion_tokens'")
        self._max_tokens_field = max_tokens_field

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str,
        max_tokens: int,
        temperature: float | None = None,
        idempotency_key: str | None = None,
    ) -> Completion:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            self._max_tokens_field: max_tokens,
        }
        if temperature is not None:
            body["temperature"] = temperature
        headers = {REQUEST_ID_HEADER: _request_id(idempotency_key)} if idempotency_key else None
        path = "/chat/completions"
        data, limits = await self.post(path, body, headers=headers, model=model)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self.unexpected(path, "it has no 'choices'")
        message = choices[0].get("message")
        content = message.get("content") if isinstance(message, dict) else None
        usage = openai_usage(data)
        reported = data.get("model") if isinstance(data.get("model"), str) else None
        return Completion(
            text=content if isinstance(content, str) else "",
            model=reported or model,
            provider=self.name,
            usage=usage,
            cost=cost_of(self.name, reported, model, usage),
            finish_reason=choices[0].get("finish_reason"),
            response_id=data.get("id") if isinstance(data.get("id"), str) else None,
            limits=limits,
        )

    async def embed(self, texts: Sequence[str], *, model: str, dimensions: int | None = None) -> Embeddings:
        vectors: list[list[float]] = []
        prompt_tokens = 0
        reported: str | None = None
        path = "/embeddings"
        for start in range(0, len(texts), MAX_EMBEDDING_INPUTS):
            batch = list(texts[start : start + MAX_EMBEDDING_INPUTS])
            body: dict[str, Any] = {"model": model, "input": batch}
            if dimensions is not None:
                body["dimensions"] = dimensions
            data, _ = await self.post(path, body, model=model)
            items = data.get("data")
            if not isinstance(items, list) or len(items) != len(batch):
                raise self.unexpected(path, f"it does not hold {len(batch)} embeddings in 'data'")
            ordered = sorted(items, key=lambda item: item.get("index", 0) if isinstance(item, dict) else 0)
            for item in ordered:
                vector = item.get("embedding") if isinstance(item, dict) else None
                if not isinstance(vector, list) or not all(isinstance(x, int | float) for x in vector):
                    raise self.unexpected(path, "an embedding is not a list of numbers")
                vectors.append([float(x) for x in vector])
            prompt_tokens += openai_usage(data).prompt_tokens
            reported = data.get("model") if isinstance(data.get("model"), str) else reported
        usage = Usage(prompt_tokens=prompt_tokens)
        return Embeddings(
            vectors=vectors,
            model=reported or model,
            provider=self.name,
            usage=usage,
            cost=cost_of(self.name, reported, model, usage),
        )
