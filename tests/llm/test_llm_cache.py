"""The semantic cache against real PostgreSQL with pgvector and the real local embedder: hits,
misses, guards, TTL and purge, tenant and scope isolation, single flight in one process and
across processes (real ones, sharing Redis and the database)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice.errors import ConfigurationError
from sluice.llm.cache import SemanticCache
from sluice.llm.cache_keys import cache_scope, normalize
from sluice.llm.cache_policy import CachePolicy
from sluice.llm.embedder import LocalEmbedder
from sluice.store.database import Database

EMBEDDER = LocalEmbedder()
SCOPE = cache_scope("openai", "gpt-4o-mini", params={"max_tokens": 256})


@pytest.fixture
async def db(sluice_database_url: str) -> AsyncIterator[Database]:
    database = Database(sluice_database_url)
    await database.migrate()
    yield database
    await database.close()


@pytest.fixture
async def cache(db: Database) -> AsyncIterator[SemanticCache]:
    c = SemanticCache(db, EMBEDDER)
    yield c
    await c.aclose()


def answer(text: str) -> dict[str, Any]:
    return {"response": text, "usage": {"prompt_tokens": 10, "completion_tokens": 5}, "cost": 0.0001}


async def test_exact_repeat_is_a_hit_without_embedding_again(cache: SemanticCache) -> None:
    await cache.store("t1", SCOPE, "How do I reverse a list in Python?", answer("use reversed()"))
    found = await cache.lookup("t1", SCOPE, "  How do I   reverse a list in Python?\n")
    assert found.hit is not None
    assert found.hit.exact and found.hit.similarity == 1.0
    assert found.hit.response["response"] == "use reversed()"
    assert found.embedding is None  # the exact path answered before the embedder ran


async def test_a_paraphrase_hits_and_says_how_similar(cache: SemanticCache) -> None:
    await cache.store("t1", SCOPE, "How do I reverse a list in Python?", answer("use reversed()"))
    found = await cache.lookup("t1", SCOPE, "What's the way to reverse a Python list?")
    assert found.hit is not None and not found.hit.exact
    assert 0.92 <= found.hit.similarity < 1.0
    assert found.hit.prompt == "How do I reverse a list in Python?"


async def test_an_unrelated_prompt_misses_and_keeps_its_embedding(cache: SemanticCache) -> None:
    await cache.store("t1", SCOPE, "How do I reverse a list in Python?", answer("use reversed()"))
    found = await cache.lookup("t1", SCOPE, "What is the capital of Peru?")
    assert found.hit is None
    assert found.embedding is not None and len(found.embedding) == EMBEDDER.dimensions
    assert found.best_similarity is not None and found.best_similarity < 0.5


@pytest.mark.parametrize(
    ("cached", "asked", "guard"),
    [
        ("Convert 100 USD to EUR.", "Convert 100 EUR to USD.", "currency"),
        ("Convert 5 miles to kilometers.", "Convert 5 kilometers to miles.", "units"),
        ("List foods that contain gluten.", "List foods that do not contain gluten.", "negation"),
        (
            "Write a Python function to check whether a string is a palindrome.",
            "Write a Rust function to check whether a string is a palindrome.",
            "proglang",
        ),
        ("Translate 'good morning' into French.", "Translate 'good morning' into German.", "language"),
        ("What is 15% of 80?", "What is 15% of 90?", "numbers"),
    ],
)
async def test_guards_veto_a_near_miss_that_the_threshold_would_serve(
    cache: SemanticCache, cached: str, asked: str, guard: str
) -> None:
    await cache.store("t1", SCOPE, cached, answer("the cached answer"))
    unguarded = await cache.lookup("t1", SCOPE, asked, policy=CachePolicy(threshold=0.75, guards=False))
    guarded = await cache.lookup("t1", SCOPE, asked, policy=CachePolicy(threshold=0.75))
    assert unguarded.hit is not None  # the embedding alone would have served the wrong answer
    assert guarded.hit is None
    assert guard in guarded.vetoed_by


async def test_no_hit_crosses_a_tenant_or_a_scope(cache: SemanticCache) -> None:
    prompt = "Summarize the plot of Hamlet in three sentences."
    await cache.store("tenant-a", SCOPE, prompt, answer("a's answer"))
    assert (await cache.lookup("tenant-b", SCOPE, prompt)).hit is None
    other_model = cache_scope("openai", "gpt-4o", params={"max_tokens": 256})
    assert (await cache.lookup("tenant-a", other_model, prompt)).hit is None
    other_system = cache_scope(
        "openai",
        "gpt-4o-mini",
        context=[{"role": "system", "content": "Answer as a pirate."}],
        params={"max_tokens": 256},
    )
    assert (await cache.lookup("tenant-a", other_system, prompt)).hit is None
    hit = (await cache.lookup("tenant-a", SCOPE, prompt)).hit
    assert hit is not None and hit.response["response"] == "a's answer"


async def test_entries_expire_and_the_purge_deletes_them(cache: SemanticCache, db: Database) -> None:
    await cache.store("t1", SCOPE, "What is the boiling point of water?", answer("100 C"), ttl_ms=50)
    await cache.store("t1", SCOPE, "Who painted the Mona Lisa?", answer("Leonardo"))
    await asyncio.sleep(0.1)
    assert (await cache.lookup("t1", SCOPE, "What is the boiling point of water?")).hit is None
    assert await cache.purge_expired(batch=1) == 1
    async with db.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        prompts = [r["prompt"] for r in await raw.fetch("SELECT prompt FROM llm_cache")]
    assert prompts == ["Who painted the Mona Lisa?"]


async def test_a_prompt_longer_than_the_embedder_reads_is_served_by_exact_match_only(
    cache: SemanticCache,
) -> None:
    # One long opening (instructions), then different documents: embedded by their start, the two
    # would look identical; the cache must not serve one's answer to the other.
    instructions = "You are a support agent. Summarize the customer's ticket below in one line. " * 30
    first = instructions + "Ticket: my washing machine leaks water onto the floor."
    second = instructions + "Ticket: my laptop screen flickers when on battery."
    assert not EMBEDDER.covers(first)
    await cache.store("t1", SCOPE, first, answer("washing machine leak"))
    assert (await cache.lookup("t1", SCOPE, second)).hit is None
    again = await cache.lookup("t1", SCOPE, first)
    assert again.hit is not None and again.hit.exact
    assert cache.stats["too_long"] == 1


async def test_concurrent_identical_misses_make_one_call(cache: SemanticCache) -> None:
    calls = 0

    async def call() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.2)
        return answer("computed once")

    results = await asyncio.gather(
        *(cache.through("t1", SCOPE, "Explain the CAP theorem briefly.", call) for _ in range(20))
    )
    assert calls == 1
    assert all(response["response"] == "computed once" for response, _ in results)
    assert sum(hit is None for _, hit in results) == 1  # the caller that called
    assert all(hit is not None and hit.shared for _, hit in results if hit is not None)
    # Later askers find it stored.
    _, later = await cache.through("t1", SCOPE, "Explain the CAP theorem briefly.", call)
    assert later is not None and later.exact and calls == 1


async def test_a_failed_call_reaches_every_waiter_and_is_not_cached(cache: SemanticCache) -> None:
    async def failing() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        raise RuntimeError("provider down")

    results = await asyncio.gather(
        *(cache.through("t1", SCOPE, "Why is the sky blue?", failing) for _ in range(5)),
        return_exceptions=True,
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    assert (await cache.lookup("t1", SCOPE, "Why is the sky blue?")).hit is None


async def test_a_judge_decides_the_borderline_candidates(cache: SemanticCache, db: Database) -> None:
    asked: list[tuple[str, str]] = []

    async def judge(new: str, cached: str) -> bool:
        asked.append((new, cached))
        return True

    judged = SemanticCache(db, EMBEDDER, judge=judge, policy=CachePolicy(threshold=0.99, judge_margin=0.2))
    await judged.store("t1", SCOPE, "How do I reverse a list in Python?", answer("use reversed()"))
    found = await judged.lookup("t1", SCOPE, "What's the way to reverse a Python list?")
    assert found.hit is not None and found.hit.similarity < 0.99
    assert asked == [("What's the way to reverse a Python list?", "How do I reverse a list in Python?")]
    await judged.aclose()


def test_policy_from_the_environment_and_its_errors() -> None:
    policy = CachePolicy.from_env({"CACHE_SIMILARITY_THRESHOLD": "0.9", "CACHE_TTL_MS": "60000"})
    assert (policy.threshold, policy.ttl_ms) == (0.9, 60000)
    ours = CachePolicy.from_env(
        {"SLUICE_CACHE_SIMILARITY_THRESHOLD": "0.95", "CACHE_SIMILARITY_THRESHOLD": "0.5"}
    )
    assert ours.threshold == 0.95
    with pytest.raises(ConfigurationError, match="CACHE_TTL_MS='soon' is not a whole number"):
        CachePolicy.from_env({"CACHE_TTL_MS": "soon"})
    with pytest.raises(ConfigurationError, match=r"threshold must be in \(0, 1\]"):
        CachePolicy.from_env({"CACHE_SIMILARITY_THRESHOLD": "1.5"})


def test_normalize_collapses_whitespace_only() -> None:
    assert normalize("  What is\tthe US  GDP?\n") == "What is the US GDP?"


_FLIGHT_PROCESS = """
import asyncio, sys
from redis.asyncio import Redis
from sluice.llm.cache import SemanticCache
from sluice.llm.cache_keys import cache_scope
from sluice.llm.embedder import LocalEmbedder
from sluice.store.database import Database

