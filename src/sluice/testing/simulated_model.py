"""The simulated model: how the simulated providers count tokens, and their embeddings.

Prompt tokens are a quarter of the characters of every message's content, rounded up (the
usual rule of thumb; clients import the same function, as they would use the provider's
tokenizer). Embeddings are a hashed bag of words, normalized: deterministic, and texts sharing
words are close.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any

#: Characters per token of the simulated tokenizer (OpenAI's rule of thumb for English).
CHARS_PER_TOKEN = 4


def count_prompt_tokens(messages: Sequence[Any]) -> int:
    """Prompt tokens of ``messages`` as the provider counts them: ceil(characters / 4), at least 1.

    Only string ``content`` counts; roles and message framing are free here.
    """
    chars = sum(
        len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
    )
    return max(1, -(-chars // CHARS_PER_TOKEN))


def count_text_tokens(texts: Sequence[str]) -> int:
    """Tokens of plain texts (a system prompt and message bodies) by the same rule."""
    return count_prompt_tokens([{"content": t} for t in texts])


_WORD = re.compile(r"\w+")


def hashed_embedding(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for ``text``: its words hashed into ``dimensions`` signed buckets.

    The same text always gives the same vector (in any process: blake2b, not ``hash``), and
    texts sharing words have a high cosine similarity, which is what a semantic cache's tests need.
    """
    vector = [0.0] * dimensions
    for word in _WORD.findall(text.lower()):
        digest = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
        vector[digest % dimensions] += 1.0 if digest >> 63 else -1.0
    norm = math.sqrt(sum(v * v for v in vector))
    if norm == 0.0:
        vector[0] = 1.0
        return vector
    return [v / norm for v in vector]
