"""OpenAI, and every server that speaks its protocol (Ollama, vLLM, LM Studio, OpenRouter, ...).

``POST {base}/chat/completions`` and ``POST {base}/embeddings``, over httpx: the official SDK
is not needed for two calls, and this way every compatible server is served by one class
(``OpenAIProvider(base_url="http://localhost:11434/v1")`` is Ollama, which wants no key).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from sluice.llm.http import DEFAULT_MAX_CONNECTIONS, HTTPProvider, check_base_url, cost_of
from sluice.llm.keys import read_key
from sluice.llm.provider import Completion, Embeddings, Message, Usage
from sluice.settings import environment

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_KEY_ENV = "OPENAI_API_KEY"
#: OpenAI's own header for a client's id of a request (it has no idempotency keys): at most
#: 512 printable ASCII characters, or OpenAI refuses the request.
REQUEST_ID_HEADER = "X-Client-Request-Id"
#: Inputs per embeddings request (OpenAI's limit); more are sent in several requests.
MAX_EMBEDDING_INPUTS = 2048
#: OpenAI's models that refuse ``max_tokens`` ("Unsupported parameter") and want
#: ``max_completion_tokens``: the reasoning o-series (o1, o3, o4-mini, dated or not) and the gpt-5
#: family (gpt-5, gpt-5-mini, gpt-5.1, ...); a fine-tune's ``ft:`` prefix is looked through.
_COMPLETION_TOKENS_MODELS = re.compile(r"(?:ft:)?(?:o[1-9][0-9]*|gpt-5)(?:[-.:].*)?", re.IGNORECASE)
_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")


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
    ``prompt_tokens_details.cached_tokens``) and ``completion_tokens`` (reasoning included).
    An answer without ``usage`` (absent or null, as some proxies and servers send) gives
    ``reported=False``: its tokens are unknown, not zero."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return Usage(reported=False)
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
    ``max_tokens_field``: the request field that carries the output limit. OpenAI's reasoning
    models (o-series, gpt-5) refuse ``max_tokens`` and want ``max_completion_tokens``, while
    compatible servers (Ollama, vLLM, ...) and OpenAI's other models take ``max_tokens``; left
    at None, :meth:`max_tokens_field_for` chooses per call from the model's name when this
    provider is OpenAI's (``name="openai"``, whatever its base URL: a proxy in front of
    OpenAI takes the same fields), and ``max_tokens`` for any other name.
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
        max_tokens_field: str | None = None,
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
        if max_tokens_field is not None and max_tokens_field not in _MAX_TOKENS_FIELDS:
            raise ValueError("max_tokens_field must be 'max_tokens', 'max_completion_tokens' or None")
        self._max_tokens_field = max_tokens_field

    def max_tokens_field_for(self, model: str) -> str:
        """The field the output limit of a request for ``model`` goes in: the one given to the
        constructor, else ``max_completion_tokens`` for OpenAI's o-series and gpt-5 models at
        OpenAI (they refuse ``max_tokens``), else ``max_tokens`` (what every compatible server
        and OpenAI's other models take)."""
        if self._max_tokens_field is not None:
            return self._max_tokens_field
        if self.name == "openai" and _COMPLETION_TOKENS_MODELS.fullmatch(model.strip()):
            return "max_completion_tokens"
        return "max_tokens"

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
            self.max_tokens_field_for(model): max_tokens,
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
        usage_reported = True  # by every batch's answer
        reported: str | None = None
        path = "/embeddings"
        for start in range(0, len(texts), MAX_EMBEDDING_INPUTS):
            batch = list(texts[start : start + MAX_EMBEDDING_INPUTS])
            body: dict[str, Any] = {"model": model, "input": batch}
            if dimensions is not None:
                body["dimensions"] = dimensions
            data, _ = await self.post(path, body, model=model, paced=False)
            items = data.get("data")
            if not isinstance(items, list) or len(items) != len(batch):
                raise self.unexpected(path, f"it does not hold {len(batch)} embeddings in 'data'")
            ordered = sorted(items, key=lambda item: item.get("index", 0) if isinstance(item, dict) else 0)
            for item in ordered:
                vector = item.get("embedding") if isinstance(item, dict) else None
                if not isinstance(vector, list) or not all(isinstance(x, int | float) for x in vector):
                    raise self.unexpected(path, "an embedding is not a list of numbers")
                vectors.append([float(x) for x in vector])
            batch_usage = openai_usage(data)
            prompt_tokens += batch_usage.prompt_tokens
            usage_reported = usage_reported and batch_usage.reported
            reported = data.get("model") if isinstance(data.get("model"), str) else reported
        usage = Usage(prompt_tokens=prompt_tokens, reported=usage_reported)
        return Embeddings(
            vectors=vectors,
            model=reported or model,
            provider=self.name,
            usage=usage,
            cost=cost_of(self.name, reported, model, usage),
        )
