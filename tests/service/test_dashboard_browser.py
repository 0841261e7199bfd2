"""The dashboard in a real browser: Playwright driving Debian's chromium, headless, against the
service on a loopback port with a real worker, Redis and PostgreSQL.

The browser is found as ``$SLUICE_CHROMIUM`` or ``chromium`` on PATH (apt-get install
chromium). Without one these tests are skipped and say so, unless ``SLUICE_REQUIRE_BROWSER``
is set (``.ci/run`` sets it): then a missing browser fails the run. Screenshots go to
``build/test-artifacts/dashboard/`` (or ``$SLUICE_TEST_ARTIFACTS/dashboard/``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.local.embedded import free_port
from sluice.service.app import create_app
from sluice.service.config import ServiceSettings
from sluice.service.context import Services
from sluice.service.handlers import service_worker
from tests.conftest import eventually, running

CHROMIUM = os.environ.get("SLUICE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(
    os.environ.get("SLUICE_TEST_ARTIFACTS") or Path(__file__).parents[2] / "build" / "test-artifacts"
)
try:
    from playwright.async_api import Page, async_playwright, expect
except ImportError:  # pragma: no cover - the dev extra has it
    async_playwright = None  # type: ignore[assignment]

_MISSING = (
    "no chromium (apt-get install chromium, or set SLUICE_CHROMIUM)"
    if CHROMIUM is None
    else "no playwright (pip install playwright)"
    if async_playwright is None
    else None
)
if _MISSING is not None:
    if os.environ.get("SLUICE_REQUIRE_BROWSER"):
        raise RuntimeError(f"SLUICE_REQUIRE_BROWSER is set but there is {_MISSING}")
    pytestmark = pytest.mark.skip(reason=f"browser tests: {_MISSING}")


@dataclass
class Served:
    base: str
    svc: Services

    async def key(self, tenant: str, *, admin: bool = False) -> str:
        _, key = await self.svc.keys.create(tenant, admin=admin)
        return key


@contextlib.asynccontextmanager
async def served(redis_url: str, database_url: str, prefix: str) -> AsyncIterator[Served]:
    """The service (with its sink and failure collector) on a free loopback port, in this loop."""
    import uvicorn

    options: dict[str, Any] = {
        "redis_url": redis_url,
        "database_url": database_url,
        "prefix": prefix,
        "failure_collect_interval": 0.5,
    }
    settings = ServiceSettings(**options)
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, auth=True),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())

    async def started() -> bool:
        assert not task.done(), "the API stopped"
        return bool(server.started)

    await eventually(started, timeout=30)
    try:
        yield Served(f"http://127.0.0.1:{port}", _services(config))
    finally:
        server.should_exit = True
        await task


def _services(config: Any) -> Services:
    app = config.loaded_app
    while not hasattr(app, "state"):  # uvicorn's wrappers (proxy headers, ...)
        app = app.app
    svc: Services = app.state.services
    return svc


@dataclass
class Browser:
    page: Page
    base: str
    #: console errors and uncaught exceptions
    problems: list[str] = field(default_factory=list)
    #: requests to anywhere but the service (the page must work offline)
    outside: list[str] = field(default_factory=list)

    async def sign_in(self, key: str, tab: str = "") -> None:
        await self.page.goto(f"{self.base}/dashboard/{tab}")
        await expect(self.page.locator("#login")).to_be_visible()
        await self.page.fill("#key", key)
        await self.page.click("#login button[type=submit]")
        await expect(self.page.locator("#main")).to_be_visible()
        await expect(self.page.locator("#conn")).to_have_text("live", timeout=10_000)

    async def shot(self, name: str) -> Path:
        path = ARTIFACTS / "dashboard" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        await self.page.screenshot(path=str(path), full_page=True)
        return path


@contextlib.asynccontextmanager
async def browser(base: str) -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=CHROMIUM)
        try:
            page = await chromium.new_page(viewport={"width": 1280, "height": 900})
            b = Browser(page, base)
            page.on(
                "console",
                lambda m: b.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: b.problems.append(f"page error: {e}"))
            page.on("request", lambda r: None if r.url.startswith(base) else b.outside.append(r.url))
            yield b
        finally:
            await chromium.close()


@contextlib.asynccontextmanager
async def scene(
    redis_url: str, database_url: str, prefix: str
) -> AsyncIterator[tuple[Served, Browser, httpx.AsyncClient]]:
    """The service, a browser and an HTTP client on it."""
    async with (
        served(redis_url, database_url, prefix) as api,
        browser(api.base) as b,
        httpx.AsyncClient(base_url=api.base) as client,
    ):
        yield api, b, client


async def _submit(client: httpx.AsyncClient, key: str, body: dict[str, Any]) -> str:
    resp = await client.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 201, resp.text
    job_id: str = resp.json()["id"]
    return job_id


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_live_numbers_move_while_jobs_run_and_an_admin_can_pause(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with (
        scene(redis_url, sluice_database_url, prefix) as (api, b, client),
        running(service_worker(prefix=prefix), redis_url),
    ):
        admin = await api.key("ops", admin=True)
        await b.sign_in(admin)
        page = b.page
        await expect(page.locator("#role")).to_have_text("admin")
        await expect(page.locator("#total-completed")).to_have_text("0")
        for i in range(25):
            await _submit(client, admin, {"type": "generic", "payload": {"i": i}})
        await expect(page.locator("#total-completed")).to_have_text("25", timeout=20_000)
        await expect(page.locator("#workers")).to_have_text("1 (20)")
        # the latency table and charts, from the workers' sketch (asked again on a change)
        await page.select_option("#lat-metric", "processing")
        row = page.locator('#lat-table tr[data-metric="end_to_end"] td').first
        await expect(row).to_have_text(re.compile(r"\d.* / .*\d"), timeout=15_000)
        assert await page.locator("#chart-rates canvas").count() == 1
        assert await page.locator("#chart-latency canvas").count() == 1

        queue = api.svc.queue
        await expect(page.locator("#flow-pacing")).to_have_text("no rate limit to pace")
        await queue.set_rate_limit(1000, per=1.0)
        # (the headroom is what the workers measured, if more than the least, 10 ms)
        pacing = re.compile(r"spaced evenly, 20 ms of tolerance, \d+ ms of headroom per window \(at least 10")
        await expect(page.locator("#flow-pacing")).to_have_text(pacing)
        await page.click("#pause")
        await expect(page.locator("#flow-state")).to_have_text("paused", timeout=5_000)
        assert (await queue.flow()).paused
        await _submit(client, admin, {"type": "generic", "payload": {}})  # the worker is turned away
        await expect(page.locator("#flow-refusals")).to_contain_text("paused", timeout=5_000)
        await expect(page.locator("#state-waiting")).to_have_text("1")
        await page.click("#resume")
        await expect(page.locator("#flow-state")).to_have_text("running", timeout=5_000)
        assert not (await queue.flow()).paused
        await page.fill("#throttle-seconds", "30")
        await page.click("#throttle")
        await expect(page.locator("#flow-state")).to_contain_text("throttled for", timeout=5_000)
        until = (await queue.flow()).throttled_until_ms
        assert until is not None and until > time.time() * 1000 + 20_000
        await expect(page.locator("#total-completed")).to_have_text("26", timeout=10_000)  # resumed
        await b.shot("overview")
        assert b.problems == []
        assert b.outside == []


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_redrive_from_the_page_reaches_the_queue(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with scene(redis_url, sluice_database_url, prefix) as (api, b, client):
        admin = await api.key("ops", admin=True)
        body = {"type": "generic", "payload": {"fail": True}, "max_attempts": 1}
        ids = [await _submit(client, admin, body) for _ in range(2)]
        async with running(service_worker(prefix=prefix), redis_url):

            async def dead() -> bool:
                jobs = [await api.svc.store.get(uuid.UUID(i)) for i in ids]
                return all(j is not None and j.status == "DEAD_LETTER" for j in jobs)

            await eventually(dead, timeout=20)

            async def grouped() -> bool:
                found = await client.get(
                    "/v1/failures/patterns", headers={"Authorization": f"Bearer {admin}"}
                )
                return bool(found.json()["patterns"])

            await eventually(grouped, timeout=20)
        # no worker now: a redriven job stays where the redrive put it
        await b.sign_in(admin, "#failures")
        page = b.page
        chosen, other = ids
        await expect(page.locator(f'#dead-table tr[data-job="{chosen}"]')).to_be_visible(timeout=10_000)
        await expect(page.locator(f'#dead-table tr[data-job="{other}"]')).to_be_visible()
        await expect(page.locator("#patterns-table tbody tr").first).to_contain_text(
            "generic", timeout=10_000
        )
        await page.check(f'#dead-table tr[data-job="{chosen}"] input[type=checkbox]')
        await page.click("#redrive-selected")
        await expect(page.locator("#redrive-result")).to_have_text("redriven: 1")

        async def states() -> dict[str, str]:
            out = {}
            for i in ids:
                record = await api.svc.queue.get_job(i)
                assert record is not None
                out[i] = record.state.value
            return out

        assert await states() == {chosen: "waiting", other: "dead"}
        await b.shot("dead-letters")
        # the job's attempts, from its link
        await page.click(f'#dead-table tr[data-job="{other}"] a')
        await expect(page.locator("#job-id")).to_have_text(other)
        await expect(page.locator("#timeline .attempt")).to_have_count(1)
        await b.shot("job")
        assert b.problems == []
        assert b.outside == []


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_tenant_key_never_sees_another_tenants_jobs(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with scene(redis_url, sluice_database_url, prefix) as (api, b, client):
        acme, globex = await api.key("acme"), await api.key("globex")
        theirs = [await _submit(client, acme, {"type": "generic", "payload": {"n": i}}) for i in range(3)]
        mine = [
            await _submit(client, globex, {"type": "email", "payload": {"to": f"{i}@x"}}) for i in range(2)
        ]
        await b.sign_in(globex, "#jobs")
        page = b.page
        await expect(page.locator("#role")).to_have_text("read-only")
        rows = page.locator("#jobs-table tbody tr[data-job]")
        await expect(rows).to_have_count(2, timeout=10_000)
        shown = {await rows.nth(i).get_attribute("data-job") for i in range(2)}
        assert shown == set(mine)
        # asked for by id, another tenant's job does not exist
        await page.fill("#search-id", theirs[0])
        await page.click("#job-search button[type=submit]")
        await expect(page.locator("#jobs-table tbody")).to_contain_text("no job")
        assert theirs[0] not in await page.locator("#job-detail").inner_text()
        await page.fill("#search-id", "")  # (the error above repeats the id asked for)
        await page.click("#job-search button[type=submit]")
        await expect(rows).to_have_count(2)
        # read-only: no controls, no budgets
        await page.goto(f"{api.base}/dashboard/#overview")
        await expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
        assert not await page.locator("#pause").is_visible()
        await page.click('nav a[data-tab="budgets"]')
        await expect(page.locator("#budgets-note")).to_contain_text("admin keys only")
        await expect(page.locator("#budgets-table tbody tr")).to_have_count(0)
        await page.click('nav a[data-tab="failures"]')
        await expect(page.locator("#dead-table tbody")).to_contain_text("No dead-lettered jobs.")
        assert await page.locator("#redrive-selected").is_visible() is False
        await b.shot("read-only")
        html = await page.content()
        assert not any(t in html for t in theirs)
        # the one error: the browser's note of the 404 that answered the other tenant's id
        assert [p for p in b.problems if "status of 404" not in p] == [], b.problems
        assert b.outside == []
