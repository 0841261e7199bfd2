"""Every transition a worker makes reaches the store, in order, across a worker killed outright
and a Redis killed outright and started again from its append-only file."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from sluice.local.embedded import EmbeddedRedis
from tests.conftest import eventually
from tests.harness.service_harness import Running, running_service

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

JOBS = 12


async def _worker(url: str, prefix: str, home: Path) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(SLUICE_REDIS_URL=url, SLUICE_HOME=str(home))
    argv = ["-m", "sluice", "worker", "sluice.service.handlers:worker", "--prefix", prefix]
    return await asyncio.create_subprocess_exec(
        sys.executable, *argv, "--lease", "1", "-c", "4", env=env, stdout=subprocess.DEVNULL
    )


async def _statuses(api: Running, ids: list[str]) -> list[str]:
    await api.drain_events()
    rows = [await api.svc.store.get(uuid.UUID(i), attempts=True) for i in ids]
    return [r.status if r is not None else "missing" for r in rows]


async def test_transitions_reach_the_store_across_worker_and_redis_crashes(
    sluice_database_url: str, prefix: str, tmp_path: Path
) -> None:
    redis = EmbeddedRedis(tmp_path / "redis", port=0, appendfsync="always").start()
    try:
        async with running_service(redis.url, sluice_database_url, prefix) as api:
            ids = []
            for i in range(JOBS):
                resp = await api.client.post(
                    "/v1/jobs", json={"type": "email", "payload": {"to": f"u{i}@x.org"}}
                )
                ids.append(resp.json()["id"])
            # A worker takes four jobs (each takes a second), and is killed outright while they run
            doomed = await _worker(redis.url, prefix, tmp_path)

            async def four_running() -> bool:
                return (await _statuses(api, ids)).count("PROCESSING") == 4

            await eventually(four_running, timeout=30)
            doomed.send_signal(signal.SIGKILL)
            await doomed.wait()
            running = [i for i, s in zip(ids, await _statuses(api, ids), strict=True) if s == "PROCESSING"]
            # Redis is killed outright too, and comes back from its append-only file
            redis.kill()
            await asyncio.sleep(0.5)
            redis.start()
            # Another worker reaps the dead one's leases and runs everything
            rescuer = await _worker(redis.url, prefix, tmp_path)
            try:

                async def all_done() -> bool:
                    return await _statuses(api, ids) == ["COMPLETED"] * JOBS

                await eventually(all_done, timeout=60)
            finally:
                rescuer.send_signal(signal.SIGINT)
                await rescuer.wait()
            # Then the store has every step, in order: the killed attempts lost their lease,
            # then ran again; the others ran once
            for job_id in ids:
                row = await api.svc.store.get(uuid.UUID(job_id), attempts=True)
                assert row is not None and row.status == "COMPLETED" and row.result["sent"] is True
                outcomes = [(a.attempt, a.outcome) for a in row.attempt_list]
                if job_id in running:
                    assert outcomes == [(1, "lease lost"), (2, "completed")], outcomes
                else:
                    assert outcomes == [(1, "completed")], outcomes
                starts = [a.started_at for a in row.attempt_list]
                assert starts == sorted(starts) and row.processed_at is not None
                assert row.attempts == len(outcomes)
            assert len(running) == 4
            # and the sink's group survived the crash: nothing is left pending or unread
            groups = await api.svc.queue.redis.xinfo_groups(api.svc.queue.keys.events)
            (group,) = [g for g in groups if g["name"] == b"sluice-store"]
            assert group["pending"] == 0
    finally:
        redis.stop()


async def test_submissions_while_redis_is_down_are_kept_and_enqueued_when_it_is_back(
    tmp_path: Path, sluice_database_url: str, prefix: str
) -> None:
    # Given a service with keys and a rate limit (both need Redis on every request)
    redis = EmbeddedRedis(tmp_path / "redis", port=0, appendfsync="always").start()
    try:
        async with running_service(
            redis.url, sluice_database_url, prefix, auth=True, rate_limit=100.0, rate_burst=100
        ) as api:
            _, key = await api.svc.keys.create("acme")
            headers = {"Authorization": f"Bearer {key}"}
            first = await api.client.post("/jobs", json={"type": "generic", "payload": {}}, headers=headers)
            assert first.status_code == 201 and "ratelimit-limit" in first.headers
            # When Redis goes away
            redis.kill()
            # Then submissions are still accepted: stored, with no rate limit and no pressure read
            kept = []
            for i in range(3):
                resp = await api.client.post(
                    "/jobs", json={"type": "generic", "payload": {"i": i}}, headers=headers
                )
                assert resp.status_code == 201, resp.text
                kept.append(resp.json()["id"])
            # (ArQueue's route too, which reports the queue's length from the last reading)
            arq = await api.client.post(
                "/enqueue", json={"type": "generic", "payload": {"arq": True}}, headers=headers
            )
            assert arq.status_code == 201, arq.text
            kept.append(arq.json()["taskId"])
            # but a job whose budget cannot be looked up is refused, to be sent again
            budgeted = await api.client.post(
                "/v1/jobs", json={"type": "generic", "tokens": 5, "budget": "team"}, headers=headers
            )
            assert budgeted.status_code == 503 and budgeted.json()["error"]["code"] == "unavailable"
            # And when Redis is back, the reconciler enqueues what was kept, once
            redis.start()
            row = await api.svc.store.get(uuid.UUID(kept[-1]))
            assert row is not None and row.status == "QUEUED"
            later = row.updated_at + timedelta(seconds=api.svc.settings.reconcile_grace + 1)
            done = await api.reconciler.reconcile(now=later)
            assert done.enqueued == 4
            assert (await api.svc.queue.counts())["added"] == 5
            assert (await api.reconciler.reconcile(now=later)).enqueued == 0
    finally:
        redis.stop()
