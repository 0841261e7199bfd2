"""The semantic cache: an answer given once is served again for the same question, asked again
or asked in other words, without paying the provider twice.

A lookup goes, cheapest first:

1. **exact**: the prompt (whitespace collapsed) hashed, found by a unique index;
2. **nearest**: the prompt embedded (:mod:`sluice.llm.embedder`), then the
   ``candidates`` nearest unexpired entries by cosine similarity (pgvector,
   HNSW index); the first one at or above ``threshold`` that the **guards**
   (:mod:`sluice.llm.guards`) do not veto is a hit;
3. optionally, a **judge** (a second stage: the provider itself, or any
   function) for the candidates just below the threshold.

A threshold alone serves wrong answers: an embedding puts "100 USD to EUR"
and "100 EUR to USD" at 0.97, and "in French" beside "in German". The
guards compare what embeddings blur (numbers, currencies and units with
their direction, dates, names, negation, requested language, format,
length, programming language, swapped roles) and veto the hit; on the
labelled set shipped in the tests they veto the false hits the threshold lets
through (``tests/llm/test_llm_cache_quality.py`` measures every layer).

Entries live in one tenant and one **scope** (:func:`cache_scope`: the
provider, model, generation parameters and the conversation before the last
message, hashed): no hit crosses a tenant or a model. They expire after
``ttl_ms`` and :meth:`SemanticCache.purge_expired` deletes them, in bounded
batches, on the service's schedule.

**Single flight**: concurrent identical misses make one provider call. In
one process they wait on the first caller's future; across processes the
first takes a Redis lock (``SET NX PX``) and the others poll the exact path
until its answer is stored or its lock lapses (a caller that died), then
try again themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson

from sluice.errors import ConfigurationError
from sluice.llm import guards
from sluice.llm.cache_keys import cache_scope, prompt_hash
from sluice.llm.cache_policy import CachePolicy
from sluice.store.database import HNSW_EF_SEARCH

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.llm.embedder import Embedder
    from sluice.store.database import Database

log = logging.getLogger("sluice.llm.cache")

# CachePolicy and cache_scope are cache_policy's and cache_keys': llm-inference imports them from here.
__all__ = ["EF_SEARCH", "CacheHit", "CachePolicy", "Judge", "Lookup", "SemanticCache", "cache_scope"]

#: HNSW candidates examined per lookup (pgvector's ``hnsw.ef_search``, set on the connections
#: of ``Database.raw_pool``): pgvector 0.6 filters by tenant and scope after the index scan, so
#: a larger list finds a scope's entries among other scopes' more often. Small scopes are read
#: exactly instead (the planner's choice).
EF_SEARCH = HNSW_EF_SEARCH

Judge = Callable[[str, str], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A served answer: the stored response, how similar its prompt was (1.0 when exact), and
    which entry. ``shared``: another caller's in-flight answer to the same prompt."""

    response: dict[str, Any]
    similarity: float
    exact: bool
    entry_id: int | None
    prompt: str
    shared: bool = False


@dataclass(slots=True)
class Lookup:
    """A lookup's answer: a hit, or what a miss computed already (the embedding, for storing)."""

    hit: CacheHit | None
    prompt_hash: str
    embedding: list[float] | None = None
    #: the prompt is longer than the embedder reads: only the exact path may serve it
    exact_only: bool = False
    #: the best candidate's similarity and the guards that vetoed it, for metrics and tests
    best_similarity: float | None = None
    vetoed_by: list[str] = field(default_factory=list)


def _vector_text(vector: Sequence[float]) -> str:
    return "[" + ",".join(f"{x:.7g}" for x in vector) + "]"


