"""How the semantic cache answers: the similarity threshold, the entries' TTL, the guards, the
judge's margin, single flight's wait (:class:`CachePolicy`), from the environment or in code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.errors import ConfigurationError
from sluice.settings import environment

#: The issue's defaults, and ArQueue's variable names for them.
DEFAULT_THRESHOLD = 0.92
DEFAULT_TTL_MS = 24 * 3600 * 1000
ENV_THRESHOLD = ("SLUICE_CACHE_SIMILARITY_THRESHOLD", "CACHE_SIMILARITY_THRESHOLD")
ENV_TTL_MS = ("SLUICE_CACHE_TTL_MS", "CACHE_TTL_MS")


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How the cache answers. ``threshold``: the least cosine similarity of a hit.
    ``guards``: veto hits whose prompts differ in a fact (on by default; off only to measure).
    ``judge_margin``: with a judge, candidates within this much below the threshold are
    put to it. ``flight_wait``: seconds a caller waits for another process's identical call
    before making its own."""

    threshold: float = DEFAULT_THRESHOLD
    ttl_ms: int = DEFAULT_TTL_MS
    guards: bool = True
    candidates: int = 5
    judge_margin: float = 0.05
    flight_wait: float = 120.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and 0.0 < self.threshold <= 1.0):
            raise ConfigurationError(
                f"the cache's similarity threshold must be in (0, 1], got {self.threshold!r}"
            )
        if isinstance(self.ttl_ms, bool) or not isinstance(self.ttl_ms, int) or self.ttl_ms < 1:
            raise ConfigurationError(
                f"the cache's TTL must be a whole number of ms >= 1, got {self.ttl_ms!r}"
            )
        if not 1 <= self.candidates <= 100:
            raise ConfigurationError(f"candidates must be 1 to 100, got {self.candidates!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> CachePolicy:
        """``CACHE_SIMILARITY_THRESHOLD`` and ``CACHE_TTL_MS`` (or ``SLUICE_``-prefixed)."""
        env = environment() if env is None else env
        values: dict[str, Any] = {}
        for names, key, kind in ((ENV_THRESHOLD, "threshold", float), (ENV_TTL_MS, "ttl_ms", int)):
            for name in names:
                raw = env.get(name)
                if raw is None or not raw.strip():
                    continue
                try:
                    values[key] = kind(raw)
                except ValueError:
                    raise ConfigurationError(
                        f"{name}={raw!r} is not a {'number' if kind is float else 'whole number'}"
                    ) from None
                break
        return cls(**{**values, **overrides})