async def main(db_url, redis_url, key):
    db = Database(db_url)
    redis = Redis.from_url(redis_url)
    cache = SemanticCache(db, LocalEmbedder(), redis=redis, prefix=key)
    async def call():
        await redis.incr(key + ":calls")
        await asyncio.sleep(1.0)
        return {"response": "one answer"}
    await redis.incr(key + ":ready")
    while int(await redis.get(key + ":ready")) < 3:
        await asyncio.sleep(0.005)
    response, hit = await cache.through("t1", cache_scope("openai", "m"), "Explain quantum tunnelling.", call)
    print(response["response"], "hit" if hit else "called", flush=True)
    await cache.aclose()
    await redis.aclose()
    await db.close()

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.slow
async def test_identical_misses_in_three_processes_make_one_call(
    db: Database, sluice_database_url: str, redis_url: str, prefix: str
) -> None:
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _FLIGHT_PROCESS,
            sluice_database_url,
            redis_url,
            prefix,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(3)
    ]
    outputs = await asyncio.gather(*(asyncio.wait_for(p.communicate(), 60) for p in procs))
    assert [p.returncode for p in procs] == [0, 0, 0], [err.decode() for _, err in outputs]
    lines = sorted(out.decode().strip() for out, _ in outputs)
    assert lines == ["one answer called", "one answer hit", "one answer hit"]
    redis = Redis.from_url(redis_url)
    try:
        assert int(await redis.get(prefix + ":calls") or 0) == 1
    finally:
        await redis.aclose()


