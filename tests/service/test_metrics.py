"""``GET /metrics``: ArQueue's JSON kept, the Prometheus exposition by ``Accept``, and
``sluice serve -p 2`` adding up its processes (prometheus-client's multiprocess mode)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from sluice.local.embedded import free_port
from sluice.service.handlers import service_worker
from sluice.service.metrics import LOCAL, wants_prometheus
from tests.conftest import eventually, running
from tests.harness.service_harness import Running, running_service

PROMETHEUS = "text/plain;version=0.0.4"
#: What Prometheus 3 sends.
PROMETHEUS_3 = (
    "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=underscores;q=0.3,"
    "text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)


def samples(text: str, *, openmetrics: bool = False) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    parse = openmetrics_families if openmetrics else text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value for family in parse(text) for s in family.samples}


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return found[(name, frozenset(labels.items()))]


def total(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum over every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and want <= ls)


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix) as svc:
        yield svc


def test_accept_negotiation() -> None:
    for accept in (PROMETHEUS, PROMETHEUS_3, "application/openmetrics-text", "text/plain"):
        assert wants_prometheus(accept), accept
    for other in (None, "", "*/*", "application/json", "text/html,application/xhtml+xml,*/*;q=0.8"):
        assert not wants_prometheus(other), other
    assert not wants_prometheus("application/json, text/plain;q=0.5")
    assert wants_prometheus("application/json;q=0.1, text/plain")


async def test_json_is_unchanged_and_prometheus_shows_the_queue_as_a_worker_left_it(
    api: Running, prefix: str, redis_url: str
) -> None:
    queue = api.svc.queue
    made = await api.client.post("/v1/budgets", json={"name": "team-a", "limit": 5000})
    assert made.status_code == 201
    await queue.budgets.reserve("team-a", 300, "r-1")
    await queue.set_limits(requests={"second": 50, "day": 10_000})
    ok = (await api.client.post("/enqueue", json={"type": "generic", "payload": {}})).json()["taskId"]
    await api.client.post("/enqueue", json={"type": "generic", "payload": {"fail": True}, "maxRetries": 0})
    await api.client.post("/v1/jobs", json={"type": "generic", "payload": {}, "delay_ms": 3_600_000})
    async with running(service_worker(prefix=prefix), redis_url):

        async def settled() -> bool:
            await api.drain_events()
            c = await queue.counts()
            done = (await api.client.get(f"/jobs/{ok}")).json()["status"] == "COMPLETED"
            return done and c["dead"] == 1 and c["completed"] == 1

        await eventually(settled, timeout=20)

    # ArQueue's JSON: no Accept, */* and application/json alike
    plain = await api.client.get("/metrics", headers={"accept": ""})
    for accept in ("*/*", "application/json"):
        again = await api.client.get("/metrics", headers={"accept": accept})
        assert again.headers["content-type"] == "application/json"
        assert set(again.json()) == set(plain.json())
    m = plain.json()
    assert set(m) == {
        "concurrency",
        "active_loops",
        "total_jobs_in_queue",
        "jobs_done",
        "jobs_failed",
        "jobs_retried",
        "queue_pending",
        "queue_processing",
        "queue_dead_letter",
        "queue_delayed",
        "latency_ms",
    }
    assert (m["jobs_done"], m["queue_dead_letter"], m["jobs_failed"], m["queue_delayed"]) == (1, 1, 1, 1)
    assert plain.headers["vary"] == "Accept"

    # Prometheus's text format
    resp = await api.client.get("/metrics", headers={"accept": PROMETHEUS})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert resp.headers["vary"] == "Accept"
    found = samples(resp.text)
    counts = await queue.counts()
    q = queue.name
    for state in ("waiting", "delayed", "parked", "active", "dead"):
        assert value(found, "sluice_queue_jobs", queue=q, state=state) == counts[state], state
    assert counts["delayed"] == 1 and counts["dead"] == 1
    expected = {"added": 3, "completed": 1, "failed": 1, "dead": 1, "retried": 0, "stalled": 0}
    for outcome, n in expected.items():
        assert value(found, "sluice_queue_outcomes_total", queue=q, outcome=outcome) == n, outcome
    assert value(found, "sluice_redis_up", queue=q) == 1
    assert value(found, "sluice_queue_rate_limit_starts", queue=q) == 50
    assert value(found, "sluice_queue_rate_window_seconds", queue=q) == 1
    day = {"queue": q, "kind": "requests", "window_seconds": "86400"}
    assert value(found, "sluice_queue_window_limit", **day) == 10_000
    assert value(found, "sluice_queue_window_count", **day) == 2  # the two jobs the worker ran
    assert value(found, "sluice_queue_paused", queue=q) == 0
    assert value(found, "sluice_queue_pressure", queue=q) >= 0
    assert value(found, "sluice_reservations_held", queue=q) == 1
    assert value(found, "sluice_budget_limit_tokens", queue=q, budget="team-a") == 5000
    assert value(found, "sluice_budget_used_tokens", queue=q, budget="team-a") == 300
    assert value(found, "sluice_budget_remaining_tokens", queue=q, budget="team-a") == 4700
    assert value(found, "sluice_budget_accepted_total", queue=q, budget="team-a") == 1
    # the process's own: the submissions this test made went through the fast lane
    assert total(found, "sluice_api_requests_total", route="/enqueue", status="201") >= 2
    assert total(found, "sluice_api_request_duration_seconds_count", route="/enqueue") >= 2
    assert value(found, "sluice_api_processes") == 1

    # OpenMetrics when asked (what Prometheus 3 asks first)
    om = await api.client.get("/metrics", headers={"accept": PROMETHEUS_3})
    assert om.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om.text.endswith("# EOF\n")
    found = samples(om.text, openmetrics=True)
    assert value(found, "sluice_queue_jobs", queue=q, state="dead") == 1
    assert value(found, "sluice_queue_outcomes_total", queue=q, outcome="completed") == 1


def _submissions(route: str, outcome: str) -> float:
    return LOCAL.get_sample_value("sluice_api_submissions_total", {"route": route, "outcome": outcome}) or 0.0


@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "routes"])
async def test_submissions_are_counted_by_outcome_in_the_fast_lane_and_the_routes(
    redis_url: str, sluice_database_url: str, prefix: str, fast_lane: bool
) -> None:
    outcomes = ("accepted", "rate_limited", "backpressure", "too_large", "invalid", "unauthorized")
    before = {o: _submissions("/v1/jobs", o) for o in outcomes}
    async with running_service(
        redis_url,
        sluice_database_url,
        prefix,
        auth=True,
        fast_lane=fast_lane,
        rate_limit=0.5,
        rate_burst=3,
        max_depth=1,
        max_body_bytes=2048,
    ) as api:
        _, key = await api.svc.keys.create("acme")
        auth = {"Authorization": f"Bearer {key}"}
        job = {"type": "generic", "payload": {}}
        # (a 422 first: once the queue is behind, backpressure answers before the body is read)
        _, other = await api.svc.keys.create("acme")
        bad = await api.client.post("/v1/jobs", json={"payload": {}}, headers={"X-API-Key": other})
        assert bad.status_code == 422
        assert (await api.client.post("/v1/jobs", json=job, headers=auth)).status_code == 201
        assert (await api.client.post("/v1/jobs", json=job, headers=auth)).status_code == 201
        api.svc.pressure._cached = None
        assert (await api.client.post("/v1/jobs", json=job, headers=auth)).status_code == 429  # 2 wait
        assert (await api.client.post("/v1/jobs", json=job, headers=auth)).status_code == 429  # the rate
        assert (await api.client.post("/v1/jobs", json=job)).status_code == 401
        big = {"type": "generic", "payload": {"x": "y" * 4000}}
        assert (await api.client.post("/v1/jobs", json=big, headers=auth)).status_code == 413
    got = {o: _submissions("/v1/jobs", o) - before[o] for o in outcomes}
    assert got == {
        "accepted": 2,
        "backpressure": 1,
        "rate_limited": 1,
        "unauthorized": 1,
        "too_large": 1,
        "invalid": 1,
    }


async def test_the_exposition_needs_an_admin_key_and_json_any_key(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with running_service(redis_url, sluice_database_url, prefix, auth=True) as api:
        _, tenant = await api.svc.keys.create("acme")
        _, admin = await api.svc.keys.create("ops", admin=True)
        prom = {"accept": PROMETHEUS}
        assert (await api.client.get("/metrics", headers=prom)).status_code == 401
        refused = await api.client.get("/metrics", headers={**prom, "Authorization": f"Bearer {tenant}"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
        mine = await api.client.get("/metrics", headers={"Authorization": f"Bearer {tenant}"})
        assert mine.status_code == 200 and "jobs_done" in mine.json()
        scraped = await api.client.get("/metrics", headers={**prom, "Authorization": f"Bearer {admin}"})
        assert scraped.status_code == 200
        assert value(samples(scraped.text), "sluice_redis_up", queue=api.svc.queue.name) == 1


# ---- sluice serve -p 2, a real process -------------------------------------------------------------


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env["SLUICE_HOME"] = str(home)
    env.update(extra)
    return env


def _served_by(metrics_dir: str) -> set[int]:
    """The pids of the processes that answered a request: each has a histogram file once it
    timed one (the unlabelled counters make a counter file in every process at start)."""
    return {int(Path(p).stem.split("_")[-1]) for p in glob.glob(os.path.join(metrics_dir, "histogram_*.db"))}


def _live(metrics_dir: str) -> set[int]:
    """The pids with a live gauge file: every API process makes one at start."""
    return {
        int(Path(p).stem.split("_")[-1]) for p in glob.glob(os.path.join(metrics_dir, "gauge_live*_*.db"))
    }


def _scrape(base: str, key: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    resp = httpx.get(base + "/metrics", headers={"accept": PROMETHEUS, "Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    return samples(resp.text)


@pytest.mark.timeout(120)
def test_serve_with_two_processes_adds_them_up_and_removes_its_directory(
    tmp_path: Path, redis_url: str, sluice_database_url: str
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = _env(tmp_path, SLUICE_REDIS_URL=redis_url, SLUICE_DATABASE_URL=sluice_database_url, TMPDIR=str(tmp))
    made = subprocess.run(
        [sys.executable, "-m", "sluice", "keys", "create", "--tenant", "ops", "--admin", "--json"],
        env=env,
        capture_output=True,
        check=True,
    )
    key = json.loads(made.stdout)["key"]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", "serve", "--port", str(port), "-p", "2", "--queue", "metrics"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the API did not start"
            with_dir = glob.glob(str(tmp / "sluice-metrics-*"))
            try:
                if with_dir and httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        (metrics_dir,) = with_dir
        # Requests on new connections until both processes answered some
        sent = 0
        while len(_served_by(metrics_dir)) < 2:
            assert sent < 2000, "one process answered everything"
            for _ in range(10):
                with httpx.Client() as client:
                    assert client.get(base + "/healthz").status_code == 200
                sent += 1
        found = _scrape(base, key)
        assert total(found, "sluice_api_requests_total", route="/healthz", status="200") == sent
        assert total(found, "sluice_api_request_duration_seconds_count", route="/healthz") == sent
        assert value(found, "sluice_api_processes") == 2
        assert value(found, "sluice_redis_up", queue="metrics") == 1

        # A worker killed: uvicorn starts another; its requests stay counted, and it is no
        # longer a live process once the scrape has pruned it
        before = _live(metrics_dir)
        victim = sorted(_served_by(metrics_dir))[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (
            not _live(metrics_dir) - before or value(found := _scrape(base, key), "sluice_api_processes") != 2
        ):
            assert time.monotonic() < deadline, "the killed worker was not replaced"
            time.sleep(0.2)
        assert victim not in _live(metrics_dir)
        assert os.path.exists(os.path.join(metrics_dir, f"histogram_{victim}.db"))
        assert total(found, "sluice_api_requests_total", route="/healthz") == sent
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode()
    assert glob.glob(str(tmp / "sluice-metrics-*")) == []


# The Grafana dashboard is checked against real expositions (the API's and a worker's) in
# tests/engine/test_worker_metrics.py.
