"""``sluice bench cache``: what the semantic cache saves, what it gets wrong, and how fast it looks up.

Three parts, against a real PostgreSQL with pgvector and the real local
embedder:

* **quality** (:mod:`sluice_lab.cache_quality`): on the shipped labelled
  set, per threshold, the paraphrases that hit and the near misses and
  related questions that would be served a wrong answer, with and without
  the guards; and what each guard vetoed;
* **workload**: every prompt of the set asked ``1 + repeats`` times and its
  pair's other prompt once, in a shuffled order, through
  :meth:`SemanticCache.through` with a stand-in provider that answers each
  prompt with an answer naming it. A served answer is *correct* when it was
  made for the same prompt or for a paraphrase of it, and a *false hit*
  otherwise. Reported: calls, tokens and money saved (tokens counted with
  the model's tokenizer, money at its list price), false hits;
* **lookup latency** with ``sizes`` entries in one tenant and scope (the
  worst case: the index search is not narrowed by a partition): filler
  entries whose vectors blend two of the set's prompts with noise (see
  :data:`FILLER_NOISE`), then the set's prompts stored for real,
  then ``lookups`` lookups of the set's prompts, timed whole and with the
  embedder's share apart; the HNSW answer's recall against an exact scan.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sluice.llm.cache import SemanticCache
from sluice.llm.cache_keys import cache_scope, prompt_hash
from sluice.llm.cache_policy import DEFAULT_THRESHOLD, CachePolicy
from sluice.llm.embedder import LocalEmbedder
from sluice.llm.pricing import cost
from sluice.llm.provider import Usage
from sluice.llm.tokens import count_prompt_tokens
from sluice.store.database import Database
from sluice_lab.cache_quality import DATA, Pair, guard_effect, load_pairs, rates, score

Progress = Callable[[str], None]
TENANT = "bench"


@dataclass(frozen=True, slots=True)
class CacheBenchSpec:
    sizes: tuple[int, ...] = (10_000, 100_000)
    lookups: int = 500
    repeats: int = 1
    threshold: float = DEFAULT_THRESHOLD
    provider: str = "openai"
    model: str = "gpt-4o-mini"
    #: output tokens each answer is taken to cost (the saved call's completion)
    completion_tokens: int = 200
    seed: int = 7

    def __post_init__(self) -> None:
        if not self.sizes or any(n < 0 for n in self.sizes):
            raise ValueError("sizes must be entry counts >= 0")
        if self.lookups < 1 or self.repeats < 0:
            raise ValueError("lookups must be >= 1 and repeats >= 0")


class _TimedEmbedder:
    """The local embedder, with the time its calls took (the lookup's share that is not the store)."""

    def __init__(self, inner: LocalEmbedder) -> None:
        self.inner = inner
        self.model = inner.model
        self.dimensions = inner.dimensions
        self.seconds = 0.0

    def covers(self, text: str) -> bool:
        return self.inner.covers(text)

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        started = time.perf_counter()
        try:
            return await self.inner.embed(texts)
        finally:
            self.seconds += time.perf_counter() - started


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {
        "p50_ms": at(0.50),
        "p95_ms": at(0.95),
        "p99_ms": at(0.99),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


async def run_cache_bench(db: Database, spec: CacheBenchSpec, progress: Progress) -> dict[str, Any]:
    embedder = LocalEmbedder()
    progress("quality: embedding the labelled pairs")
    quality = {}
    for name in ("cache_pairs", "cache_pairs_holdout"):
        scored = score(load_pairs(name), embedder)
        quality[name] = {"rates": rates(scored), "guards": guard_effect(scored)}
    progress("workload: repeated and paraphrased prompts")
    workload = await _workload(db, embedder, spec)
    latency = []
    for size in spec.sizes:
        progress(f"lookup latency: {size:,} entries")
        latency.append(await _latency(db, embedder, spec, size, progress))
    return {"spec": asdict(spec), "quality": quality, "workload": workload, "latency": latency}


async def _clear(db: Database) -> None:
    async with db.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        await raw.execute("TRUNCATE llm_cache")


async def _workload(db: Database, embedder: LocalEmbedder, spec: CacheBenchSpec) -> dict[str, Any]:
    await _clear(db)
    pairs = load_pairs("cache_pairs")
    cluster = _paraphrase_clusters(pairs)
    kind_of = {(p.a, p.b): p.kind for p in pairs} | {(p.b, p.a): p.kind for p in pairs}
    asks = [p.a for p in pairs for _ in range(1 + spec.repeats)] + [p.b for p in pairs]
    random.Random(spec.seed).shuffle(asks)
    cache = SemanticCache(db, embedder, policy=CachePolicy(threshold=spec.threshold))
    scope = cache_scope(spec.provider, spec.model, params={"max_tokens": spec.completion_tokens})
    calls = 0
    exact = similar = 0
    false_hits: list[dict[str, Any]] = []
    tokens_saved = 0
    money_saved = 0.0
    for asked in asks:

        async def call(prompt: str = asked) -> dict[str, Any]:
            nonlocal calls
            calls += 1
            return {"response": f"answer to: {prompt}", "source": prompt}

        response, hit = await cache.through(TENANT, scope, asked, call)
        if hit is None:
            continue
        source = response["source"]
        if source == asked:
            exact += 1
        elif cluster[asked] == cluster[source]:
            similar += 1
        else:
            false_hits.append(
                {
                    "asked": asked,
                    "served_for": source,
                    "similarity": round(hit.similarity, 4),
                    "kind": kind_of.get((asked, source), "unlabelled"),
                }
            )
        prompt_tokens = count_prompt_tokens(asked, provider=spec.provider, model=spec.model)
        tokens_saved += prompt_tokens + spec.completion_tokens
        money_saved += cost(spec.provider, spec.model, Usage(prompt_tokens, spec.completion_tokens)) or 0.0
    await cache.aclose()
    requests = len(asks)
    hits = exact + similar + len(false_hits)
    return {
        "requests": requests,
        "provider_calls": calls,
        "calls_saved": hits,
        "calls_saved_share": round(hits / requests, 4),
        "exact_hits": exact,
        "paraphrase_hits": similar,
        "false_hits": len(false_hits),
        "false_hit_share_of_requests": round(len(false_hits) / requests, 4),
        "false_hit_share_of_hits": round(len(false_hits) / hits, 4) if hits else 0.0,
        "false_hits_by_kind": dict(Counter(f["kind"] for f in false_hits)),
        "false_hit_examples": false_hits[:50],
        "tokens_saved": tokens_saved,
        "money_saved_usd": round(money_saved, 6),
        "priced_at": f"{spec.provider}/{spec.model}",
        "threshold": spec.threshold,
        "repeats": spec.repeats,
    }


def _paraphrase_clusters(pairs: Sequence[Pair]) -> dict[str, str]:
    """Each prompt's paraphrase class (a representative): a prompt may appear in several pairs,
    and two paraphrases of a third are paraphrases of each other. Anything served across two
    classes is a false hit, labelled as a near miss or not."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in pairs:
        find(p.a)
        find(p.b)
        if p.same:
            parent[find(p.a)] = find(p.b)
    for a, b in equivalents():
        if a in parent and b in parent:
            parent[find(a)] = find(b)
    return {x: find(x) for x in parent}


def equivalents() -> list[tuple[str, str]]:
    """Prompts of different pairs that ask the same thing (``data/cache_equivalents.json``)."""
    raw: dict[str, Any] = json.loads((DATA / "cache_equivalents.json").read_text())
    return [(a, b) for a, b in raw["same"]]


#: How far filler vectors stand from the real prompts they are made of: far enough that none is
#: a hit for a real prompt (their highest similarity to one is reported), near enough that the
#: index holds one neighbourhood of prompts as a real cache does, not uniform noise (which
#: no search can walk: every random point is at the same distance from every query).
FILLER_NOISE = 0.9


async def _fill(db: Database, size: int, anchors: Any, embedder_model: str, seed: int) -> tuple[float, float]:
    """``size`` filler entries, each a blend of two real prompts' vectors and noise; the HNSW
    index built after them. Returns (seconds taken, the fillers' highest similarity to a real
    prompt)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    dimensions = anchors.shape[1]
    highest = -1.0
    scope = cache_scope("openai", "gpt-4o-mini", params={"max_tokens": 200})
    started = time.perf_counter()
    async with db.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        await raw.execute("TRUNCATE llm_cache")
        await raw.execute("DROP INDEX IF EXISTS ix_llm_cache_embedding")
        for start in range(0, size, 5000):
            n = min(5000, size - start)
            picks = rng.integers(0, len(anchors), size=(n, 2))
            weights = rng.uniform(0.3, 0.7, size=(n, 1)).astype(np.float32)
            noise = rng.standard_normal((n, dimensions)).astype(np.float32)
            noise *= FILLER_NOISE / np.linalg.norm(noise, axis=1, keepdims=True)
            vectors = weights * anchors[picks[:, 0]] + (1 - weights) * anchors[picks[:, 1]] + noise
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            highest = max(highest, float((vectors @ anchors.T).max()))
            texts = ["[" + ",".join(f"{x:.6g}" for x in row) + "]" for row in vectors]
            prompts = [f"filler prompt {start + i}" for i in range(n)]
            await raw.execute(
                """
                INSERT INTO llm_cache (tenant, scope, prompt_hash, prompt, embedder, embedding, response,
                                       created_at, expires_at)
                SELECT $1, $2, h, p, $3, e::vector, '{"response": "filler"}'::jsonb,
                       now(), now() + interval '1 day'
                FROM unnest($4::text[], $5::text[], $6::text[]) AS t(h, p, e)
                """,
                TENANT,
                scope,
                embedder_model,
                [prompt_hash(p) for p in prompts],
                prompts,
                texts,
            )
        await raw.execute("SET maintenance_work_mem = '512MB'")
        await raw.execute(
            "CREATE INDEX ix_llm_cache_embedding ON llm_cache USING hnsw (embedding vector_cosine_ops) "
            "WITH (m = 16, ef_construction = 64)"
        )
        await raw.execute("ANALYZE llm_cache")
    return time.perf_counter() - started, highest


async def _latency(
    db: Database, embedder: LocalEmbedder, spec: CacheBenchSpec, size: int, progress: Progress
) -> dict[str, Any]:
    import numpy as np

    pairs: list[Pair] = load_pairs("cache_pairs")
    anchors = np.array(
        [
            v
            for start in range(0, len(pairs), 64)
            for v in embedder.embed_sync([p.a for p in pairs[start : start + 64]])
        ],
        dtype=np.float32,
    )
    build_s, filler_highest = await _fill(db, size, anchors, embedder.model, spec.seed)
    timed = _TimedEmbedder(embedder)
    cache = SemanticCache(db, timed, policy=CachePolicy(threshold=spec.threshold))
    scope = cache_scope("openai", "gpt-4o-mini", params={"max_tokens": 200})
    for p in pairs:  # the set's first prompts, stored for real: lookups of the others find them
        await cache.store(TENANT, scope, p.a, {"response": f"answer to: {p.a}"})
    asks = [p.b for p in pairs] + [p.a for p in pairs]
    random.Random(spec.seed).shuffle(asks)
    asks = (asks * (spec.lookups // len(asks) + 1))[: spec.lookups]
    whole: list[float] = []
    store_only: list[float] = []
    hits = 0
    for asked in asks:
        before = timed.seconds
        started = time.perf_counter()
        found = await cache.lookup(TENANT, scope, asked)
        elapsed = time.perf_counter() - started
        whole.append(elapsed)
        store_only.append(elapsed - (timed.seconds - before))
        hits += found.hit is not None
    await cache.aclose()
    recall = await _recall(db, embedder, scope, [p.b for p in pairs[:100]])
    progress(f"lookup latency: {size:,} entries done")
    return {
        "entries": size + len(pairs),
        "index_build_s": round(build_s, 2),
        "filler_highest_similarity_to_a_prompt": round(filler_highest, 4),
        "lookups": len(asks),
        "hits": hits,
        "lookup": _percentiles(whole),
        "lookup_without_embedding": _percentiles(store_only),
        "recall_at_1": recall,
    }


async def _recall(db: Database, embedder: LocalEmbedder, scope: str, prompts: list[str]) -> float:
    """Share of prompts whose nearest entry by the HNSW index is the exact scan's nearest."""
    vectors = embedder.embed_sync(prompts)
    same = 0
    query = (
        "SELECT id FROM llm_cache WHERE tenant = $1 AND scope = $2 ORDER BY embedding <=> $3::vector LIMIT 1"
    )
    async with db.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        for vector in vectors:
            text = "[" + ",".join(f"{x:.7g}" for x in vector) + "]"
            async with raw.transaction():
                await raw.execute("SET LOCAL hnsw.ef_search = 100")
                by_index = await raw.fetchval(query, TENANT, scope, text)
            async with raw.transaction():
                await raw.execute("SET LOCAL enable_indexscan = off")
                exact = await raw.fetchval(query, TENANT, scope, text)
            same += by_index == exact
    return round(same / len(vectors), 4)
