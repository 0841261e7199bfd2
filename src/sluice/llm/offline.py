"""The offline model: what ``llm-inference`` jobs answer with when no provider is configured.

``sluice dev`` must work on a machine with no API key and no network, so the
built-in job type falls back to this: a deterministic "model" that echoes
the start of the prompt, takes a little time per output token like a real
one, and reports usage the way providers do. Every answer says
``provider: "offline"``, so nobody mistakes it for a model's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sluice.llm.provider import Completion, Embeddings, Message, ProviderRejected, Usage
from sluice.llm.tokens import estimate_prompt_tokens

#: A real model's pace, roughly: a base latency and seconds per output token.
BASE_SECONDS = 0.05
SECONDS_PER_TOKEN = 0.0005


class OfflineProvider:
    """A deterministic stand-in for a model (no network, no key)."""

    name = "offline"

    def __init__(
        self, *, base_seconds: float = BASE_SECONDS, seconds_per_token: float = SECONDS_PER_TOKEN
    ) -> None:
        self.base_seconds = base_seconds
        self.seconds_per_token = seconds_per_token

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str,
        max_tokens: int,
        temperature: float | None = None,
        idempotency_key: str | None = None,
    ) -> Completion:
        prompt = " ".join(m["content"] for m in messages if m["role"] == "user")
        completion = min(max_tokens, 16 + len(prompt) // 8)
        await asyncio.sleep(self.base_seconds + self.seconds_per_token * completion)
        words = prompt.split()
        return Completion(
            text=f"(offline model) {' '.join(words[:12])}",
            model=model,
            provider=self.name,
            usage=Usage(estimate_prompt_tokens(list(messages)), completion),
            cost=0.0,
            finish_reason="length" if completion == max_tokens else "stop",
        )

    async def embed(self, texts: Sequence[str], *, model: str, dimensions: int | None = None) -> Embeddings:
        raise ProviderRejected(
            self.name,
            "the offline model has no embeddings; the semantic cache uses the local embedder",
            kind="unsupported",
        )

    async def aclose(self) -> None:
        return None