class SemanticCache:
    """The cache over the store's ``llm_cache`` table. ``redis`` (optional) makes single flight
    hold across processes; without it, within this process only."""

    def __init__(
        self,
        db: Database,
        embedder: Embedder,
        *,
        policy: CachePolicy | None = None,
        redis: Redis | None = None,
        prefix: str = "sluice",
        judge: Judge | None = None,
    ) -> None:
        self.db = db
        self.embedder = embedder
        self.policy = policy or CachePolicy()
        self.redis = redis
        self.judge = judge
        self._lock_prefix = f"{prefix}:llm-cache:flight:"
        self._flights: dict[tuple[str, str, str], asyncio.Future[CacheHit | dict[str, Any]]] = {}
        #: counters since start (what the benchmark and the metrics read)
        self.stats: dict[str, int] = {
            "exact_hits": 0,
            "similar_hits": 0,
            "shared": 0,
            "misses": 0,
            "vetoed": 0,
            "judged": 0,
            "stored": 0,
            "errors": 0,
            "too_long": 0,
        }

    # ---- reading --------------------------------------------------------------------------------------
    async def lookup(
        self, tenant: str, scope: str, prompt: str, *, policy: CachePolicy | None = None
    ) -> Lookup:
        """Exact, then nearest with guards (and the judge). A miss carries the embedding."""
        policy = policy or self.policy
        digest = prompt_hash(prompt)
        exact = await self._exact(tenant, scope, digest)
        if exact is not None:
            self.stats["exact_hits"] += 1
            return Lookup(exact, digest)
        if not self.embedder.covers(prompt):
            # The embedder reads the start of a long prompt only: two prompts with one long
            # opening (instructions, then different documents) would embed alike whatever
            # follows. Such a prompt is served by the exact path alone.
            self.stats["too_long"] += 1
            self.stats["misses"] += 1
            return Lookup(None, digest, exact_only=True)
        # Not holding a connection while the embedder works (milliseconds of CPU, in a thread).
        [embedding] = await self.embedder.embed([prompt])
        async with self._connection() as conn:
            rows = await conn.fetch(
                _NEAREST, tenant, scope, self.embedder.model, _vector_text(embedding), policy.candidates
            )
        found = Lookup(None, digest, embedding)
        for candidate in rows:
            similarity = 1.0 - float(candidate["distance"])
            if found.best_similarity is None:
                found.best_similarity = similarity
            lower = policy.threshold - (policy.judge_margin if self.judge is not None else 0.0)
            if similarity < lower:
                break
            vetoes = guards.check(prompt, candidate["prompt"]) if policy.guards else []
            if vetoes:
                found.vetoed_by = found.vetoed_by or vetoes
                self.stats["vetoed"] += 1
                continue
            if similarity < policy.threshold:
                assert self.judge is not None
                self.stats["judged"] += 1
                if not await self.judge(prompt, candidate["prompt"]):
                    continue
            self.stats["similar_hits"] += 1
            found.hit = CacheHit(
                orjson.loads(candidate["response"]), similarity, False, candidate["id"], candidate["prompt"]
            )
            return found
        self.stats["misses"] += 1
        return found

    async def _exact(self, tenant: str, scope: str, digest: str) -> CacheHit | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(_EXACT, tenant, scope, digest)
        if row is None:
            return None
        return CacheHit(orjson.loads(row["response"]), 1.0, True, row["id"], row["prompt"])

    # ---- writing --------------------------------------------------------------------------------------
    async def store(
        self,
        tenant: str,
        scope: str,
        prompt: str,
        response: Mapping[str, Any],
        *,
        embedding: Sequence[float] | None = None,
        ttl_ms: int | None = None,
    ) -> int:
        """Keep ``response`` for ``prompt`` (replacing an entry of the same prompt); its id.

        A prompt longer than the embedder reads is kept under the embedder's name with
        ``#exact`` added: the nearest-neighbour search (which asks for the embedder's own name)
        never returns it, and only the same prompt finds it."""
        searchable = self.embedder.covers(prompt)
        if embedding is None:
            [vector] = await self.embedder.embed([prompt])
            embedding = vector
        if len(embedding) != self.embedder.dimensions:
            raise ConfigurationError(
                f"an embedding of {len(embedding)} dimensions for a cache of {self.embedder.dimensions}"
            )
        now = datetime.now(UTC)
        expires = now + timedelta(milliseconds=ttl_ms or self.policy.ttl_ms)
        async with self._connection() as conn:
            entry: int = await conn.fetchval(
                _STORE,
                tenant,
                scope,
                prompt_hash(prompt),
                prompt,
                self.embedder.model if searchable else self.embedder.model + "#exact",
                _vector_text(embedding),
                orjson.dumps(dict(response)).decode(),
                now,
                expires,
            )
        self.stats["stored"] += 1
        return entry

    async def purge_expired(self, *, batch: int = 1000, max_batches: int = 100) -> int:
        """Delete expired entries, ``batch`` at a time (each a short transaction), at most
        ``max_batches`` per call: the schedule calls again. Returns how many went."""
        total = 0
        async with self._connection() as conn:
            for _ in range(max_batches):
                status = await conn.execute(_PURGE, batch)
                deleted = int(status.split()[-1])
                total += deleted
                if deleted < batch:
                    break
        return total

    async def run_purge(
        self,
        stop: asyncio.Event,
        *,
        interval: float = 60.0,
        lead: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """Purge on a schedule until ``stop``; with ``lead``, only while it says this process
        leads (the service's sink lease: one purger at a time)."""
        while not stop.is_set():
            try:
                purged = await self.purge_expired() if lead is None or await lead() else 0
                if purged:
                    log.info("semantic cache: purged %d expired entries", purged)
            except Exception:  # a database outage: the next round tries again
                log.exception("semantic cache: the purge failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await stop.wait()

    # ---- reading through -----------------------------------------------------------------------------
    async def through(
        self,
        tenant: str,
        scope: str,
        prompt: str,
        call: Callable[[], Awaitable[Mapping[str, Any]]],
        *,
        policy: CachePolicy | None = None,
        store: bool = True,
    ) -> tuple[dict[str, Any], CacheHit | None]:
        """The cached answer, or ``call()``'s, stored for next time: (response, the hit or None).

        Identical concurrent misses (same tenant, scope and prompt) make one call; the others
        get its answer as a shared hit. If the call raises, each waiter raises it too (in this
        process) or tries itself (in other processes).
        """
        try:
            found = await self.lookup(tenant, scope, prompt, policy=policy)
        except Exception:  # the cache saves money; it must not cost an answer
            self.stats["errors"] += 1
            log.warning("semantic cache: the lookup failed; answering without the cache", exc_info=True)
            return dict(await call()), None
        if found.hit is not None:
            return found.hit.response, found.hit
        key = (tenant, scope, found.prompt_hash)
        while (flight := self._flights.get(key)) is not None:
            try:
                result = await asyncio.shield(flight)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this caller is being cancelled
                continue  # the leader was (its job timed out, its worker stopped): lead instead
            return self._shared(result, prompt)
        flight = asyncio.get_running_loop().create_future()
        self._flights[key] = flight
        try:
            result = await self._lead(key, found, prompt, call, policy=policy, store=store)
        except asyncio.CancelledError:
            flight.cancel()  # followers see the leader gone, not a failure of theirs
            raise
        except BaseException as exc:
            if not flight.done():
                flight.set_exception(exc)
                flight.exception()  # retrieved: no "never retrieved" warning when nobody waited
            raise
        else:
            flight.set_result(result)
        finally:
            self._flights.pop(key, None)
        if isinstance(result, CacheHit):  # another process answered while this one waited
            return result.response, result
        return result, None

    async def _lead(
        self,
        key: tuple[str, str, str],
        found: Lookup,
        prompt: str,
        call: Callable[[], Awaitable[Mapping[str, Any]]],
        *,
        policy: CachePolicy | None,
        store: bool,
    ) -> CacheHit | dict[str, Any]:
        tenant, scope, digest = key
        lock = self._lock_prefix + hashlib.sha256(f"{tenant}\0{scope}\0{digest}".encode()).hexdigest()
        token = secrets.token_hex(8)
        held = await self._acquire(lock, token)
        deadline = time.monotonic() + (policy or self.policy).flight_wait
        pause = 0.02
        while not held and time.monotonic() < deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 0.25)
            answered = await self._exact_or_none(tenant, scope, digest)
            if answered is not None:
                self.stats["shared"] += 1
                return replace(answered, shared=True)
            held = await self._acquire(lock, token)
        try:
            # Another caller may have stored the answer between this one's lookup and its lead
            # (it finished and let go just then): look once more before paying for a call.
            answered = await self._exact_or_none(tenant, scope, digest)
            if answered is not None:
                self.stats["shared"] += 1
                return replace(answered, shared=True)
            response = dict(await call())
            if store:
                try:
                    await self.store(tenant, scope, prompt, response, embedding=found.embedding)
                except Exception:  # the answer stands; only the next asker pays again
                    self.stats["errors"] += 1
                    log.warning("semantic cache: storing an answer failed", exc_info=True)
            return response
        finally:
            if held:
                await self._release(lock, token)

    async def _exact_or_none(self, tenant: str, scope: str, digest: str) -> CacheHit | None:
        """The exact path, where a failure means "not found": the caller then makes the call."""
        try:
            return await self._exact(tenant, scope, digest)
        except Exception:
            self.stats["errors"] += 1
            log.warning("semantic cache: a lookup failed; calling without it", exc_info=True)
            return None

    def _shared(self, result: CacheHit | dict[str, Any], prompt: str) -> tuple[dict[str, Any], CacheHit]:
        self.stats["shared"] += 1
        if isinstance(result, CacheHit):
            return result.response, replace(result, shared=True)
        return result, CacheHit(result, 1.0, True, None, prompt, shared=True)

    async def _acquire(self, lock: str, token: str) -> bool:
        """Take the flight's lock; True without Redis, or when Redis fails (calling twice is
        better than not answering)."""
        if self.redis is None:
            return True
        ms = int(self.policy.flight_wait * 1000)
        try:
            return bool(await self.redis.set(lock, token, nx=True, px=ms))
        except Exception:
            self.stats["errors"] += 1
            log.warning("semantic cache: Redis failed; calling without single flight", exc_info=True)
            return True

    async def _release(self, lock: str, token: str) -> None:
        if self.redis is None:
            return
        with contextlib.suppress(Exception):  # it lapses by itself
            await self.redis.eval(_RELEASE, 1, lock, token)

    async def aclose(self) -> None:
        """Nothing is left running; kept for callers that close what they open."""
        return None

    @contextlib.asynccontextmanager
    async def _connection(self) -> Any:
        pool = await self.db.raw_pool()
        async with pool.acquire() as conn:
            yield conn


_EXACT = """
SELECT id, prompt, response::text AS response FROM llm_cache
WHERE tenant = $1 AND scope = $2 AND prompt_hash = $3 AND expires_at > now()
"""
_NEAREST = """
SELECT id, prompt, response::text AS response, embedding <=> $4::vector AS distance FROM llm_cache
WHERE tenant = $1 AND scope = $2 AND embedder = $3 AND expires_at > now()
ORDER BY embedding <=> $4::vector
LIMIT $5
"""
_STORE = """
INSERT INTO llm_cache
    (tenant, scope, prompt_hash, prompt, embedder, embedding, response, created_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6::vector, $7::jsonb, $8, $9)
ON CONFLICT (tenant, scope, prompt_hash) DO UPDATE SET
    prompt = EXCLUDED.prompt, embedder = EXCLUDED.embedder, embedding = EXCLUDED.embedding,
    response = EXCLUDED.response, created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
RETURNING id
"""
_PURGE = """
DELETE FROM llm_cache WHERE id IN (
    SELECT id FROM llm_cache WHERE expires_at <= now() ORDER BY expires_at LIMIT $1
)
"""
# KEYS[1] the flight's lock; ARGV[1] the holder's token. Only the holder releases it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
