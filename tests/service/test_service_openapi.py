"""Property-based tests of the HTTP API against its own /openapi.json (schemathesis).

Every operation in the schema is called with requests schemathesis makes from
it, valid ones and invalid ones, on a running service (real Redis, a real
PostgreSQL database), and every answer is checked:

- ``not_a_server_error``: no 5xx, whatever was sent;
- ``status_code_conformance``: the status is one /openapi.json lists for the route;
- ``content_type_conformance`` and ``response_schema_conformance``: the body is
  the media type and the shape documented for that status (errors included:
  one error shape everywhere);
- ``negative_data_rejection``: a request that breaks the schema is refused
  with a 4xx (number fields take JSON numbers only: no ``true`` taken for 1);
- ``positive_data_acceptance``: a request the schema allows is accepted, or
  refused for a reason outside the request (401/403/404/409/429); the few
  operations that answer 422 to some schema-valid requests by design are
  listed in ``CONFIG`` with the reason, and payloads the queue cannot carry
  are dealt with in the test;
- ``unsupported_method``, ``allow_header_conformance``: a method the path does
  not take is a 405 whose Allow names the ones it does;
- ``response_headers_conformance``: the headers documented (Retry-After).

It runs once without authentication (``sluice dev``) and once with an admin
key, so the admin routes answer for real rather than with 403. One service
serves every operation of a run, so later operations see what earlier ones
made (jobs, budgets). Generation is seeded (``CONFIG``) and derandomized: a
run makes the same requests every time, and a failure prints the request (as
curl) to replay it. The
coverage phase adds its boundary cases to the ``max_examples`` of fuzzing:
about a thousand requests a run, four runs (two Redis versions, with and
without keys), under a minute in all.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from sluice.local.postgres import EmbeddedPostgres
from sluice.service.app import create_app
from sluice.service.config import ServiceSettings
from sluice.testing import EmbeddedRedis
from tests.harness.service_harness import Running, running_service

BASE_URL = "http://sluice.test"

#: The checks, and where the schema cannot say everything the API checks.
CONFIG = """
# Each operation's examples follow from this seed (and the schema), whatever else changes.
seed = 10

[checks]
enabled = false
not_a_server_error.enabled = true
status_code_conformance.enabled = true
content_type_conformance.enabled = true
response_schema_conformance.enabled = true
negative_data_rejection.enabled = true
# schemathesis' own list, and 413: a body past the server's limit is refused unread.
negative_data_rejection.expected-statuses = [
    "400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"
]
positive_data_acceptance.enabled = true
allow_header_conformance.enabled = true
unsupported_method.enabled = true
response_headers_conformance.enabled = true

