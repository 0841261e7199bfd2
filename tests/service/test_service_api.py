"""The HTTP API end to end: real Redis, a real PostgreSQL database per test, a real worker.

Routes are called through httpx on the ASGI app (its lifespan runs: it
connects and migrates); the transition sink is stepped by the test, so each
check sees exactly what the events carried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest

from sluice.service.handlers import service_worker
from sluice.store import sink as sink_module
from tests.conftest import eventually, running
from tests.harness.service_harness import Running, running_service


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix) as svc:
        yield svc


async def _until_status(api: Running, job_id: str, status: str, path: str = "/jobs/") -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        await api.drain_events()
        body: dict[str, Any] = (await api.client.get(path + job_id)).json()
        return body if body["status"] == status else None

    found: dict[str, Any] = await eventually(reached, timeout=20)
    return found


# ---- the NestJS job service's routes ---------------------------------------------------------------------
async def test_nest_create_answers_the_record_with_the_designs_defaults(api: Running) -> None:
    resp = await api.client.post("/jobs", json={"type": "generic", "payload": {"n": 1}})
    assert resp.status_code == 201
    body = resp.json()
    assert set(body) >= {
        "id",
        "type",
        "status",
        "priority",
        "attempts",
        "maxAttempts",
        "createdAt",
        "updatedAt",
        "processedAt",
        "completedAt",
        "error",
        "result",
    }
    assert uuid.UUID(body["id"]).version == 7
    assert (body["type"], body["status"], body["priority"], body["attempts"], body["maxAttempts"]) == (
        "generic",
        "QUEUED",
        10,
        0,
        10,
    )
    assert body["processedAt"] is None and body["completedAt"] is None and body["result"] is None
    got = await api.client.get(f"/jobs/{body['id']}")
    assert got.status_code == 200 and got.json()["id"] == body["id"]
    # the engine has it, under the priority the design gave it
    record = await api.svc.queue.get_job(body["id"])
    assert record is not None and (record.name, record.priority, record.max_attempts) == ("generic", 10, 10)


async def test_nest_idempotency_key_returns_the_first_job_with_201(api: Running) -> None:
    first = await api.client.post("/jobs", json={"type": "generic", "payload": {}, "idempotencyKey": "k-1"})
    again = await api.client.post(
        "/jobs", json={"type": "email", "payload": {"to": "x@y"}, "idempotencyKey": "k-1"}
    )
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"] and again.json()["type"] == "generic"
    assert (await api.svc.queue.counts())["waiting"] == 1


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"type": "generic", "payload": {}, "priorty": 5}, "priorty", "unknown field 'priorty'"),
        ({"type": "generic", "payload": {}, "priority": 7}, "priority", "priority"),
        ({"type": "generic", "payload": [1]}, "payload", "payload"),
        ({"payload": {}}, "type", "type"),
        ({"type": "generic", "payload": {}, "maxAttempts": 0}, "maxAttempts", "maxAttempts"),
        ({"type": "no spaces", "payload": {}}, "type", "type"),
    ],
)
async def test_bad_input_is_a_422_naming_the_field(
    api: Running, body: dict[str, Any], field: str, says: str
) -> None:
    resp = await api.client.post("/jobs", json=body)
    assert resp.status_code == 422
    err = resp.json()
    assert err["statusCode"] == 422 and err["error"]["field"] == field and says in err["message"]
    assert (await api.svc.queue.counts())["added"] == 0


async def test_not_json_and_unknown_ids_have_the_same_error_shape(api: Running) -> None:
    bad = await api.client.post("/jobs", content=b"{nope", headers={"content-type": "application/json"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid"
    for path in (f"/jobs/{uuid.uuid4()}", "/jobs/not-a-uuid", f"/v1/jobs/{uuid.uuid4()}"):
        missing = await api.client.get(path)
        assert missing.status_code == 404, path
        assert set(missing.json()) == {"statusCode", "message", "error"}
        assert missing.json()["error"]["code"] == "not_found"


async def test_a_body_over_the_limit_is_a_413(redis_url: str, sluice_database_url: str, prefix: str) -> None:
    async with running_service(redis_url, sluice_database_url, prefix, max_body_bytes=2048) as api:
        big = {"type": "generic", "payload": {"text": "x" * 4000}}
        resp = await api.client.post("/jobs", json=big)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "payload_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
            yield b'{"type": "generic", "payload": {"text": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}}'

        streamed = await api.client.post(
            "/jobs", content=chunks(), headers={"content-type": "application/json"}
        )
        assert streamed.status_code == 413
        assert (await api.svc.queue.counts())["added"] == 0


# ---- /v1 ------------------------------------------------------------------------------------------------
async def test_v1_create_list_filter_and_page(api: Running) -> None:
    made = []
    for i in range(5):
        kind = "generic" if i % 2 == 0 else "email"
        resp = await api.client.post("/v1/jobs", json={"type": kind, "payload": {"i": i}, "priority": i})
        assert resp.status_code == 201 and resp.json()["created"] is True
        made.append(resp.json()["id"])
    dup = await api.client.post("/v1/jobs", json={"type": "generic", "idempotency_key": "a"})
    again = await api.client.post("/v1/jobs", json={"type": "generic", "idempotency_key": "a"})
    assert (dup.status_code, again.status_code, again.json()["created"]) == (201, 200, False)
    made.append(dup.json()["id"])
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = (await api.client.get("/v1/jobs", params=params)).json()
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == made[::-1]  # newest first, each once
    emails = (await api.client.get("/v1/jobs", params={"type": "email"})).json()["jobs"]
    assert [j["payload"]["i"] for j in emails] == [3, 1]
    bad = await api.client.get("/v1/jobs", params={"status": "DONE"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "status"
    assert (await api.client.get("/v1/jobs", params={"cursor": "garbage"})).status_code == 422


async def test_jobs_run_and_every_transition_reaches_the_store(
    api: Running, prefix: str, redis_url: str
) -> None:
    # Given a job that fails twice (its payload says so) and one that completes
    ok = (await api.client.post("/v1/jobs", json={"type": "generic", "payload": {"n": 1}})).json()
    failing = (
        await api.client.post(
            "/v1/jobs", json={"type": "generic", "payload": {"fail": True}, "max_attempts": 2}
        )
    ).json()
    async with running(service_worker(prefix=prefix, concurrency=2), redis_url):
        done = await _until_status(api, ok["id"], "COMPLETED", "/v1/jobs/")
        dead = await _until_status(api, failing["id"], "DEAD_LETTER", "/v1/jobs/")
    assert done["result"] == {"ok": True, "attempt": 1}
    assert done["processed_at"] is not None and done["completed_at"] is not None
    # the times are the events' own (the stream ids' ms), in order, and of this run
    created, processed, completed = (
        datetime.fromisoformat(done[k]) for k in ("created_at", "processed_at", "completed_at")
    )
    assert created <= processed + timedelta(milliseconds=1) and processed <= completed
    assert completed - created < timedelta(seconds=30)
    (only,) = done["attempt_list"]
    assert (datetime.fromisoformat(only["started_at"]), datetime.fromisoformat(only["finished_at"])) == (
        processed,
        completed,
    )
    assert [(a["attempt"], a["outcome"]) for a in done["attempt_list"]] == [(1, "completed")]
    assert dead["attempts"] == 2 and "payload.fail is true" in dead["error"]
    assert [(a["attempt"], a["outcome"]) for a in dead["attempt_list"]] == [(1, "failed"), (2, "failed")]
    assert all(a["finished_at"] is not None and "payload.fail" in a["error"] for a in dead["attempt_list"])


async def test_the_sink_applies_a_batch_again_without_change(api: Running) -> None:
    job = (await api.client.post("/v1/jobs", json={"type": "generic"})).json()
    reply = await api.svc.queue.protocol.step(want=1, lease_ms=10_000, worker_id="w")
    token = reply.jobs[1]
    await api.svc.queue.protocol.step(
        want=0, lease_ms=10_000, worker_id="w", outcomes=[(job["id"], token, b"c", b'"done"', 0, -1)]
    )
    entries: Any = await api.svc.queue.redis.xrange(api.svc.queue.keys.events, "-", "+")
    await api.sink._apply(entries)
    await api.sink._apply(entries)
    await api.sink._apply(entries[:2])
    got = (await api.client.get(f"/v1/jobs/{job['id']}")).json()
    assert (got["status"], got["result"], got["attempts"]) == ("COMPLETED", "done", 1)
    assert [(a["token"], a["outcome"]) for a in got["attempt_list"]] == [(1, "completed")]


async def test_a_batch_applied_after_a_newer_one_keeps_the_state_and_still_writes_its_attempts(
    api: Running,
) -> None:
    # Given a job leased and completed, whose events a dead sink had read (the lease) and a
    # new sink applied past (the completion)
    job = (await api.client.post("/v1/jobs", json={"type": "generic"})).json()
    reply = await api.svc.queue.protocol.step(want=1, lease_ms=10_000, worker_id="w")
    await api.svc.queue.protocol.step(
        want=0, lease_ms=10_000, worker_id="w", outcomes=[(job["id"], reply.jobs[1], b"c", b'"done"', 0, -1)]
    )
    entries: Any = await api.svc.queue.redis.xrange(api.svc.queue.keys.events, "-", "+")
    names = [fields[b"ev"] for _, fields in entries]
    assert names == [b"added", b"active", b"completed"]
    await api.sink._apply(entries[2:])
    # When the older batch is applied late
    await api.sink._apply(entries[:2])
    # Then the job stays COMPLETED, and its attempt is written all the same
    got = (await api.client.get(f"/v1/jobs/{job['id']}")).json()
    assert (got["status"], got["result"]) == ("COMPLETED", "done")
    assert [a["token"] for a in got["attempt_list"]] == [1]


async def _hget_calls(api: Running) -> int:
    stats: dict[str, Any] = await api.svc.queue.redis.info("commandstats")
    return int(stats.get("cmdstat_hget", {}).get("calls", 0))


async def test_the_engine_knows_a_job_by_its_store_id_and_the_sink_reads_no_record(api: Running) -> None:
    # Given jobs submitted through the API and one added to the engine directly, without an id
    ids = [(await api.client.post("/v1/jobs", json={"type": "generic"})).json()["id"] for _ in range(3)]
    other = await api.svc.queue.add("generic", {})
    entries: Any = await api.svc.queue.redis.xrange(api.svc.queue.keys.events, "-", "+")
    added = [fields for _, fields in entries if fields[b"ev"] == b"added"]
    # Then the engine's events name the API's jobs by their store ids, and the other by its number
    assert [f[b"id"].decode() for f in added] == [*ids, other.id]
    assert other.id.isdigit()
    for job_id in ids:
        record = await api.svc.queue.get_job(job_id)
        assert record is not None and record.idempotency_key == f"job:{job_id}"
    # When the jobs move, the API's reach the store with no read of their records; the other
    # is looked up once (it may be an earlier version's job, numbered) and skipped
    before = await _hget_calls(api)
    reply = await api.svc.queue.protocol.step(want=4, lease_ms=10_000, worker_id="w")
    assert len(reply.jobs) == 4 * 15  # four jobs leased, 15 fields each
    await api.drain_events()
    assert await _hget_calls(api) == before + 1
    for job_id in ids:
        assert (await api.client.get(f"/v1/jobs/{job_id}")).json()["status"] == "PROCESSING"


async def test_a_dead_consumers_pending_events_are_taken_over_and_looked_for_now_and_then(
    api: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sink_module, "CLAIM_IDLE_MS", 50)
    monkeypatch.setattr(sink_module, "CLAIM_EVERY_S", 0.5)
    redis, events = api.svc.queue.redis, api.svc.queue.keys.events
    await api.sink.ensure_group()

    async def started_by_a_consumer_that_dies() -> str:
        # a job leased, whose events another API process's sink read and never acknowledged
        job = (await api.client.post("/v1/jobs", json={"type": "generic"})).json()
        await api.svc.queue.protocol.step(want=1, lease_ms=10_000, worker_id="w")
        await redis.xreadgroup(sink_module.GROUP, "dead", {events: ">"})
        return str(job["id"])

    async def status(job_id: str) -> str:
        return str((await api.client.get(f"/v1/jobs/{job_id}")).json()["status"])

    first = await started_by_a_consumer_that_dies()
    await asyncio.sleep(0.1)
    # The first step looks, finds them idle long enough, and applies them
    await api.drain_events()
    assert await status(first) == "PROCESSING"
    # A look that found nothing is not repeated at every step: the next dead entries wait for
    # the next look, then are applied
    await api.drain_events()
    second = await started_by_a_consumer_that_dies()
    await asyncio.sleep(0.1)
    await api.drain_events()
    assert await status(second) == "QUEUED"
    await asyncio.sleep(0.5)
    await api.drain_events()
    assert await status(second) == "PROCESSING"
    pending: Any = await redis.xpending(events, sink_module.GROUP)
    assert pending["pending"] == 0


async def test_a_look_for_a_dead_consumers_events_reads_only_its_list_a_batch_at_a_time(
    api: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sink_module, "CLAIM_IDLE_MS", 50)
    monkeypatch.setattr(api.sink, "batch", 3)
    redis, events = api.svc.queue.redis, api.svc.queue.keys.events
    await api.sink.ensure_group()
    # Seven jobs leased, whose events a sink that then died read and never acknowledged; and
    # one more job's, that this sink has read and not yet acknowledged (its batch in flight)
    ids = [(await api.client.post("/v1/jobs", json={"type": "generic"})).json()["id"] for _ in range(7)]
    await api.svc.queue.protocol.step(want=7, lease_ms=10_000, worker_id="w")
    read: Any = await redis.xreadgroup(sink_module.GROUP, "dead", {events: ">"})
    assert len(read[0][1]) == 14  # each job's 'added' and 'active'
    await api.client.post("/v1/jobs", json={"type": "generic"})
    await redis.xreadgroup(sink_module.GROUP, api.sink.consumer, {events: ">"})
    await asyncio.sleep(0.1)
    looked_into: list[str] = []
    xpending_range = redis.xpending_range

    async def spied(*args: Any, **kwargs: Any) -> Any:
        looked_into.append(kwargs["consumername"])
        return await xpending_range(*args, **kwargs)

    async def no_scan(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("XAUTOCLAIM scans every consumer's pending entries")

    monkeypatch.setattr(redis, "xpending_range", spied)
    monkeypatch.setattr(redis, "xautoclaim", no_scan)
    await api.drain_events()
    # Only the dead consumer's list was looked into, a batch (3) at a time, until all its
    # fourteen entries were taken over and applied
    assert looked_into and set(looked_into) == {"dead"} and len(looked_into) >= 5
    statuses = {(await api.client.get(f"/v1/jobs/{i}")).json()["status"] for i in ids}
    assert statuses == {"PROCESSING"}
    pending: Any = await redis.xpending(events, sink_module.GROUP)
    assert pending["pending"] == 0


# ---- the reconciler ----------------------------------------------------------------------------------------
async def test_a_job_stored_but_never_enqueued_is_enqueued_by_the_reconciler(api: Running) -> None:
    # Given a job the API stored, then crashed before enqueueing (the store write alone)
    from sluice.service.routes_v1 import new_job
    from sluice.service.schemas import JobIn

    stored, _ = await api.svc.store.create(
        new_job(JobIn.model_validate({"type": "generic"}), "default", "jobs", None)
    )
    assert (await api.svc.queue.counts())["added"] == 0
    # When the reconciler passes (after its grace)
    later = stored.created_at + (await _grace(api))
    done = await api.reconciler.reconcile(now=later)
    # Then the engine has it, once, under the job's id; a second pass changes nothing
    assert (done.enqueued, (await api.svc.queue.counts())["waiting"]) == (1, 1)
    assert (await api.reconciler.reconcile(now=later)).enqueued == 0
    await api.drain_events()
    row = await api.svc.store.get(stored.id)
    assert row is not None and row.status == "QUEUED"
    record = await api.svc.queue.get_job(str(stored.id))
    assert record is not None and record.state.value == "waiting"


@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("a payload over the queue's limit", "over this queue's limit"),
        ("a budget neither Redis nor the store's copy knows", "nowhere"),
    ],
)
async def test_a_stored_job_the_engine_refuses_ends_rejected_and_does_not_stop_the_reconciler(
    api: Running, what: str, says: str
) -> None:
    # Given a row an older version stored, which the engine cannot take, and a good one after it
    from sluice.service.routes_v1 import new_job
    from sluice.service.schemas import JobIn

    good = new_job(JobIn.model_validate({"type": "generic"}), "default", "jobs", None)
    if what.startswith("a payload"):
        bad = dataclasses.replace(good, payload={"text": "x" * api.svc.queue.max_payload_bytes})
    else:
        bad = dataclasses.replace(good, tokens=5, budget="nowhere")
    stored_bad, _ = await api.svc.store.create(bad)
    stored_good, _ = await api.svc.store.create(good)
    # When the reconciler passes
    later = stored_good.created_at + (await _grace(api))
    done = await api.reconciler.reconcile(now=later)
    # Then the bad one is REJECTED with the reason, and the good one is enqueued all the same
    assert (done.rejected, done.enqueued) == (1, 1), what
    row = await api.svc.store.get(stored_bad.id)
    assert row is not None and row.status == "REJECTED" and says in (row.error or "")
    assert (await api.reconciler.reconcile(now=later)).rejected == 0


async def test_jobs_redis_forgot_are_enqueued_again(api: Running, prefix: str, redis_url: str) -> None:
    # Given two jobs accepted and known to the store, then Redis loses its data
    ids = [
        (await api.client.post("/v1/jobs", json={"type": "generic", "payload": {"i": i}})).json()["id"]
        for i in range(2)
    ]
    await api.drain_events()
    keys: Any = [k async for k in api.svc.queue.redis.scan_iter(match=api.svc.queue.keys.base + "*")]
    await api.svc.queue.redis.delete(*keys)
    # When the reconciler passes
    later = (await api.svc.store.get(uuid.UUID(ids[1]))).updated_at + (await _grace(api))  # type: ignore[union-attr]
    done = await api.reconciler.reconcile(now=later, full=True)
    # Then both run again, and the store follows them to the end
    assert done.enqueued == 2
    async with running(service_worker(prefix=prefix), redis_url):
        for job_id in ids:
            await _until_status(api, job_id, "COMPLETED", "/v1/jobs/")


async def test_a_job_waiting_past_the_grace_is_found_by_its_id_and_never_enqueued_again(
    api: Running, prefix: str, redis_url: str
) -> None:
    # Given jobs accepted and waiting (no worker; one delayed by a week): the sink skips
    # 'added', so no event has been applied to their rows yet
    bodies: list[dict[str, Any]] = [{"type": "generic", "payload": {"i": i}} for i in range(2)]
    bodies.append({"type": "generic", "payload": {}, "delay": 7 * 86_400_000})
    answers = [await api.client.post("/jobs", json=body) for body in bodies]
    ids = [uuid.UUID(a.json()["id"]) for a in answers]
    await api.drain_events()
    rows = [await api.svc.store.get(i) for i in ids]
    assert [r.status for r in rows if r is not None] == ["QUEUED"] * 3
    # When the reconciler passes after the grace
    later = max(r.updated_at for r in rows if r is not None) + (await _grace(api))
    first = await api.reconciler.reconcile(now=later)
    # Then it found them in the engine by their ids: nothing enqueued twice
    assert first.enqueued == 0
    assert first.looked >= 3
    # and when their idempotency keys have expired (the queue's TTL, shorter than the delay),
    # later passes, even full ones, still find the jobs by their ids: nothing enqueued again
    later += timedelta(seconds=api.svc.queue.idempotency_ttl_ms / 1000)
    idem_keys = [api.svc.queue.keys.idem(f"job:{i}") for i in ids]
    assert await api.svc.queue.redis.delete(*idem_keys) == 3
    assert (await api.reconciler.reconcile(now=later)).enqueued == 0
    # a waiting job is cancelled by its id as well
    cancel = await api.client.post(f"/v1/jobs/{ids[2]}/cancel")
    assert cancel.status_code == 200, cancel.text
    # and the others run to the end as usual
    async with running(service_worker(prefix=prefix), redis_url):
        for job_id in ids[:2]:
            await _until_status(api, str(job_id), "COMPLETED", "/v1/jobs/")


async def _grace(api: Running) -> Any:
    from datetime import timedelta

    return timedelta(seconds=api.svc.settings.reconcile_grace + 1)


async def test_readyz_says_which_dependency_is_down(api: Running) -> None:
    ok = await api.client.get("/readyz")
    assert ok.status_code == 200 and ok.json()["checks"] == {"redis": "ok", "postgres": "ok"}
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}


async def test_openapi_lists_every_route(api: Running) -> None:
    spec = (await api.client.get("/openapi.json")).json()
    assert {
        "/jobs",
        "/jobs/{job_id}",
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/batch",
        "/healthz",
        "/readyz",
    } <= set(spec["paths"])


async def test_concurrent_duplicates_make_one_job(api: Running) -> None:
    async def submit() -> tuple[int, str]:
        resp = await api.client.post(
            "/jobs", json={"type": "generic", "payload": {}, "idempotencyKey": "same"}
        )
        return resp.status_code, resp.json()["id"]

    answers = await asyncio.gather(*(submit() for _ in range(200)))
    assert {status for status, _ in answers} == {201}
    assert len({job_id for _, job_id in answers}) == 1
    assert (await api.svc.queue.counts())["added"] == 1
    assert (await api.svc.store.counts()) == {"QUEUED": 1}


async def test_submissions_that_arrive_together_are_written_together(api: Running) -> None:
    # 200 submissions at once: 50 keys, each sent 4 times, so duplicates share batches too
    async def send(i: int) -> dict[str, Any]:
        body = {"type": "generic", "payload": {"i": i % 50}, "idempotency_key": f"k{i % 50}"}
        resp = await api.client.post("/v1/jobs", json=body)
        assert resp.status_code in (200, 201), resp.text
        return dict(resp.json())

    answers = await asyncio.gather(*(send(i) for i in range(200)))
    intake = api.svc.intake
    assert intake.jobs == 200 and intake.batches < 50  # written in a few statements, not 200
    by_key: dict[str, set[str]] = {}
    for a in answers:
        by_key.setdefault(a["idempotency_key"], set()).add(a["id"])
    assert all(len(ids) == 1 for ids in by_key.values()) and len(by_key) == 50
    assert sum(a["created"] for a in answers) == 50  # one creator per key
    assert (await api.svc.queue.counts())["added"] == 50
    assert sum((await api.svc.store.counts("default")).values()) == 50


async def test_the_intake_replaces_a_connection_the_server_closed(api: Running) -> None:
    # Given the intake's kept connection (made by a first submission)
    first = await api.client.post("/v1/jobs", json={"type": "generic"})
    assert first.status_code == 201
    # When PostgreSQL ends every other session of the database (as a restart or an admin would)
    async with api.svc.db.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        ended = await raw.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    assert ended >= 1
    await asyncio.sleep(0.2)  # the closed socket reaches asyncpg
    # Then the next submissions are stored and enqueued as usual, on a new connection
    for i in range(3):
        again = await api.client.post("/v1/jobs", json={"type": "generic", "payload": {"i": i}})
        assert again.status_code == 201, again.text
    assert (await api.svc.queue.counts())["added"] == 4


async def test_a_store_that_cannot_be_reached_is_a_503_in_the_one_error_shape(api: Running) -> None:
    from sluice.local.embedded import free_port
    from sluice.store.database import Database
    from sluice.store.jobs import JobStore

    # Given an intake whose PostgreSQL is down (nothing listens on its port)
    dead = Database(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/gone")
    api.svc.intake.store = JobStore(dead)
    try:
        for path, body in (("/jobs", {"type": "generic", "payload": {}}), ("/v1/jobs", {"type": "generic"})):
            # When a job is submitted
            resp = await api.client.post(path, json=body)
            # Then it is refused as unavailable, to be sent again, and nothing was enqueued
            assert resp.status_code == 503, resp.text
            assert resp.headers["retry-after"] == "1"
            assert resp.json()["error"]["code"] == "unavailable"
            assert "PostgreSQL" in resp.json()["message"]
        assert (await api.svc.queue.counts())["added"] == 0
    finally:
        await dead.close()


async def test_a_job_whose_events_were_lost_is_finished_from_the_engine_once_the_sink_is_done(
    api: Running,
) -> None:
    # Given a job the engine completed, whose events the sink has not read
    job = (await api.client.post("/v1/jobs", json={"type": "generic"})).json()
    await api.sink.ensure_group()
    reply = await api.svc.queue.protocol.step(want=1, lease_ms=10_000, worker_id="w")
    await api.svc.queue.protocol.step(
        want=0, lease_ms=10_000, worker_id="w", outcomes=[(job["id"], reply.jobs[1], b"c", b'"done"', 0, -1)]
    )
    row = await api.svc.store.get(uuid.UUID(job["id"]))
    assert row is not None
    later = row.updated_at + (await _grace(api))
    # When the reconciler passes while the sink is behind: the final state is the sink's to write
    assert (await api.reconciler.reconcile(now=later, full=True)).finished == 0
    # and when the stream lost the events (trimmed unread): the reconciler takes the engine's
    await api.svc.queue.redis.xtrim(api.svc.queue.keys.events, maxlen=0)
    assert (await api.reconciler.reconcile(now=later, full=True)).finished == 1
    got = (await api.client.get(f"/v1/jobs/{job['id']}")).json()
    assert (got["status"], got["result"]) == ("COMPLETED", "done")


async def test_a_waiting_job_is_cancelled_through_the_api(api: Running) -> None:
    # Given a job waiting (no worker), whose row no event has named yet
    job = (await api.client.post("/v1/jobs", json={"type": "generic"})).json()
    await api.drain_events()
    # When it is cancelled
    resp = await api.client.post(f"/v1/jobs/{job['id']}/cancel")
    # Then the engine cancels it, the store follows, and cancelling again is a 409
    assert resp.status_code == 200, resp.text
    assert (await api.svc.queue.counts())["cancelled"] == 1
    await api.drain_events()
    assert (await api.client.get(f"/v1/jobs/{job['id']}")).json()["status"] == "CANCELLED"
    assert (await api.client.post(f"/v1/jobs/{job['id']}/cancel")).status_code == 409


# ---- one job id ------------------------------------------------------------------------------------------
async def test_a_job_cancelled_before_its_add_reaches_the_engine_is_never_added(api: Running) -> None:
    # Given a job the store holds but the engine does not yet (its batch on its way to Redis)
    from sluice.service.routes_v1 import new_job
    from sluice.service.schemas import JobIn
    from sluice.service.submit import enqueue

    stored, _ = await api.svc.store.create(
        new_job(JobIn.model_validate({"type": "generic"}), "default", "jobs", None)
    )
    # When it is cancelled (no 409 "being enqueued": the cancel goes ahead of the add)
    answer = await api.client.post(f"/v1/jobs/{stored.id}/cancel")
    assert answer.status_code == 200, answer.text
    # Then the add that follows adds nothing, the store says CANCELLED, and nothing runs
    assert await enqueue(api.svc.queue, stored) == str(stored.id)
    counts = await api.svc.queue.counts()
    assert (counts["added"], counts["waiting"]) == (0, 0)
    await _until_status(api, str(stored.id), "CANCELLED", "/v1/jobs/")
    # and the reconciler, passing after its grace, does not enqueue it either
    assert (await api.reconciler.reconcile(now=stored.created_at + (await _grace(api)))).enqueued == 0


async def test_a_job_an_earlier_version_enqueued_under_a_number_is_still_reconciled_cancelled_and_applied(
    api: Running,
) -> None:
    # Given a job an earlier version stored and enqueued: a numbered engine id under the key
    # job:<uuid>, and the number kept by migration 0009 in job_legacy_ids
    from sqlalchemy import text

    from sluice.service.routes_v1 import new_job
    from sluice.service.schemas import JobIn
    from sluice.service.submit import spec_of
    from sluice.store.sink import engine_key

    stored, _ = await api.svc.store.create(
        new_job(JobIn.model_validate({"type": "generic"}), "default", "jobs", None)
    )
    (old,) = await api.svc.queue.add_bulk([spec_of(stored, engine_key(stored.id))])
    assert old.id.isdigit()
    async with api.svc.store.db.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO job_legacy_ids (job_id, engine_id) VALUES (:j, :e)"),
            {"j": stored.id, "e": int(old.id)},
        )
    # When the reconciler passes, even a full pass, after its keys expired
    await api.svc.queue.redis.delete(api.svc.queue.keys.idem(engine_key(stored.id)))
    done = await api.reconciler.reconcile(now=stored.created_at + (await _grace(api)), full=True)
    # Then it finds the job by its number: nothing enqueued again
    assert done.enqueued == 0
    assert (await api.svc.queue.counts())["added"] == 1
    # and a cancel reaches it, and the sink carries the cancel to the row
    assert (await api.client.post(f"/v1/jobs/{stored.id}/cancel")).status_code == 200
    record = await api.svc.queue.get_job(old.id)
    assert record is not None and record.state.value == "cancelled"
    await _until_status(api, str(stored.id), "CANCELLED", "/v1/jobs/")
