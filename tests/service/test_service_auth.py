"""API keys: every request needs one outside ``sluice dev``, and a tenant sees only its own jobs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import text

from sluice.service import asgi
from tests.harness.service_harness import Running, running_service


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix, auth=True) as svc:
        yield svc


async def test_a_request_without_a_live_key_is_a_401(api: Running) -> None:
    bad: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer sk_nope"},
        {"Authorization": "Basic abc"},
        {"X-API-Key": "x"},
    ]
    for headers in bad:
        resp = await api.client.post("/jobs", json={"type": "generic", "payload": {}}, headers=headers)
        assert resp.status_code == 401, headers
        assert resp.json()["error"]["code"] == "unauthorized"
    assert (await api.svc.queue.counts())["added"] == 0
    # health needs no key
    assert (await api.client.get("/healthz")).status_code == 200


async def test_a_tenant_sees_only_its_own_jobs(api: Running) -> None:
    _, key_a = await api.svc.keys.create("acme")
    _, key_b = await api.svc.keys.create("globex")
    a = {"Authorization": f"Bearer {key_a}"}
    b = {"X-API-Key": key_b}
    job = (await api.client.post("/jobs", json={"type": "generic", "payload": {}}, headers=a)).json()
    mine = await api.client.get(f"/jobs/{job['id']}", headers=a)
    assert mine.status_code == 200
    for path in (f"/jobs/{job['id']}", f"/v1/jobs/{job['id']}"):
        theirs = await api.client.get(path, headers=b)
        assert theirs.status_code == 404, path  # not 403: another tenant's ids are not even confirmed
    assert (await api.client.get("/v1/jobs", headers=b)).json()["jobs"] == []
    assert [j["id"] for j in (await api.client.get("/v1/jobs", headers=a)).json()["jobs"]] == [job["id"]]
    cancel = await api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=b)
    assert cancel.status_code == 404
    # the same idempotency key in two tenants names two jobs
    k = {"type": "generic", "payload": {}, "idempotencyKey": "shared"}
    first = (await api.client.post("/jobs", json=k, headers=a)).json()["id"]
    second = (await api.client.post("/jobs", json=k, headers=b)).json()["id"]
    assert first != second


async def test_a_revoked_key_stops_working(api: Running) -> None:
    record, key = await api.svc.keys.create("acme", name="ci")
    headers = {"Authorization": f"Bearer {key}"}
    assert (await api.client.get("/v1/jobs", headers=headers)).status_code == 200
    assert await api.svc.keys.revoke(record.id)
    assert not await api.svc.keys.revoke(record.id)
    api.svc.key_cache.clear()  # (a running API forgets it within 30 s)
    assert (await api.client.get("/v1/jobs", headers=headers)).status_code == 401
    # only a digest is stored, never the key
    rows = [k for k in await api.svc.keys.list_keys() if k.id == record.id]
    assert rows and rows[0].prefix == key[:10] and rows[0].revoked_at is not None
    async with api.svc.db.engine.connect() as conn:
        dump = str((await conn.execute(text("SELECT * FROM api_keys"))).all())
    assert key not in dump and key[10:20] not in dump


async def test_no_variable_turns_authentication_off(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    # The entry point sluice serve runs reads SLUICE_*; none of them disables keys
    for name, value in (
        ("SLUICE_REDIS_URL", redis_url),
        ("SLUICE_DATABASE_URL", sluice_database_url),
        ("SLUICE_PREFIX", prefix),
        ("SLUICE_NO_AUTH", "1"),
        ("SLUICE_AUTH", "false"),
        ("SLUICE_SINK", "false"),
    ):
        monkeypatch.setenv(name, value)
    app = asgi.app()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            resp = await client.post("/jobs", json={"type": "generic", "payload": {}})
    assert resp.status_code == 401
