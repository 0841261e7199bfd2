"""What a semantic cache entry is found by: its prompt, normalized and hashed (the exact path),
within a scope that hashes everything else the answer depends on.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

_WHITESPACE = re.compile(r"\s+")


def normalize(prompt: str) -> str:
    """The prompt as the exact path compares it: whitespace collapsed, nothing else (case and
    punctuation can change an answer: "US" is not "us")."""
    return _WHITESPACE.sub(" ", prompt).strip()


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(normalize(prompt).encode()).hexdigest()


def cache_scope(
    provider: str,
    model: str,
    *,
    context: Sequence[Mapping[str, Any]] = (),
    params: Mapping[str, Any] | None = None,
) -> str:
    """The partition an answer belongs to: provider, model, the messages before the prompt
    (a system prompt changes every answer) and the generation parameters (max_tokens,
    temperature, format...), hashed. Two requests share cache entries only if all of it is
    equal."""
    canonical = orjson.dumps(
        {"provider": provider, "model": model, "context": list(context), "params": dict(params or {})},
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.sha256(canonical).hexdigest()[:32]