# A cursor is opaque: only one this API gave out is valid, and no schema can say which
# strings those are, so another string is a 422 naming the cursor.
[[operations]]
include-name = ["GET /v1/jobs", "GET /v1/dead-letters"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422", "429"]

# Rules across fields or across requests, which JSON Schema cannot state: a budget is
# not its own parent and is nested at most 8 deep; an op_id names one credit (sent again
# with other tokens or for another budget, it is a 422, as the IETF Idempotency-Key
# draft answers a key reused for another request); a credit may not take what a budget
# admits past 10^12 tokens.
[[operations]]
include-name = ["POST /v1/budgets", "POST /v1/budgets/{name}/credit"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422", "429"]

# The coverage phase's valid boundary cases of a batch are 999 and 1000 jobs, a dozen
# seconds a run (each job is stored and enqueued as POST /v1/jobs would). Its invalid
# ones stay (0 jobs, 1001, ...), fuzzing sends valid batches of a few jobs, and the
# boundaries of each job are covered through POST /v1/jobs, which takes the same JobIn.
[[operations]]
include-name = "POST /v1/jobs/batch"
phases.coverage.generation.mode = "negative"
# /v1/jobs/batch is also a GET /v1/jobs/{job_id} (a 404: no job has that id), so Allow
# rightly names GET there, which this operation's path in the schema does not.
checks.allow_header_conformance.enabled = false
"""


def _served_schema() -> dict[str, object]:
    """The document GET /openapi.json serves (``test_the_tested_schema_is_the_served_one``
    checks that the running service serves this very one)."""
    settings = ServiceSettings.model_validate(
        {"redis_url": "redis://unused", "database_url": "postgresql://unused/db"}
    )
    return create_app(settings).openapi()


# GET /v1/live streams for as long as it is asked (up to 5 minutes): an in-process client
# waits for the whole stream, so it is left out here; tests/service/test_dashboard.py reads it, bad
# parameters included.
schema = schemathesis.openapi.from_dict(
    _served_schema(), config=schemathesis.Config.from_str(CONFIG)
).exclude(path="/v1/live")


@dataclass
class Served:
    """A running service in an event loop of its own, since schemathesis' tests are synchronous.

    The service is the suite's harness (``running_service``: its lifespan, its httpx client),
    not schemathesis' ASGI transport, which starts the app's lifespan itself and stops it
    after each test item: a service (and its migrations) per operation rather than per run.
    (``schemathesis.pytest.from_fixture`` is not used either: with pytest 9.2 it fails, on
    the ``Node._nodeid`` that pytest no longer has.)
    """

    portal: BlockingPortal
    running: Running
    headers: dict[str, str]

    def send(self, case: schemathesis.Case[Any]) -> httpx.Response:
        """The case as schemathesis' own transport would send it, to the app in its loop."""
        kwargs = case.as_transport_kwargs(base_url=BASE_URL, headers=self.headers)
        prepared = requests.Request(**kwargs).prepare()
        method, url, body = prepared.method, prepared.url, prepared.body
        assert method is not None and url is not None
        assert body is None or isinstance(body, bytes | str)
        headers = {k: v if isinstance(v, str) else v.decode("latin-1") for k, v in prepared.headers.items()}

        async def call() -> httpx.Response:
            return await self.running.client.request(method, url, headers=headers, content=body)

        return self.portal.call(call)


@pytest.fixture(scope="module", params=[False, True], ids=["dev", "auth"])
def served(
    request: pytest.FixtureRequest,
    sluice_redis_server: EmbeddedRedis,
    sluice_postgres_server: EmbeddedPostgres,
) -> Iterator[Served]:
    """The service with its lifespan running, on this run's Redis and a database of its own."""
    auth: bool = request.param
    name = "t" + secrets.token_hex(6)
    database_url = sluice_postgres_server.create_database(name)
    prefix = "t" + secrets.token_hex(5)
    try:
        with (
            start_blocking_portal() as portal,
            portal.wrap_async_context_manager(
                running_service(sluice_redis_server.url, database_url, prefix, auth=auth)
            ) as running,
        ):
            headers: dict[str, str] = {}
            if auth:

                async def admin_key() -> str:
                    _, key = await running.svc.keys.create("acme", admin=True)
                    return key

                headers = {"Authorization": f"Bearer {portal.call(admin_key)}"}
            yield Served(portal, running, headers)
    finally:
        sluice_postgres_server.drop_database(name)


@schema.parametrize()
@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    # Each example is a round trip to Redis and PostgreSQL: slow next to what Hypothesis
    # expects of a pure function, and slower still on a loaded CI machine.
    suppress_health_check=[HealthCheck.too_slow],
)
def test_the_api_answers_as_its_schema_says(case: schemathesis.Case[Any], served: Served) -> None:
    response = served.send(case)
    if _not_carried(case.body):
        # JSON, and so the schema of a free-form payload, allows what the engine cannot carry
        # (integers past 64 bits, lone surrogates) or PostgreSQL cannot keep (NUL): the API
        # refuses such a job before it stores it, a refusal of a schema-valid request.
        assert 400 <= response.status_code < 500, response.text
        case.validate_response(response, headers=served.headers, excluded_checks=[positive_data_acceptance])
    else:
        case.validate_response(response, headers=served.headers)


def _not_carried(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -(2**63) <= value < 2**64
    if isinstance(value, str):
        return "\x00" in value or any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_not_carried(k) or _not_carried(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_not_carried(v) for v in value)
    return False


def test_the_tested_schema_is_the_served_one(served: Served) -> None:
    async def get() -> httpx.Response:
        return await served.running.client.get("/openapi.json")

    assert served.portal.call(get).json() == _served_schema()


def test_what_schemathesis_found_stays_fixed(served: Served) -> None:
    """The bugs the property test found, each as one request (it finds them again only by chance)."""

    async def scenario() -> None:
        client, h, store = served.running.client, served.headers, served.running.svc.store
        before = sum((await store.counts()).values())
        for payload in ({"n": 2**64}, {"s": "a\x00b"}):  # past 64 bits; NUL (PostgreSQL cannot keep it)
            r = await client.post("/v1/jobs", json={"type": "generic", "payload": payload}, headers=h)
            assert r.status_code == 422 and r.json()["error"]["field"] == "payload", r.text
        r = await client.post("/jobs", json={"type": "x", "payload": {}, "idempotencyKey": "\x00"}, headers=h)
        assert r.status_code == 422, r.text
        assert sum((await store.counts()).values()) == before  # refused before anything was stored
        # jsonb gives 4.5e23 back as 450000000000000000000000, which the queue cannot carry
        r = await client.post("/v1/jobs", json={"type": "generic", "payload": {"x": 4.5e23}}, headers=h)
        assert r.status_code == 201 and r.json()["payload"] == {"x": 4.5e23}, r.text
        # bools are not numbers; a batch answers what POST /v1/jobs would (404: no such budget)
        r = await client.post("/v1/queue/throttle", json={"seconds": False}, headers=h)
        assert r.status_code == 422, r.text
        batch = {"jobs": [{"type": "generic", "tokens": 1, "budget": "nope"}]}
        r = await client.post("/v1/jobs/batch", json=batch, headers=h)
        assert r.status_code == 404 and r.json()["error"]["field"] == "jobs.0.budget", r.text
        # a body that is not UTF-8 is invalid JSON (422), not a 400 of another shape
        r = await client.post("/v1/jobs", content=b"\xff", headers={**h, "content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "body", r.text
        # NUL in a filter: no job has it (it was a 500 from PostgreSQL)
        r = await client.get("/v1/jobs", params={"type": "a\x00"}, headers=h)
        assert r.status_code == 200 and r.json()["jobs"] == [], r.text
        # 405 names every method the path takes, not those of the first route that matched it
        r = await client.request("DELETE", "/v1/jobs", headers=h)
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.text

    served.portal.call(scenario)
