"""ArQueue's routes (POST /enqueue, GET /dead_letter, GET /metrics), /pressure and backpressure."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sluice.service.handlers import service_worker
from tests.conftest import eventually, running
from tests.harness.service_harness import Running, running_service


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix) as svc:
        yield svc


async def test_enqueue_answers_in_the_designs_shape_and_codes(api: Running) -> None:
    resp = await api.client.post(
        "/enqueue",
        json={"type": "send_email", "payload": {"to": "a@b.c", "subject": "hi"}},
        headers={"X-Request-ID": "r-1"},
    )
    assert resp.status_code == 201
    body = resp.json()
    assert set(body) == {"taskId", "queueLength", "requestId"}
    assert uuid.UUID(body["taskId"]) and body["queueLength"] == 1 and body["requestId"] == "r-1"
    record = await api.svc.queue.get_job(body["taskId"])
    assert record is not None and record.max_attempts == 4  # maxRetries 3 by default: 4 attempts
    assert (record.backoff.delay, record.backoff.max_delay, record.backoff.jitter) == (2.0, 60.0, 0.1)
    for bad, field in (
        ({"type": "x", "payload": {}, "maxRetries": 11}, "maxRetries"),
        ({"type": "x", "payload": "no"}, "payload"),
        ({"type": "x", "payload": {}, "extra": 1}, "extra"),
    ):
        r = await api.client.post("/enqueue", json=bad)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, bad
    text = await api.client.post("/enqueue", content=b"type=x", headers={"content-type": "text/plain"})
    assert text.status_code == 415
    same = {"type": "generic", "payload": {}, "idempotencyKey": "once"}
    first = (await api.client.post("/enqueue", json=same)).json()["taskId"]
    assert (await api.client.post("/enqueue", json=same)).json()["taskId"] == first


async def test_dead_letter_and_metrics_after_jobs_ran(api: Running, prefix: str, redis_url: str) -> None:
    ok = (await api.client.post("/enqueue", json={"type": "generic", "payload": {}})).json()["taskId"]
    bad = (
        await api.client.post(
            "/enqueue", json={"type": "generic", "payload": {"fail": True}, "maxRetries": 0}
        )
    ).json()["taskId"]
    async with running(service_worker(prefix=prefix), redis_url):

        async def settled() -> bool:
            await api.drain_events()
            dead = (await api.client.get("/dead_letter")).json()
            done = (await api.client.get(f"/jobs/{ok}")).json()["status"] == "COMPLETED"
            return done and [d["id"] for d in dead] == [bad]

        await eventually(settled, timeout=20)
    dead: list[dict[str, Any]] = (await api.client.get("/dead_letter", params={"limit": 5})).json()
    assert set(dead[0]) == {
        "id",
        "type",
        "payload",
        "retries",
        "maxRetries",
        "lastError",
        "createdAt",
        "startedAt",
    }
    assert (dead[0]["retries"], dead[0]["maxRetries"]) == (0, 0) and "payload.fail" in dead[0]["lastError"]
    m = (await api.client.get("/metrics")).json()
    assert (m["jobs_done"], m["queue_dead_letter"], m["jobs_failed"], m["queue_pending"]) == (1, 1, 1, 0)
    lat = m["latency_ms"]
    assert lat["sample"]["jobs"] == 1
    assert lat["end_to_end"]["p50"] >= lat["processing"]["p50"] >= 0


async def test_backpressure_refuses_with_retry_after(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with running_service(redis_url, sluice_database_url, prefix, max_depth=3) as api:
        for i in range(4):
            assert (
                await api.client.post("/v1/jobs", json={"type": "generic", "payload": {"i": i}})
            ).status_code == 201
            api.svc.pressure._cached = None
        p = (await api.client.get("/pressure")).json()
        assert (p["depth"], p["refusing"], p["maxDepth"]) == (4, True, 3) and p["score"] > 1
        for path, body in (("/v1/jobs", {"type": "generic"}), ("/jobs", {"type": "generic", "payload": {}})):
            refused = await api.client.post(path, json=body)
            assert refused.status_code == 429, path
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "too_many_requests"
        assert (await api.svc.queue.counts())["added"] == 4
