"""Operators' routes: the dead-letter queue, pause/resume/throttle, budgets; admin keys only."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sluice.service.handlers import service_worker
from tests.conftest import eventually, running
from tests.harness.service_harness import Running, running_service


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix, auth=True) as svc:
        yield svc


async def _keys(api: Running) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    _, admin = await api.svc.keys.create("acme", admin=True)
    _, user = await api.svc.keys.create("acme")
    _, other = await api.svc.keys.create("globex", admin=True)
    return ({"Authorization": f"Bearer {k}"} for k in (admin, user, other))  # type: ignore[return-value]


async def test_dead_letters_are_listed_redriven_and_purged_per_tenant(
    api: Running, prefix: str, redis_url: str
) -> None:
    admin, user, other = await _keys(api)
    fail = {"type": "generic", "payload": {"fail": True}, "max_attempts": 1}
    mine = [(await api.client.post("/v1/jobs", json=fail, headers=admin)).json()["id"] for _ in range(2)]
    theirs = (await api.client.post("/v1/jobs", json=fail, headers=other)).json()["id"]
    async with running(service_worker(prefix=prefix), redis_url):

        async def all_dead() -> bool:
            # Dead in Redis first: their events are then in the stream, and the drain applies them.
            if (await api.svc.queue.counts())["dead"] != 3:
                return False
            await api.drain_events()
            return True

        await eventually(all_dead, timeout=20)
    listed = (await api.client.get("/v1/dead-letters", headers=user)).json()["jobs"]
    assert sorted(j["id"] for j in listed) == sorted(mine)
    # a plain key may look but not act; another tenant's admin cannot touch mine
    assert (await api.client.post("/v1/dead-letters/redrive", json={}, headers=user)).status_code == 403
    cross = await api.client.post("/v1/dead-letters/redrive", json={"ids": [mine[0]]}, headers=other)
    assert cross.status_code == 404
    # redrive one of mine: it runs again (and fails again); purge all of mine: theirs stays
    one = await api.client.post("/v1/dead-letters/redrive", json={"ids": [mine[0]]}, headers=admin)
    assert one.json() == {"redriven": 1}
    await api.drain_events()
    assert (await api.client.get(f"/v1/jobs/{mine[0]}", headers=admin)).json()["status"] == "QUEUED"
    assert (await api.client.post("/v1/dead-letters/purge", json={}, headers=admin)).json() == {"purged": 1}
    dead = await api.svc.queue.dead_letters()
    assert len(dead) == 1 and dead[0].idempotency_key == f"job:{theirs}"


async def test_pause_resume_throttle_and_budgets_need_an_admin(api: Running) -> None:
    admin, user, _ = await _keys(api)
    for path, body in (
        ("/v1/queue/pause", None),
        ("/v1/queue/throttle", {"seconds": 5}),
        ("/v1/budgets", {"name": "b", "limit": 5}),
    ):
        assert (await api.client.post(path, json=body, headers=user)).status_code == 403, path
    assert (await api.client.post("/v1/queue/pause", headers=admin)).json()["paused"] is True
    assert (await api.client.get("/v1/queue", headers=user)).json()["flow"]["paused"] is True
    assert (await api.client.post("/v1/queue/resume", headers=admin)).json()["paused"] is False
    t = (await api.client.post("/v1/queue/throttle", json={"seconds": 30}, headers=admin)).json()
    assert t["throttled_until_ms"] is not None
    bad = await api.client.post("/v1/queue/throttle", json={"seconds": -1}, headers=admin)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "seconds"
    made = await api.client.post(
        "/v1/budgets", json={"name": "team", "limit": 1000, "window": "day"}, headers=admin
    )
    assert made.status_code == 201 and made.json()["limit"] == 1000
    assert (
        await api.client.post("/v1/budgets", json={"name": "team", "limit": 1}, headers=admin)
    ).status_code == 409
    credit = {"tokens": 50, "op_id": "c-1"}
    first = (await api.client.post("/v1/budgets/team/credit", json=credit, headers=admin)).json()
    again = (await api.client.post("/v1/budgets/team/credit", json=credit, headers=admin)).json()
    assert (first["applied"], again["applied"], again["state"]["credit"]) == (True, False, 50)
    assert (await api.client.get("/v1/budgets/nope", headers=admin)).status_code == 404
    assert (await api.client.get("/v1/budgets/team", headers=admin)).json()["remaining"] == 1050
