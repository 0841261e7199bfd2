"""The store's copy of the ledger: budgets that Redis lost come back holding what was spent."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from sluice.service.handlers import service_worker
from tests.conftest import eventually, running
from tests.harness.service_harness import Running, running_service

ESTIMATE = 500


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix) as svc:
        yield svc


async def _wipe_redis(api: Running) -> None:
    """Redis loses the queue's data (restarted without persistence, flushed, failed over)."""
    keys: Any = [k async for k in api.svc.queue.redis.scan_iter(match=api.svc.queue.keys.base + "*")]
    await api.svc.queue.redis.delete(*keys)


async def _submit(api: Running, budget: str, n: int) -> list[str]:
    ids = []
    for i in range(n):
        job = {
            "type": "llm-inference",
            "payload": {"prompt": f"summarise report {i} " * (i + 1), "max_tokens": 64},
            "tokens": ESTIMATE,
            "budget": budget,
        }
        resp = await api.client.post("/v1/jobs", json=job)
        assert resp.status_code == 201, resp.text
        ids.append(resp.json()["id"])
    return ids


async def _run_all(api: Running, prefix: str, redis_url: str, ids: list[str]) -> int:
    """Run the jobs to the end; returns the tokens their handlers reported spending."""
    async with running(service_worker(prefix=prefix), redis_url):

        async def done() -> bool:
            await api.drain_events()
            rows = [await api.svc.store.get(uuid.UUID(i)) for i in ids]
            return all(r is not None and r.status == "COMPLETED" for r in rows)

        await eventually(done, timeout=30)
    spent = 0
    for i in ids:
        row = await api.svc.store.get(uuid.UUID(i))
        assert row is not None
        spent += row.result["usage"]["total_tokens"]
    return spent


async def test_budgets_redis_lost_come_back_with_what_was_spent(
    api: Running, prefix: str, redis_url: str
) -> None:
    budgets = api.svc.queue.budgets
    ledger = api.svc.ledger
    # Given a hierarchy with a daily child that has a credit, and a rolling budget
    await budgets.create("team", 1_000_000)
    await budgets.create("alice", 100_000, window="day", parent="team")
    await budgets.credit("alice", 5_000)
    await budgets.create("roll", 50_000, window=3600)
    for name in ("alice", "roll"):
        await ledger.remember(name)
    # ... jobs spent from them, and the store copied the ledger
    first = await _run_all(api, prefix, redis_url, await _submit(api, "alice", 6))
    rolled = await _run_all(api, prefix, redis_url, await _submit(api, "roll", 3))
    assert await ledger.snapshot() == 3  # the parent "team" is copied too
    copied = {b.name: b for b in await budgets.copies(["alice", "team", "roll"]) if b is not None}
    assert copied["alice"].used == first and copied["roll"].used == rolled
    # ... and more jobs spent after the last copy
    later = await _run_all(api, prefix, redis_url, await _submit(api, "alice", 4))
    before = {b.name: b for b in await budgets.get_many(["alice", "team", "roll"]) if b is not None}
    assert before["alice"].used == first + later

    # When Redis loses everything and the ledger notices
    await _wipe_redis(api)
    assert await budgets.get_many(["alice", "team", "roll"]) == [None, None, None]
    restored = await ledger.restore_missing()

    # Then every budget is back, parents first, holding at least what was really spent:
    # the copy, plus the estimates of the attempts that started after it
    assert restored == ["roll", "team", "alice"] or restored.index("team") < restored.index("alice")
    after = {b.name: b for b in await budgets.get_many(["alice", "team", "roll"]) if b is not None}
    assert after["alice"].used == first + 4 * ESTIMATE >= first + later
    assert after["team"].used == first + 4 * ESTIMATE
    assert after["roll"].used == rolled
    assert (after["alice"].limit, after["alice"].credit, after["alice"].parent) == (100_000, 5_000, "team")
    assert (after["alice"].window, after["roll"].window, after["roll"].window_seconds) == (
        "day",
        "rolling",
        3600,
    )
    # the rolling charge leaves a whole window from now: never before it would have
    assert after["roll"].resets_at_ms is not None
    assert after["roll"].resets_at_ms >= before["roll"].resets_at_ms  # type: ignore[operator]
    # a live budget is never overwritten
    await budgets.adjust("alice", -1_000)
    assert await ledger.restore_missing() == []
    assert (await budgets.get("alice")).limit == 99_000


async def test_the_reconciler_rebuilds_budgets_before_it_enqueues_their_jobs_again(
    api: Running, prefix: str, redis_url: str
) -> None:
    # Given a budget made through the API, jobs that spend from it, the ledger copied, no worker
    made = await api.client.post("/v1/budgets", json={"name": "team", "limit": 10_000})
    assert made.status_code == 201, made.text
    ids = await _submit(api, "team", 3)
    await api.drain_events()
    await api.svc.ledger.snapshot()
    # When Redis loses its data and the reconciler passes
    await _wipe_redis(api)
    row = await api.svc.store.get(uuid.UUID(ids[-1]))
    assert row is not None
    later = row.updated_at + timedelta(seconds=api.svc.settings.reconcile_grace + 1)
    done = await api.reconciler.reconcile(now=later, full=True)
    # Then the budget is back first, so that the engine takes the jobs that name it
    assert done.enqueued == 3
    state = await api.svc.queue.budgets.get("team")
    assert state.limit == 10_000 and state.used == 0
    spent = await _run_all(api, prefix, redis_url, ids)
    assert (await api.svc.queue.budgets.get("team")).used == spent


async def test_a_submission_naming_a_lost_budget_rebuilds_it(api: Running) -> None:
    await api.svc.queue.budgets.create("team", 10_000, window="month")
    first = await _submit(api, "team", 1)
    await api.svc.ledger.snapshot()
    await _wipe_redis(api)
    # the API does not answer 404 for a budget the store knows: it rebuilds it, then enqueues
    second = await _submit(api, "team", 1)
    assert first != second
    assert (await api.svc.queue.budgets.get("team")).window == "month"
    assert (await api.svc.queue.counts())["waiting"] == 1
    # a budget nobody ever made is still a 404
    resp = await api.client.post(
        "/v1/jobs", json={"type": "generic", "payload": {}, "tokens": 1, "budget": "nobody"}
    )
    assert resp.status_code == 404
