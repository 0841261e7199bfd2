"""The fast lane answers a submission exactly as FastAPI's route does, and hands on the rest.

Two services on one PostgreSQL database and one Redis (separate queues and
tenants): one with the lane, one without. The same requests go to both, in
the same order: ordinary ones (which the lane serves), broken ones (which it
hands on), and ones that fail once taken (a missing budget, backpressure).
Status, headers and bodies must match, ids and times aside.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sluice.service.fastlane import FastLane
from tests.harness.service_harness import Running, running_service

#: Values that differ between two runs of the same request: ids and times.
_VOLATILE = re.compile(
    rb'"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"'
    rb'|"\d{4}-\d\d-\d\dT[0-9:.]+(Z|[+-]\d\d:\d\d)?"'
    rb'|"(requestId|correlation_id)":"[^"]*"'
)
#: Headers that differ between two runs (or two apps) by nature.
_OWN = {"x-request-id", "ratelimit-remaining", "date", "server"}


def _lane(running: Running) -> FastLane:
    app: Any = running.app.middleware_stack
    while app is not None and not isinstance(app, FastLane):
        app = getattr(app, "app", None)
    assert isinstance(app, FastLane), "the fast lane is not in the app's middleware"
    return app


def _normal(body: bytes) -> bytes:
    return _VOLATILE.sub(b'"~"', body)


@pytest.fixture
async def pair(
    redis_url: str, sluice_database_url: str, prefix: str
) -> AsyncIterator[tuple[Running, Running]]:
    common: dict[str, Any] = {"auth": True, "rate_limit": 1000.0, "rate_burst": 2000}
    async with (
        running_service(redis_url, sluice_database_url, prefix + "lane:", **common) as lane,
        running_service(
            redis_url, sluice_database_url, prefix + "plain:", fast_lane=False, **common
        ) as plain,
    ):
        yield lane, plain


async def _keys(api: Running, tenant: str) -> dict[str, str]:
    _, key = await api.svc.keys.create(tenant)
    headers = {"Authorization": f"Bearer {key}"}
    assert (await api.client.get("/v1/jobs", headers=headers)).status_code == 200  # the key is cached
    return {"key": key}


def _requests(key: str) -> list[tuple[str, dict[str, str], bytes]]:
    bearer = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    x_key = {"X-API-Key": key, "Content-Type": "application/json"}
    lower = {"Authorization": f"bearer  {key} ", "Content-Type": "application/json; charset=utf-8"}
    out: list[tuple[str, dict[str, str], bytes]] = []
    for path in ("/jobs", "/v1/jobs", "/enqueue"):
        out += [
            (path, bearer, b'{"type": "generic", "payload": {"n": 1}}'),
            (path, x_key, b'{"type": "email", "payload": {"to": "a@example.com"}, "idempotencyKey": "k1"}'),
            (path, lower, b'{"type": "email", "payload": {"to": "a@example.com"}, "idempotencyKey": "k1"}'),
            (path, bearer, b'{"type": "generic", "payload": {}, "surprise": 1}'),
            (path, bearer, b'{"type": "generic", "payload": []}'),
            (path, bearer, b'{"type": "generic", "payload": {"big": 123456789012345678901234567890}}'),
            (path, bearer, b'{"type": "gen eric", "payload": {}}'),
            (path, bearer, b'{"type": "generic"'),
            (path, bearer, b""),
            (path, bearer, b"\xff\xfe"),
            (path, bearer, b"[]"),
            (path, {**bearer, "Content-Type": "text/plain"}, b'{"type": "generic", "payload": {}}'),
            (path, {"Content-Type": "application/json"}, b'{"type": "generic", "payload": {}}'),
            (path, {**bearer, "Authorization": "Bearer sk_nope"}, b'{"type": "generic", "payload": {}}'),
            (path, {**bearer, "Authorization": "Basic abc"}, b'{"type": "generic", "payload": {}}'),
        ]
    out += [
        ("/jobs", bearer, b'{"type": "generic", "payload": {}, "priority": 3}'),
        (
            "/jobs",
            bearer,
            b'{"type": "generic", "payload": {}, "priority": 20, "maxAttempts": 2, "delay": 5}',
        ),
        ("/jobs", bearer, b'{"type": "generic", "payload": {}, "maxAttempts": "2"}'),
        ("/v1/jobs", bearer, b'{"type": "generic", "priority": 7, "tokens": 10, "budget": "nowhere"}'),
        ("/v1/jobs", bearer, b'{"type": "generic", "budget": "nowhere"}'),
        ("/v1/jobs", bearer, b'{"type": "generic", "delay_ms": 1000, "max_attempts": 4}'),
        ("/v1/jobs", bearer, b'{"type": "generic", "idempotency_key": "once"}'),
        ("/v1/jobs", x_key, b'{"type": "generic", "idempotency_key": "once"}'),
        ("/enqueue", bearer, b'{"type": "generic", "payload": {}, "maxRetries": 11}'),
    ]
    return out


async def test_the_lane_answers_as_the_route_does(pair: tuple[Running, Running]) -> None:
    lane, plain = pair
    keys = {id(api): (await _keys(api, f"tenant-{n}"))["key"] for n, api in enumerate(pair)}
    answers: dict[int, list[tuple[int, dict[str, str], bytes]]] = {}
    for api in pair:
        got = []
        for path, headers, body in _requests(keys[id(api)]):
            resp = await api.client.post(path, content=body, headers=headers)
            kept = {k: v for k, v in resp.headers.items() if k not in _OWN}
            got.append((resp.status_code, kept, _normal(resp.content)))
        answers[id(api)] = got
    for (path, headers, body), a, b in zip(
        _requests("k"), answers[id(lane)], answers[id(plain)], strict=True
    ):
        assert a == b, (path, headers.get("Content-Type"), body)
    statuses = {status for status, _, _ in answers[id(lane)]}
    assert {200, 201, 400, 401, 404, 415, 422} <= statuses  # every kind of answer was compared
    served, handed_on = _lane(lane).served, _lane(lane).handed_on
    ordinary = sum(1 for status, _, _ in answers[id(lane)] if status in (200, 201))
    assert served >= ordinary + 1  # ordinary submissions, and the missing budget, in the lane
    assert handed_on >= 20  # each broken body went on to the route
    # both made the same jobs
    assert (await lane.svc.queue.counts())["added"] == (await plain.svc.queue.counts())["added"] > 0


async def test_backpressure_and_the_rate_limit_answer_in_the_lane_as_on_the_route(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    answers = []
    for fast_lane in (True, False):
        async with running_service(
            redis_url,
            sluice_database_url,
            f"{prefix}{fast_lane}:",
            auth=True,
            fast_lane=fast_lane,
            max_depth=2,
            rate_limit=1.0,
            rate_burst=6,
        ) as api:
            key = (await _keys(api, f"t-{fast_lane}"))["key"]
            headers = {"Authorization": f"Bearer {key}"}
            got = []
            for i in range(8):
                resp = await api.client.post(
                    "/jobs", json={"type": "generic", "payload": {"i": i}}, headers=headers
                )
                got.append(
                    (resp.status_code, resp.headers.get("retry-after") is not None, resp.json().get("error"))
                )
                api.svc.pressure._cached = None  # read the depth again for the next request
            if fast_lane:
                assert _lane(api).served >= 5
            answers.append(got)
    lane, plain = answers
    # three accepted (depth 0, 1, 2), refused at depth 3; the warm-up read and 5 posts spend the burst
    assert [g[0] for g in lane] == [201, 201, 201] + [429] * 5
    assert lane == plain
    codes = [g[2]["code"] for g in lane if g[2]]
    assert codes == ["too_many_requests"] * 2 + ["rate_limited"] * 3  # the queue, then the key's rate
