"""The per-key request rate limit: counted in Redis, so every API process shares it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.harness.service_harness import running_service


async def test_one_key_shares_its_limit_across_api_processes(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    # Two apps with their own connections stand for two API processes: only Redis is shared.
    async with contextlib.AsyncExitStack() as stack:
        one = await stack.enter_async_context(
            running_service(redis_url, sluice_database_url, prefix, auth=True, rate_limit=0.5, rate_burst=6)
        )
        two = await stack.enter_async_context(
            running_service(redis_url, sluice_database_url, prefix, auth=True, rate_limit=0.5, rate_burst=6)
        )
        _, key = await one.svc.keys.create("acme")
        _, other = await one.svc.keys.create("acme")
        headers = {"Authorization": f"Bearer {key}"}
        codes = []
        remaining = []
        for i in range(10):
            client = (one if i % 2 else two).client
            resp = await client.get("/v1/jobs", headers=headers)
            codes.append(resp.status_code)
            if resp.status_code == 200:
                remaining.append(int(resp.headers["ratelimit-remaining"]))
        # 6 at once, then one per 2 s: the 7th to 10th are refused, whichever process they reach
        assert codes == [200] * 6 + [429] * 4
        assert remaining == [5, 4, 3, 2, 1, 0]
        refused = await one.client.get("/v1/jobs", headers=headers)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(refused.headers["retry-after"]) <= 2
        assert refused.headers["ratelimit-limit"] == "6"
        # another key has its own allowance
        assert (await two.client.get("/v1/jobs", headers={"X-API-Key": other})).status_code == 200
        # the steady rate comes back
        await asyncio.sleep(2.2)
        assert (await two.client.get("/v1/jobs", headers=headers)).status_code == 200
        assert (await one.client.get("/v1/jobs", headers=headers)).status_code == 429


async def test_a_submission_refused_by_the_rate_limit_makes_no_job(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with running_service(
        redis_url, sluice_database_url, prefix, auth=True, rate_limit=0.1, rate_burst=2
    ) as api:
        _, key = await api.svc.keys.create("acme")
        headers = {"Authorization": f"Bearer {key}"}
        codes = []
        for i in range(4):
            job = {"type": "generic", "payload": {"n": i}}
            codes.append((await api.client.post("/jobs", json=job, headers=headers)).status_code)
        assert codes == [201, 201, 429, 429]
        assert (await api.svc.queue.counts())["added"] == 2
        rows = await api.svc.store.counts("acme")
        assert sum(rows.values()) == 2


@pytest.mark.parametrize("rate", [0.0])
async def test_a_zero_rate_turns_the_limit_off(
    redis_url: str, sluice_database_url: str, prefix: str, rate: float
) -> None:
    async with running_service(
        redis_url, sluice_database_url, prefix, auth=True, rate_limit=rate, rate_burst=1
    ) as api:
        _, key = await api.svc.keys.create("acme")
        for _ in range(5):
            resp = await api.client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200
            assert "ratelimit-limit" not in resp.headers