async def test_a_broken_cache_costs_no_answer(sluice_database_url: str) -> None:
    # A database the migrations never ran on: no llm_cache table. The call is made, and answers.
    unmigrated = Database(sluice_database_url)
    cache = SemanticCache(unmigrated, EMBEDDER)
    try:
        response, hit = await cache.through("t1", SCOPE, "Why is the sky blue?", _answer_of("Rayleigh"))
        assert response["response"] == "Rayleigh" and hit is None
        assert cache.stats["errors"] == 1
    finally:
        await cache.aclose()
        await unmigrated.close()


def _answer_of(text: str) -> Any:
    async def call() -> dict[str, Any]:
        return answer(text)

    return call


async def test_when_the_leader_is_cancelled_a_follower_calls_instead(cache: SemanticCache) -> None:
    calls = 0
    started = asyncio.Event()

    async def slow() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        started.set()
        await asyncio.sleep(0.3)
        return answer(f"call {calls}")

    leader = asyncio.create_task(cache.through("t1", SCOPE, "Explain what a monad is.", slow))
    await started.wait()
    follower = asyncio.create_task(cache.through("t1", SCOPE, "Explain what a monad is.", slow))
    await asyncio.sleep(0.05)
    leader.cancel()  # its job timed out, say: the follower must not fail with it
    response, hit = await follower
    assert hit is None and response["response"] == "call 2"
    assert leader.cancelled()


def test_the_cache_benchmark_refuses_a_database_whose_cache_is_in_use(
    cache: SemanticCache, sluice_database_url: str
) -> None:
    asyncio.run(_store_one(sluice_database_url))
    done = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "cache", "--database", sluice_database_url, "-n", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "holds entries, and the benchmark would delete them" in done.stderr


async def _store_one(url: str) -> None:
    db = Database(url)
    try:
        await SemanticCache(db, EMBEDDER).store("t1", SCOPE, "Who painted the Mona Lisa?", answer("Leonardo"))
    finally:
        await db.close()


def test_the_cache_benchmark_says_when_its_database_is_down() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sluice",
            "bench",
            "cache",
            "--database",
            "postgresql://x@127.0.0.1:1/db",
            "-n",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "PostgreSQL at postgresql://x@127.0.0.1:1/db cannot be reached" in done.stderr
    assert "internal error" not in done.stderr
