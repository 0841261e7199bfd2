"""``llm-inference`` end to end: through the API, a real worker, the OpenAI-compatible provider
against the simulated server on loopback (it counts what it bills), the semantic cache on real
PostgreSQL with pgvector, and the token ledger. What the provider saw is the truth checked."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from sluice import Queue, Worker
from sluice.errors import ConfigurationError
from sluice.llm.cache import SemanticCache
from sluice.llm.embedder import LocalEmbedder, ProviderEmbedder
from sluice.llm.inference import (
    RUNTIME_STATE,
    InvalidInference,
    LLMRuntime,
    RuntimeFromEnv,
    embedder_from_env,
    inference_job,
    parse_request,
    register_inference,
    reservation,
)
from sluice.llm.openai import OpenAIProvider
from sluice.llm.pricing import to_micro_usd
from sluice.service.handlers import service_worker
from sluice.store.database import Database
from sluice.testing.provider import serve_provider
from sluice.testing.simulated_server import STATS_PATH, ProviderLimits
from tests.conftest import eventually, running
from tests.harness.service_harness import Running, running_service

KEY = "sk-sim-test"
EMBEDDER = LocalEmbedder()


@pytest.fixture(scope="module")
def provider_url() -> Iterator[str]:
    with serve_provider(ProviderLimits(), api_key=KEY) as url:
        yield url


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix, auth=True) as svc:
        yield svc


@pytest.fixture
async def runtime(
    provider_url: str, sluice_database_url: str, redis_url: str, prefix: str
) -> AsyncIterator[LLMRuntime]:
    provider = OpenAIProvider(base_url=f"{provider_url}/v1", api_key_env="SIM_KEY", env={"SIM_KEY": KEY})
    redis = Redis.from_url(redis_url)
    db = Database(sluice_database_url, pool_size=2)
    cache = SemanticCache(db, EMBEDDER, redis=redis, prefix=prefix)
    rt = LLMRuntime(provider, model="gpt-4o-mini", cache=cache, redis=redis)
    yield rt
    await rt.aclose()
    await db.close()
    await redis.aclose()


async def provider_stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        body: dict[str, Any] = (await client.get(url + STATS_PATH)).json()
        return body


async def finished(api: Running, job_id: str) -> Any:
    async def done() -> Any:
        await api.drain_events()
        row = await api.svc.store.get(uuid.UUID(job_id))
        return row if row is not None and row.status in ("COMPLETED", "DEAD_LETTER", "REJECTED") else None

    return await eventually(done, timeout=30)


async def submit(api: Running, key: str, payload: dict[str, Any], **extra: Any) -> dict[str, Any]:
    resp = await api.client.post(
        "/v1/jobs",
        json={"type": "llm-inference", "payload": payload, **extra},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


async def test_an_answer_then_a_paraphrase_served_from_the_cache(
    api: Running, runtime: LLMRuntime, provider_url: str, redis_url: str, prefix: str
) -> None:
    _, key = await api.svc.keys.create("acme")
    before = (await provider_stats(provider_url))["accepted"]
    async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
        first = await submit(api, key, {"prompt": "How do I reverse a list in Python?", "max_tokens": 40})
        # The reservation covers the prompt's upper bound and max_tokens; the tenant is the key's.
        assert first["tokens"] > 40
        assert first["payload"]["tenant"] == "acme"
        row = await finished(api, first["id"])
        assert row.status == "COMPLETED", row.error
        result = row.result
        assert result["cacheHit"] is False
        assert result["provider"] == "openai" and result["model"] == "gpt-4o-mini"
        assert result["usage"]["completion_tokens"] == 40  # the simulated model writes max_tokens
        assert result["usage"]["total_tokens"] <= first["tokens"]  # usage never exceeds the reservation
        assert result["cost"] is not None and result["cost"] > 0  # gpt-4o-mini has a list price

        second = await submit(
            api, key, {"prompt": "What's the way to reverse a Python list?", "max_tokens": 40}
        )
        row2 = await finished(api, second["id"])
        assert row2.status == "COMPLETED"
        hit = row2.result
        assert hit["cacheHit"] is True and 0.92 <= hit["similarity"] < 1
        assert hit["response"] == result["response"]
        assert hit["usage"]["total_tokens"] == 0 and hit["cost"] == 0.0
        assert hit["cached"]["usage"] == result["usage"]
    # The provider answered once.
    assert (await provider_stats(provider_url))["accepted"] - before == 1


async def test_the_budget_is_charged_what_the_provider_billed_and_nothing_for_a_hit(
    api: Running, runtime: LLMRuntime, provider_url: str, redis_url: str, prefix: str
) -> None:
    _, key = await api.svc.keys.create("acme")
    await api.svc.queue.budgets.create("llm", 100_000)
    prompt = "Summarize the plot of Hamlet in three sentences."
    async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
        first = await submit(api, key, {"prompt": prompt, "max_tokens": 30}, budget="llm")
        row = await finished(api, first["id"])
        billed = row.result["usage"]["total_tokens"]
        again = await submit(api, key, {"prompt": prompt, "max_tokens": 30}, budget="llm")
        row2 = await finished(api, again["id"])
        assert row2.result["cacheHit"] is True and row2.result["similarity"] == 1.0
    budget = await api.svc.queue.budgets.get("llm")
    assert budget is not None
    assert budget.used == billed


async def test_no_answer_crosses_tenants(
    api: Running, runtime: LLMRuntime, provider_url: str, redis_url: str, prefix: str
) -> None:
    _, acme = await api.svc.keys.create("acme")
    _, globex = await api.svc.keys.create("globex")
    prompt = "Explain the CAP theorem in two sentences."
    async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
        a = await finished(api, (await submit(api, acme, {"prompt": prompt}))["id"])
        g = await finished(api, (await submit(api, globex, {"prompt": prompt}))["id"])
    assert a.result["cacheHit"] is False
    assert g.result["cacheHit"] is False


async def test_a_caller_cannot_read_another_tenants_cache_through_the_payload(api: Running) -> None:
    _, key = await api.svc.keys.create("acme")
    resp = await api.client.post(
        "/v1/jobs",
        json={"type": "llm-inference", "payload": {"prompt": "hi", "tenant": "globex"}},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status_code == 422
    assert "payload.tenant" in resp.json()["message"]


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        ({}, "payload.prompt"),
        ({"prompt": "  "}, "payload.prompt"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "not both"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "payload.messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "last"),
        ({"prompt": "x", "max_tokens": 0}, "payload.max_tokens"),
        ({"prompt": "x", "temperature": 3}, "payload.temperature"),
        ({"prompt": "x", "cache": {"threshold": 2}}, "payload.cache.threshold"),
        ({"prompt": "x", "cache": "yes"}, "payload.cache"),
    ],
)
async def test_bad_payloads_are_refused_at_the_api_naming_the_field(
    api: Running, payload: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(InvalidInference, match=complaint.replace("[", r"\[").replace("]", r"\]")):
        parse_request(payload)
    _, key = await api.svc.keys.create("acme")
    resp = await api.client.post(
        "/jobs",
        json={"type": "llm-inference", "payload": payload},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status_code in (400, 422), resp.text
    assert complaint in resp.text


def test_the_reservation_is_the_prompt_bound_plus_max_tokens() -> None:
    request = parse_request({"prompt": "hello world", "max_tokens": 100, "system": "Be brief."})
    exact = reservation(request, provider="openai", model="gpt-4o-mini")
    estimate = reservation(request, provider="anthropic", model="claude-haiku-4-5")
    assert 100 < exact < estimate  # tiktoken counts exactly; the estimate is an upper bound
    assert estimate == 100 + len(b"hello world") + len(b"Be brief.") + 2 * 16


async def test_a_throttled_call_waits_and_is_not_a_failure(
    api: Running, runtime: LLMRuntime, provider_url: str, redis_url: str, prefix: str
) -> None:
    _, key = await api.svc.keys.create("acme")
    async with httpx.AsyncClient() as client:
        await client.post(provider_url + "/_control/faults", json=[{"status": 429, "retry_after_ms": 200}])
    async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
        job = await submit(api, key, {"prompt": "Name three prime numbers.", "cache": False})
        row = await finished(api, job["id"])
    assert row.status == "COMPLETED"
    assert row.attempts == 1  # the 429 was not counted as an attempt
    assert row.result["cacheHit"] is False


async def test_a_wrong_key_dead_letters_at_once_without_retrying(
    api: Running, provider_url: str, redis_url: str, prefix: str
) -> None:
    _, key = await api.svc.keys.create("acme")
    wrong = OpenAIProvider(base_url=f"{provider_url}/v1", api_key_env="SIM_KEY", env={"SIM_KEY": "sk-wrong"})
    rt = LLMRuntime(wrong, model="gpt-4o-mini")
    try:
        async with running(service_worker(prefix=prefix, llm=rt), redis_url):
            job = await submit(api, key, {"prompt": "Hello?"}, max_attempts=5)
            row = await finished(api, job["id"])
    finally:
        await rt.aclose()
    assert row.status == "DEAD_LETTER"
    assert row.attempts == 1
    assert "sk-wrong" not in (row.error or "")


async def test_a_library_producer_adds_an_inference_job_with_its_reservation(
    runtime: LLMRuntime, redis_url: str, prefix: str
) -> None:
    spec = inference_job("Name the largest planet.", max_tokens=20, tenant="lib")
    assert spec.name == "llm-inference" and spec.tokens > 20
    async with Queue.from_url(redis_url, "jobs", prefix=prefix) as queue:
        (job,) = await queue.add_bulk([spec])
        async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
            result = await job.result(timeout=30)
    assert result["cacheHit"] is False and result["usage"]["completion_tokens"] == 20
    with pytest.raises(InvalidInference, match=r"payload\.max_tokens"):
        inference_job("x", max_tokens=0)


async def test_the_providers_per_minute_limits_become_the_queues_shared_gates(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with running_service(redis_url, sluice_database_url, prefix, llm_rpm=500, llm_tpm=200_000) as svc:
        flow = await svc.svc.queue.flow()
    assert (flow.rate_max, flow.rate_per_seconds) == (500, 60.0)
    assert (flow.token_limit, flow.token_per_seconds) == (200_000, 60.0)
    # Without them, the service leaves the gates as an operator set them.
    async with running_service(redis_url, sluice_database_url, prefix) as svc:
        await svc.svc.queue.set_rate_limit(7, per=1.0)
    async with running_service(redis_url, sluice_database_url, prefix) as svc:
        assert (await svc.svc.queue.flow()).rate_max == 7


async def test_a_budget_in_money_is_charged_the_calls_cost_and_refuses_before_its_limit(
    api: Running, runtime: LLMRuntime, provider_url: str, redis_url: str, prefix: str
) -> None:
    _, key = await api.svc.keys.create("acme")
    budgets = api.svc.queue.budgets
    await budgets.create("usd", 1_000_000)  # one dollar, in micro-dollars
    await budgets.create("usd-tiny", 1)  # one micro-dollar: no call fits
    before = (await provider_stats(provider_url))["accepted"]
    async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
        paid = await finished(
            api,
            (await submit(api, key, {"prompt": "Name a prime.", "max_tokens": 50, "budget_usd": "usd"}))[
                "id"
            ],
        )
        refused = await finished(
            api,
            (
                await submit(
                    api,
                    key,
                    {
                        "prompt": "Name another prime.",
                        "max_tokens": 50,
                        "budget_usd": "usd-tiny",
                        "cache": False,
                    },
                )
            )["id"],
        )
    assert paid.status == "COMPLETED"
    cost = paid.result["cost"]
    assert cost > 0
    usd = await budgets.get("usd")
    assert usd is not None and usd.used == to_micro_usd(cost)  # the call's cost, no more
    assert refused.status == "DEAD_LETTER" and "cannot admit" in (refused.error or "")
    assert (await budgets.get("usd-tiny")).used == 0
    assert (await provider_stats(provider_url))["accepted"] - before == 1  # the refused one never called


async def test_the_providers_embeddings_can_back_the_cache(provider_url: str, db_url_cache: Database) -> None:
    provider = OpenAIProvider(base_url=f"{provider_url}/v1", api_key_env="SIM_KEY", env={"SIM_KEY": KEY})
    embedder = embedder_from_env(provider, {"SLUICE_CACHE_EMBEDDER": "provider"})
    assert isinstance(embedder, ProviderEmbedder) and embedder.model == "openai/text-embedding-3-small"
    [vector] = await embedder.embed(["How do I reverse a list in Python?"])
    assert len(vector) == 384 and abs(sum(x * x for x in vector) - 1) < 1e-6  # asked for 384, unit length
    cache = SemanticCache(db_url_cache, embedder)
    await cache.store("t1", "s", "How do I reverse a list in Python?", {"response": "reversed()"})
    found = await cache.lookup("t1", "s", "how do I reverse a list in python")
    assert found.hit is not None and not found.hit.exact  # the server's vectors put the two together
    await cache.aclose()
    await provider.aclose()
    with pytest.raises(ConfigurationError, match="SLUICE_CACHE_EMBEDDER='gpu'"):
        embedder_from_env(provider, {"SLUICE_CACHE_EMBEDDER": "gpu"})


@pytest.fixture
async def db_url_cache(sluice_database_url: str) -> AsyncIterator[Database]:
    db = Database(sluice_database_url, pool_size=2)
    await db.migrate()
    yield db
    await db.close()


async def _fault(url: str, faults: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient() as client:
        (await client.post(url + "/_control/faults", json=faults)).raise_for_status()


@pytest.mark.parametrize(
    ("fault", "charged"),
    [
        ({"status": 200, "omit_usage": True}, "reservation"),  # answered, usage unknown: keep it all
        ({"status": 500}, "nothing"),  # a 5xx bills nothing
        ({"status": 404, "code": "model_not_found"}, "nothing"),  # refused: nothing billed
    ],
)
async def test_what_the_budget_keeps_depends_on_what_the_provider_said(
    api: Running,
    runtime: LLMRuntime,
    provider_url: str,
    redis_url: str,
    prefix: str,
    fault: dict[str, Any],
    charged: str,
) -> None:
    _, key = await api.svc.keys.create("acme")
    await api.svc.queue.budgets.create("llm", 100_000)
    await _fault(provider_url, [fault])
    async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
        job = await submit(
            api,
            key,
            {"prompt": "Name a planet.", "max_tokens": 30, "cache": False},
            budget="llm",
            max_attempts=1,
        )
        row = await finished(api, job["id"])
    used = (await api.svc.queue.budgets.get("llm")).used
    if charged == "reservation":
        assert row.status == "COMPLETED" and row.result["usage"]["reported"] is False
        assert used == job["tokens"]
    else:
        assert row.status == "DEAD_LETTER"
        assert used == 0


async def test_an_unknown_provider_is_refused_at_the_api(api: Running) -> None:
    _, key = await api.svc.keys.create("acme")
    resp = await api.client.post(
        "/v1/jobs",
        json={"type": "llm-inference", "payload": {"prompt": "hi", "provider": "skynet"}},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status_code == 422 and "payload.provider 'skynet'" in resp.json()["message"]


async def test_a_provider_without_its_key_dead_letters_at_once(
    api: Running, runtime: LLMRuntime, redis_url: str, prefix: str
) -> None:
    # The payload names Anthropic; this deployment has no ANTHROPIC_API_KEY (the runtime's env
    # is the test's: none). The job ends at once, saying which variable to set.
    _, key = await api.svc.keys.create("acme")
    async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
        job = await submit(
            api, key, {"prompt": "hi", "provider": "anthropic", "cache": False}, max_attempts=5
        )
        row = await finished(api, job["id"])
    assert row.status == "DEAD_LETTER" and row.attempts == 1
    assert "ANTHROPIC_API_KEY" in (row.error or "")


async def test_a_cache_hit_needs_no_room_in_a_money_budget(
    api: Running, runtime: LLMRuntime, redis_url: str, prefix: str
) -> None:
    _, key = await api.svc.keys.create("acme")
    await api.svc.queue.budgets.create("usd", 1_000_000)
    await api.svc.queue.budgets.create("usd-empty", 1)
    async with running(service_worker(prefix=prefix, llm=runtime), redis_url):
        first = await submit(api, key, {"prompt": "What is the boiling point of water?", "budget_usd": "usd"})
        await finished(api, first["id"])
        again = await submit(
            api, key, {"prompt": "What is the boiling point of water?", "budget_usd": "usd-empty"}
        )
        row = await finished(api, again["id"])
    assert row.status == "COMPLETED" and row.result["cacheHit"] is True
    assert (await api.svc.queue.budgets.get("usd-empty")).used == 0


async def test_a_job_reserving_more_than_the_token_gate_is_refused_at_once(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with running_service(redis_url, sluice_database_url, prefix, llm_tpm=1_000) as svc:
        resp = await svc.client.post(
            "/v1/jobs", json={"type": "llm-inference", "payload": {"prompt": "hi", "max_tokens": 2_000}}
        )
    assert resp.status_code == 422
    assert "more than the provider's 1,000 tokens per minute" in resp.json()["message"]


async def test_arqueues_route_answers_a_bad_llm_payload_400_as_arqueue_does(api: Running) -> None:
    _, key = await api.svc.keys.create("acme")
    resp = await api.client.post(
        "/enqueue",
        json={"type": "llm-inference", "payload": {"max_tokens": 5}},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status_code == 400 and "payload.prompt" in resp.json()["message"]


async def _everything_in(redis: Redis, db: Database) -> str:
    """Every value Redis holds and every row of every table of the store, as text."""
    parts: list[str] = []
    async for key in redis.scan_iter(count=1000):
        raw_kind: Any = await redis.type(key)
        kind = raw_kind.decode() if isinstance(raw_kind, bytes) else str(raw_kind)
        if kind == "string":
            parts.append(str(await redis.get(key)))
        elif kind == "hash":
            parts.append(str(await redis.hgetall(key)))
        elif kind == "list":
            parts.append(str(await redis.lrange(key, 0, -1)))
        elif kind == "set":
            parts.append(str(await redis.smembers(key)))
        elif kind == "zset":
            parts.append(str(await redis.zrange(key, 0, -1, withscores=True)))
        elif kind == "stream":
            parts.append(str(await redis.xrange(key)))
        parts.append(str(key))
    pool = await db.raw_pool()
    async with pool.acquire() as conn:
        tables = [
            r["tablename"]
            for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ]
        for table in tables:
            rows = await conn.fetch(f'SELECT row_to_json(t)::text AS row FROM "{table}" t')  # noqa: S608 (names from pg_tables)
            parts += [r["row"] for r in rows]
    return "\n".join(parts)


async def test_a_canary_provider_key_reaches_no_log_job_record_store_or_redis(
    api: Running, redis_url: str, sluice_database_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    canary = f"sk-canary-{uuid.uuid4().hex}"
    _, key = await api.svc.keys.create("acme")
    caplog.set_level(logging.DEBUG)
    redis = Redis.from_url(redis_url)
    db = Database(sluice_database_url, pool_size=2)
    # One provider that takes the canary (its calls answer, 429 and fail in turn), and one that
    # refuses it and repeats it in its error, as a careless server does.
    with (
        serve_provider(ProviderLimits(), api_key=canary) as taking,
        serve_provider(ProviderLimits(), api_key="sk-other") as refusing,
    ):
        await _fault(taking, [{"status": 429, "retry_after_ms": 600}, {"status": 500}])
        for url, max_attempts in ((taking, 3), (refusing, 1)):
            provider = OpenAIProvider(base_url=f"{url}/v1", api_key_env="CANARY", env={"CANARY": canary})
            cache = SemanticCache(db, EMBEDDER, redis=redis, prefix=prefix)
            rt = LLMRuntime(provider, model="gpt-4o-mini", cache=cache, redis=redis)
            try:
                async with running(service_worker(prefix=prefix, llm=rt), redis_url):
                    job = await submit(api, key, {"prompt": f"Say hi via {url}"}, max_attempts=max_attempts)
                    await finished(api, job["id"])
            finally:
                await rt.aclose()
    rows = [await api.svc.store.get(uuid.UUID(i)) for i in await _job_ids(api)]
    assert {r.status for r in rows if r is not None} == {"COMPLETED", "DEAD_LETTER"}  # both paths ran
    everything = await _everything_in(redis, db)
    await redis.aclose()
    await db.close()
    assert canary not in everything
    assert canary not in caplog.text
    assert all(canary not in f"{r.error} {r.result}" for r in rows if r is not None)


async def _job_ids(api: Running) -> list[str]:
    page = await api.svc.store.list_jobs("acme", limit=100)
    return [str(job.id) for job in page.jobs]


async def test_a_workers_runtime_lives_in_its_state_from_its_first_job_to_its_shutdown(
    redis: Redis, prefix: str
) -> None:
    # Given a worker whose llm-inference runtime comes from an empty environment (offline)
    w = Worker("llm", prefix=prefix)
    closed: list[bool] = []
    hook = RuntimeFromEnv(w.state, env={})
    w.add_hook(hook)
    w.register("llm-inference", hook.handler)
    queue = Queue("llm", redis=redis, prefix=prefix)
    async with running(w, redis):
        assert RUNTIME_STATE not in w.state  # nothing read before a job asks
        (job,) = await queue.add_bulk([inference_job("hello", cache=False, env={})])
        assert (await job.result(timeout=10))["provider"] == "offline"
        runtime = w.state[RUNTIME_STATE]
        runtime.closers.append(lambda: _note(closed))
    # Then the run's shutdown closed it, and the worker keeps none for its next run
    assert closed == [True]
    assert RUNTIME_STATE not in w.state
    await queue.close()


def test_registering_the_built_in_handler_twice_keeps_one_runtime_hook() -> None:
    w = Worker("llm")
    register_inference(w)
    register_inference(w)
    assert [type(h) for h in w.hooks] == [RuntimeFromEnv]


async def _note(closed: list[bool]) -> None:
    closed.append(True)
