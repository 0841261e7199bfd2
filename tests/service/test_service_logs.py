"""Logs: the request's correlation id follows a job from the API onto the worker's log lines,
as JSON, and an API key never reaches a log."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.local.embedded import free_port
from tests.harness.service_harness import running_service
from tests.service.test_service_cli import _wait_ready

pytestmark = pytest.mark.timeout(120)


def _json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


async def test_the_request_id_reaches_every_worker_line_about_its_job(
    redis_url: str, sluice_database_url: str, prefix: str, tmp_path: Path
) -> None:
    async with running_service(redis_url, sluice_database_url, prefix) as api:
        sent = await api.client.post(
            "/jobs",
            json={"type": "email", "payload": {"to": "ada@example.com"}},
            headers={"X-Request-ID": "req-email-1"},
        )
        await api.client.post(
            "/jobs",
            json={"type": "generic", "payload": {"fail": True}, "maxAttempts": 2, "delay": 0},
            headers={"X-Request-ID": "req-fail-2"},
        )
        unnamed = await api.client.post("/jobs", json={"type": "generic", "payload": {}})
        assert sent.headers["x-request-id"] == "req-email-1"
        assert len(unnamed.headers["x-request-id"]) == 32  # one is made when none is sent
        rows = {j["id"]: j for j in (await api.client.get("/v1/jobs")).json()["jobs"]}
        assert rows[sent.json()["id"]]["correlation_id"] == "req-email-1"

        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        env.update(SLUICE_REDIS_URL=redis_url, SLUICE_LOG_FORMAT="json", SLUICE_HOME=str(tmp_path))
        worker = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "sluice", "worker", "sluice.service.handlers:worker", "--prefix", prefix],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            for _ in range(300):
                counts = await api.svc.queue.counts()
                if counts["completed"] == 2 and counts["dead"] == 1:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"the jobs did not finish: {await api.svc.queue.counts()}")
        finally:
            worker.send_signal(signal.SIGINT)
            async with asyncio.timeout(30):
                out, _ = await worker.communicate()
        await api.drain_events()
        email_job = await api.svc.store.get(sent.json()["id"])
        assert email_job is not None

    lines = _json_lines(out.decode())
    assert lines, out.decode()
    emailed = [ln for ln in lines if ln.get("correlation_id") == "req-email-1"]
    # the handler's own line, written with plain logging, carries the job it ran in
    sent_line = next(ln for ln in emailed if ln.get("to") == "ada@example.com")
    assert sent_line["job_id"] == str(email_job.id)
    assert sent_line["job_name"] == "email" and sent_line["attempt"] == 1
    assert sent_line["logger"] == "sluice.jobs" and sent_line["level"] == "info"
    # the worker's lines about the failing job (a retry, then the dead letter) carry its id too
    failed = [ln for ln in lines if ln.get("correlation_id") == "req-fail-2"]
    assert [ln["level"] for ln in failed] == ["warning", "error"], failed
    assert "attempt 1 of 2 failed" in failed[0]["event"] and "dead-lettered" in failed[1]["event"]
    # a line about no job names none
    assert not any("correlation_id" in ln for ln in lines if "job_id" not in ln)


def test_an_api_key_never_reaches_the_api_logs(
    tmp_path: Path, redis_url: str, sluice_database_url: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(
        SLUICE_HOME=str(tmp_path),
        SLUICE_REDIS_URL=redis_url,
        SLUICE_DATABASE_URL=sluice_database_url,
        SLUICE_LOG_FORMAT="json",
        SLUICE_LOG_LEVEL="debug",
    )
    made = subprocess.run(
        [sys.executable, "-m", "sluice", "keys", "create", "--tenant", "acme", "--json"],
        env=env,
        capture_output=True,
        check=True,
    )
    key = json.loads(made.stdout)["key"]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", "serve", "--port", str(port), "--queue", "logged"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)
        good = {"Authorization": f"Bearer {key}", "X-Request-ID": "req-keyed"}
        assert (
            httpx.post(base + "/jobs", json={"type": "generic", "payload": {}}, headers=good).status_code
            == 201
        )
        # a key that is wrong by one character, and a malformed body with the key in it
        wrong = {"Authorization": f"Bearer {key[:-1]}x"}
        assert httpx.get(base + "/v1/jobs", headers=wrong).status_code == 401
        bad = httpx.post(base + "/jobs", content=f'{{"type": "{key}"', headers=good)
        assert bad.status_code == 422
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    text = out.decode()
    assert key not in text and key[:-1] not in text
    assert key not in made.stderr.decode()
