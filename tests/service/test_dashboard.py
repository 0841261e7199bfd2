"""The dashboard's page and the routes it reads: who am I, the live stream, latency over
time, budgets with burn rates. (tests/service/test_dashboard_browser.py drives the page itself.)"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from sluice.engine.queue import Queue
from sluice.engine.sketch import LatencyRecorder, quantiles
from sluice.service.burn import MIN_SPAN_SECONDS, BurnTracker
from sluice.service.dashboard import STATIC, create_dashboard
from sluice.service.live import sample_budgets
from tests.harness.service_harness import Running, running_service


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix, auth=True) as svc:
        yield svc


async def _keys(api: Running) -> tuple[dict[str, str], dict[str, str]]:
    _, admin = await api.svc.keys.create("ops", admin=True)
    _, tenant = await api.svc.keys.create("acme")
    return {"Authorization": f"Bearer {admin}"}, {"Authorization": f"Bearer {tenant}"}


def test_the_vendored_chart_library_is_the_published_one() -> None:
    """uPlot 1.6.32 from npm, byte for byte (SOURCE.md gives the digests and the tarball's)."""
    vendor = STATIC / "vendor" / "uplot"
    source = (vendor / "SOURCE.md").read_text()
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((vendor / name).read_bytes()).hexdigest()
        assert f"{digest}  {name}" in source, name
    assert "MIT" in (vendor / "LICENSE").read_text()


async def test_the_page_is_served_with_a_strict_policy_and_no_inline_script(api: Running) -> None:
    home = await api.client.get("/")
    assert home.status_code == 307 and home.headers["location"] == "/dashboard/"
    page = await api.client.get("/dashboard/")  # the page itself needs no key: its data does
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    scripts = re.findall(r"<script\b[^>]*>", page.text)
    assert scripts and all("src=" in s for s in scripts), scripts
    assert not re.search(r"\son[a-z]+=", page.text), "inline event handlers break the policy"
    assert 'content=".."' in page.text  # where the page finds the API
    for path in ("static/app.js", "static/app.css", "static/vendor/uplot/uPlot.iife.min.js"):
        asset = await api.client.get("/dashboard/" + path)
        assert asset.status_code == 200 and asset.headers["x-content-type-options"] == "nosniff", path
    for sneaky in ("/dashboard/static/%2e%2e/__init__.py", "/dashboard/static/..%2f__init__.py"):
        assert (await api.client.get(sneaky)).status_code == 404, sneaky


def test_a_dashboard_for_an_api_elsewhere_allows_only_that_origin() -> None:
    from starlette.testclient import TestClient

    with TestClient(create_dashboard(api_base="https://jobs.example.com/api", auth=True)) as client:
        page = client.get("/")
    csp = page.headers["content-security-policy"]
    # the origin, not the path: a CSP source with a path matches that one path only
    assert "connect-src 'self' https://jobs.example.com;" in csp
    assert "unsafe-inline" not in csp
    assert '<meta name="sluice-api" content="https://jobs.example.com/api">' in page.text
    with pytest.raises(ValueError, match="plain URL"):
        create_dashboard(api_base='x" onload="alert(1)')


async def test_me_says_who_calls(api: Running) -> None:
    admin, tenant = await _keys(api)
    assert (await api.client.get("/v1/me")).status_code == 401
    assert (await api.client.get("/v1/me", headers=tenant)).json() == {
        "tenant": "acme",
        "admin": False,
        "auth": True,
    }
    assert (await api.client.get("/v1/me", headers=admin)).json()["admin"] is True


def _events(body: bytes) -> list[tuple[str, Any]]:
    out = []
    for block in body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            out.append((fields["event"], orjson.loads(fields["data"])))
    return out


async def test_the_live_stream_counts_what_happens_while_it_runs(api: Running) -> None:
    """Snapshots every interval; the rates between two of them add up to what was added."""
    admin, tenant = await _keys(api)
    queue = api.svc.queue
    made = await api.client.post("/v1/budgets", json={"name": "team-a", "limit": 1000}, headers=admin)
    assert made.status_code == 201
    await sample_budgets(api.svc)  # what the process's sampler does every 2 s

    async def add_later() -> None:
        await asyncio.sleep(0.7)
        for i in range(12):
            await queue.add("generic", {"i": i})

    adding = asyncio.create_task(add_later())
    resp = await api.client.get("/v1/live", params={"interval": 0.5, "seconds": 2.2}, headers=admin)
    await adding
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    snaps = [data for name, data in _events(resp.content) if name == "snapshot"]
    assert len(snaps) >= 3
    assert snaps[0]["rates"] is None and snaps[0]["totals"]["added"] == 0
    assert snaps[-1]["totals"]["added"] == 12 and snaps[-1]["states"]["waiting"] == 12
    added = sum(b["rates"]["added"] * (b["at"] - a["at"]) for a, b in itertools.pairwise(snaps))
    assert added == pytest.approx(12, rel=1e-3)  # rates use the monotonic clock, "at" the wall clock
    assert [b["name"] for b in snaps[-1]["budgets"]] == ["team-a"]
    assert snaps[-1]["flow"]["paused"] is False and snaps[-1]["workers"] == {"count": 0, "slots": 0}
    assert not any(k.startswith("_") for k in snaps[-1])
    assert snaps[-1]["refusals"] == await queue.refusals()

    mine = await api.client.get("/v1/live", params={"interval": 0.5, "seconds": 0.6}, headers=tenant)
    (first, *_) = [data for name, data in _events(mine.content) if name == "snapshot"]
    assert first["budgets"] is None  # budgets are an admin's
    assert first["states"]["waiting"] == 12  # the queue's counts are open to any key, as GET /v1/queue
    bad = await api.client.get("/v1/live", params={"interval": 0}, headers=tenant)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "interval"


async def test_the_latency_series_gives_each_bucket_its_own_percentiles(api: Running) -> None:
    """Two 10 s buckets with different durations: each point is within 1 % of the exact
    percentile of its own bucket's samples, and empty buckets are empty."""
    queue: Queue = api.svc.queue
    now = 1_796_000_000_000 - 1_796_000_000_000 % 10_000 + 5_000
    recorder = LatencyRecorder(queue.core)
    early = [float(v) for v in range(1, 201)]  # 1..200 ms, 60 s ago
    late = [1000.0 + 7 * v for v in range(50)]  # 1000..1343 ms, now
    for v in early:
        recorder.add("processing", v, now - 60_000)
    for v in late:
        recorder.add("processing", v, now)
    await recorder.flush()
    series = await queue.latency_series(120, now=now)
    assert series.step_ms == 10_000 and series.resolution == "10s"
    points = dict(zip(series.starts_ms, series.metrics["processing"], strict=True))

    def bucket(t: int) -> int:
        return t - t % 10_000

    for values, at in ((early, now - 60_000), (late, now)):
        p = points[bucket(at)]
        assert p.count == len(values)
        for q, got in zip((0.5, 0.95, 0.99), (p.p50, p.p95, p.p99), strict=True):
            exact = sorted(values)[int(q * (len(values) - 1))]
            assert got == pytest.approx(exact, rel=0.01), (q, at)
    others = [p for t, p in points.items() if t not in {bucket(now), bucket(now - 60_000)}]
    assert others and all(p.count == 0 and p.p50 is None for p in others)
    assert all(p.count == 0 for p in series.metrics["queue_wait"])
    # the hour view merges the same samples per minute
    hour = await queue.latency_series(3600, now=now)
    assert hour.step_ms == 60_000 and sum(p.count for p in hour.metrics["processing"]) == 250
    merged = [p for p in hour.metrics["processing"] if p.count][-1]
    assert merged.count == 50 and merged.p50 == quantiles(_bins(late))[0]

    admin, _ = await _keys(api)
    route = await api.client.get("/v1/stats/series", params={"window": 3600}, headers=admin)
    assert route.status_code == 200 and route.json()["resolution"] == "1m"
    assert (await api.client.get("/v1/stats/series", params={"window": 5}, headers=admin)).status_code == 422


def _bins(values: list[float]) -> dict[str, int]:
    from sluice.engine.sketch import bin_of

    out: dict[str, int] = {}
    for v in values:
        out[bin_of(v)] = out.get(bin_of(v), 0) + 1
    return out


def test_the_burn_rate_is_the_charged_counters_slope() -> None:
    t = BurnTracker()
    assert t.per_minute("b") is None
    t.observe("b", 1000, at=100.0)
    t.observe("b", 1000, at=100.0 + MIN_SPAN_SECONDS / 2)
    assert t.per_minute("b") is None  # too short a span to say
    t.observe("b", 1600, at=160.0)
    assert t.per_minute("b") == pytest.approx(600.0)
    t.observe("b", 2800, at=220.0)  # the rate is taken over the last minute only
    assert t.per_minute("b") == pytest.approx(1200.0)
    t.observe("b", 10, at=230.0)  # restored after Redis lost it: a new history
    assert t.per_minute("b") is None
    t.forget(set())
    assert t.per_minute("b") is None


async def test_budgets_show_burn_rate_and_when_they_run_out(api: Running) -> None:
    admin, tenant = await _keys(api)
    assert (
        await api.client.post("/v1/budgets", json={"name": "team-a", "limit": 10_000}, headers=admin)
    ).status_code == 201
    queue = api.svc.queue
    await queue.budgets.reserve("team-a", 900, "r1")
    await queue.budgets.commit("r1", 600)
    await queue.budgets.reserve("team-a", 100, "r2")  # held: not spent
    api.svc.burn.observe("team-a", 0, at=time.monotonic() - 50)  # a sample 50 s ago
    assert (await api.client.get("/v1/budgets", headers=tenant)).status_code == 403
    (b,) = (await api.client.get("/v1/budgets", headers=admin)).json()["budgets"]
    assert (b["name"], b["charged"], b["used"], b["remaining"]) == ("team-a", 600, 700, 9300)
    assert b["burn_per_minute"] == pytest.approx(720, rel=0.02)
    assert b["runs_out"] == "yes"
    minutes = (b["exhausts_at_ms"] - time.time() * 1000) / 60_000
    assert minutes == pytest.approx(9300 / 720, rel=0.03)


async def test_a_key_revoked_while_it_watches_ends_its_stream(
    api: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluice.service import routes_live

    monkeypatch.setattr(routes_live, "RECHECK_SECONDS", 0.4)
    made, key = await api.svc.keys.create("acme")

    async def revoke_later() -> None:
        await asyncio.sleep(0.6)
        assert await api.svc.keys.revoke(made.id)
        api.svc.key_cache.clear()  # (a revoked key is otherwise refused within 30 s)

    revoking = asyncio.create_task(revoke_later())
    started = time.monotonic()
    resp = await api.client.get(
        "/v1/live", params={"interval": 0.5, "seconds": 8}, headers={"Authorization": f"Bearer {key}"}
    )
    await revoking
    assert resp.status_code == 200
    assert time.monotonic() - started < 4, "the stream went on after its key was revoked"
    assert api.svc.live_streams == 0


async def test_too_many_live_streams_get_429(api: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.service import routes_live

    _, tenant = await _keys(api)
    monkeypatch.setattr(routes_live, "MAX_STREAMS", 0)
    refused = await api.client.get("/v1/live", headers=tenant)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
