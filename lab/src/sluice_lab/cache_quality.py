"""How well the semantic cache tells "the same question" from "almost the same question".

The labelled set (``data/cache_pairs.json``, written for Sluice) holds pairs
of prompts: paraphrases, which should share an answer; near misses that
differ in one detail an embedding blurs (numbers, currencies, units, dates,
names, negation, roles, output language, format, length, programming
language), which must not; and ``related`` pairs, same topic but another
question, which must not either. ``data/cache_pairs_holdout.json`` was
written after the guards were frozen, to see how they do on prompts they
were not tuned on.

For each pair: the cosine similarity of the two embeddings and the guards
that veto it. A pair "hits" at a threshold when its similarity reaches the
threshold and (with guards) no guard vetoes it. Reported per threshold:
the share of paraphrases that hit (calls a cache saves) and the share of
near misses and related pairs that hit (wrong answers served), with and
without the guards; and per guard, what it vetoed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.llm import guards
from sluice.llm.embedder import LocalEmbedder

DATA = Path(__file__).parent / "data"
SETS = ("cache_pairs", "cache_pairs_holdout")
THRESHOLDS = (0.80, 0.84, 0.86, 0.88, 0.90, 0.92, 0.94, 0.96)
#: kinds that are neither paraphrases nor ``related``: one detail changed
PARAPHRASE, RELATED = "paraphrase", "related"


@dataclass(frozen=True, slots=True)
class Pair:
    a: str
    b: str
    same: bool
    kind: str


@dataclass(frozen=True, slots=True)
class Scored:
    pair: Pair
    similarity: float
    vetoes: tuple[str, ...]

    def hits(self, threshold: float, *, use_guards: bool = True) -> bool:
        return self.similarity >= threshold and not (use_guards and self.vetoes)


def load_pairs(name: str = "cache_pairs") -> list[Pair]:
    """A labelled set by name (one of :data:`SETS`)."""
    raw: list[dict[str, Any]] = json.loads((DATA / f"{name}.json").read_text())
    return [Pair(p["a"], p["b"], bool(p["same"]), str(p["kind"])) for p in raw]


def score(pairs: Sequence[Pair], embedder: LocalEmbedder | None = None) -> list[Scored]:
    """Similarity and vetoes of every pair (embedded in batches, on this thread)."""
    embedder = embedder or LocalEmbedder()
    texts = [t for p in pairs for t in (p.a, p.b)]
    vectors: list[list[float]] = []
    for start in range(0, len(texts), 64):
        vectors += embedder.embed_sync(texts[start : start + 64])
    out = []
    for i, pair in enumerate(pairs):
        va, vb = vectors[2 * i], vectors[2 * i + 1]
        similarity = sum(x * y for x, y in zip(va, vb, strict=True))
        out.append(Scored(pair, similarity, tuple(guards.check(pair.a, pair.b))))
    return out


def _share(scored: Sequence[Scored], threshold: float, use_guards: bool) -> float | None:
    if not scored:
        return None
    return sum(s.hits(threshold, use_guards=use_guards) for s in scored) / len(scored)


def rates(scored: Sequence[Scored], thresholds: Sequence[float] = THRESHOLDS) -> list[dict[str, Any]]:
    """Per threshold: paraphrase hit rate and false-hit rates (near misses, related), without and
    with guards, and the near misses' false hits by kind (with guards)."""
    paraphrases = [s for s in scored if s.pair.kind == PARAPHRASE]
    details = [s for s in scored if not s.pair.same and s.pair.kind != RELATED]
    related = [s for s in scored if s.pair.kind == RELATED]
    kinds = sorted({s.pair.kind for s in details})
    rows = []
    for t in thresholds:
        rows.append(
            {
                "threshold": t,
                "paraphrase_hit": _share(paraphrases, t, False),
                "paraphrase_hit_guarded": _share(paraphrases, t, True),
                "near_miss_false_hit": _share(details, t, False),
                "near_miss_false_hit_guarded": _share(details, t, True),
                "related_false_hit": _share(related, t, False),
                "related_false_hit_guarded": _share(related, t, True),
                "false_hit_by_kind": {
                    k: _share([s for s in details if s.pair.kind == k], t, False) for k in kinds
                },
            }
        )
    return rows


def guard_effect(scored: Sequence[Scored]) -> list[dict[str, Any]]:
    """Per guard: near misses it vetoed (alone, and by kind) and paraphrases it wrongly vetoed."""
    rows = []
    for name in guards.GUARDS:
        vetoed = [s for s in scored if name in s.vetoes]
        wrong = [s for s in vetoed if s.pair.same]
        caught = [s for s in vetoed if not s.pair.same]
        rows.append(
            {
                "guard": name,
                "near_misses_vetoed": len(caught),
                "only_guard": sum(s.vetoes == (name,) for s in caught),
                "by_kind": dict(Counter(s.pair.kind for s in caught)),
                "paraphrases_wrongly_vetoed": len(wrong),
            }
        )
    return rows
