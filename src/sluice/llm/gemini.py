"""Google's Gemini API: ``generateContent`` and ``batchEmbedContents`` under ``/v1beta/models``.

Its differences, translated here: the assistant's role is ``model``; the system prompt is a
``systemInstruction``; the output limit is ``generationConfig.maxOutputTokens``; usage is
``usageMetadata``, where the prompt count includes the cached tokens and a thinking model's
thoughts are billed as output (``thoughtsTokenCount``, added to the completion tokens). The
key goes in the ``x-goog-api-key`` header, never in the URL, where logs would keep it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx

from sluice.llm.http import DEFAULT_MAX_CONNECTIONS, HTTPProvider, check_base_url, cost_of
from sluice.llm.keys import read_key
from sluice.llm.provider import Completion, Embeddings, Message, ProviderRejected, Usage
from sluice.settings import environment

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com"
#: Where the key is looked for, in order (Google's SDKs read the same two).
KEY_ENVS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")
#: Texts per batchEmbedContents request (Gemini's limit); more are sent in several requests.
MAX_EMBEDDING_BATCH = 100


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def gemini_usage(data: Mapping[str, Any]) -> Usage:
    """Usage of a generateContent answer (``usageMetadata``); ``reported=False`` when the answer
    has none (its tokens are unknown, not zero)."""
    meta = data.get("usageMetadata")
    if not isinstance(meta, dict):
        return Usage(reported=False)
    completion = _int(meta.get("candidatesTokenCount")) + _int(meta.get("thoughtsTokenCount"))
    return Usage(_int(meta.get("promptTokenCount")), completion, _int(meta.get("cachedContentTokenCount")))


def _model_path(model: str, method: str) -> str:
    name = model.removeprefix("models/")
    return f"/v1beta/models/{quote(name, safe='-._~')}:{method}"


def _text(candidate: Mapping[str, Any]) -> str:
    content = candidate.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    if not isinstance(parts, list):
        return ""
    # Parts marked "thought" are a thinking model's summaries of its reasoning, not the answer.
    return "".join(
        p["text"]
        for p in parts
        if isinstance(p, dict) and isinstance(p.get("text"), str) and not p.get("thought")
    )


class GeminiProvider(HTTPProvider):
    """Gemini through the Gemini API (Google AI Studio keys).

    The key is read from ``GEMINI_API_KEY``, else ``GOOGLE_API_KEY``, of ``env`` (default: the
    process environment) when the provider is built; a missing key is a ConfigurationError
    then. Gemini offers no idempotency keys, so ``idempotency_key`` is not sent.
    """

    def __init__(
        self,
        *,
        base_url: str = DEFAULT_BASE_URL,
        env: Mapping[str, str] | None = None,
        default_model: str | None = None,
        timeout: float | httpx.Timeout | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        key_hint: str = "",
    ) -> None:
        name = "gemini"
        key, key_env = read_key(
            environment() if env is None else env, KEY_ENVS, provider=name, required=True, hint=key_hint
        )
        assert key is not None
        super().__init__(
            name=name,
            base_url=check_base_url(name, base_url),
            headers={"x-goog-api-key": key.reveal()},
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
        config: dict[str, Any] = {"maxOutputTokens": max_tokens}
        if temperature is not None:
            config["temperature"] = temperature
        body: dict[str, Any] = {
            "contents": [
                {"role": "model" if m["role"] == "assistant" else "user", "parts": [{"text": m["content"]}]}
                for m in messages
                if m["role"] != "system"
            ],
            "generationConfig": config,
        }
        if system:
            body["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
        path = _model_path(model, "generateContent")
        data, limits = await self.post(path, body, model=model)
        candidates = data.get("candidates")
        if not isinstance(candidates, list) or not candidates or not isinstance(candidates[0], dict):
            feedback = data.get("promptFeedback")
            reason = feedback.get("blockReason") if isinstance(feedback, dict) else None
            if reason:
                raise ProviderRejected(
                    self.name,
                    f"Gemini blocked the prompt ({reason}); sending it again cannot help: change the "
                    "prompt, or the request's safetySettings",
                    status=200,
                    kind="request",
                )
            raise self.unexpected(path, "it has no 'candidates'")
        usage = gemini_usage(data)
        reported = data.get("modelVersion") if isinstance(data.get("modelVersion"), str) else None
        finish = candidates[0].get("finishReason")
        return Completion(
            text=_text(candidates[0]),
            model=reported or model,
            provider=self.name,
            usage=usage,
            cost=cost_of(self.name, reported, model, usage),
            finish_reason=finish if isinstance(finish, str) else None,
            response_id=data.get("responseId") if isinstance(data.get("responseId"), str) else None,
            limits=limits,
        )

    async def embed(self, texts: Sequence[str], *, model: str, dimensions: int | None = None) -> Embeddings:
        """Vectors from ``batchEmbedContents``. Gemini reports no usage for embeddings, so the
        usage is unreported zeros (``reported=False``) and the cost None (unknown), not a price
        of zero tokens."""
        name = model.removeprefix("models/")
        path = _model_path(name, "batchEmbedContents")
        vectors: list[list[float]] = []
        for start in range(0, len(texts), MAX_EMBEDDING_BATCH):
            batch = texts[start : start + MAX_EMBEDDING_BATCH]
            requests: list[dict[str, Any]] = [
                {"model": f"models/{name}", "content": {"parts": [{"text": t}]}} for t in batch
            ]
            if dimensions is not None:
                for request in requests:
                    request["outputDimensionality"] = dimensions
            data, _ = await self.post(path, {"requests": requests}, model=model, paced=False)
            embeddings = data.get("embeddings")
            if not isinstance(embeddings, list) or len(embeddings) != len(batch):
                raise self.unexpected(path, f"it does not hold {len(batch)} 'embeddings'")
            for item in embeddings:
                values = item.get("values") if isinstance(item, dict) else None
                if not isinstance(values, list) or not all(isinstance(x, int | float) for x in values):
                    raise self.unexpected(path, "an embedding's 'values' are not a list of numbers")
                vectors.append([float(x) for x in values])
        return Embeddings(
            vectors=vectors, model=name, provider=self.name, usage=Usage(reported=False), cost=None
        )
