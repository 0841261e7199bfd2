"""Failure analysis: fingerprints, the classification rules, and patterns of real dead-lettered jobs.

The rules are tables of inputs; the rest runs the service (real Redis, a real
PostgreSQL database) and a real worker whose handlers fail in different ways,
lets the jobs die, applies the engine's events to the store and runs the
collector, then reads the patterns through the API (ours and ArQueue's) and
asks for LLM analyses, answered by a fake provider (a stand-in for a paid
API) under their budget.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

from sluice.engine.context import JobContext
from sluice.engine.queue import Queue
from sluice.engine.worker import Worker
from sluice.errors import BudgetError, JobFailed, PermanentError
from sluice.llm.analysis import (
    DEFAULT_BUDGET,
    MAX_SAMPLE_CHARS,
    MAX_TOKENS,
    estimate_tokens,
    mask_secrets,
    parse_answer,
)
from sluice.llm.provider import Completion, Embeddings, Message, Provider, ProviderRejected, Usage
from sluice.llm.tokens import count_prompt_tokens
from sluice.service.handlers import service_worker
from sluice.store.categories import ADVICE, Category, classify
from sluice.store.collector import PatternCollector
from sluice.store.fingerprints import error_head, fingerprint
from sluice.store.job import NewJob
from sluice.store.patterns import ANALYSIS_JOB_TYPE, PatternStore, pattern_jobs_query
from sluice.store.schema import FailurePatternRow, JobRow, JobStateRow
from tests.conftest import eventually, running
from tests.harness.service_harness import Running, running_service


# ---- fingerprints ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("error", "error_type", "message"),
    [
        (
            "ValueError: no user 3f2a1b4c-1111-2222-3333-444455556666 in org 42\n"
            'Traceback (most recent call last):\n  File "/app/jobs.py", line 3, in run\nValueError: x',
            "ValueError",
            "no user <uuid> in org <num>",
        ),
        ("KeyError: 'prompt'\n", "KeyError", "'prompt'"),
        ("RuntimeError: user 'alice99' not found", "RuntimeError", "user <str> not found"),
        ("OSError: cannot read /var/data/in-123.json", "OSError", "cannot read <path>"),
        ("httpx.ConnectError: refused by http://10.0.0.1:8080/v1/chat", "ConnectError", "refused by <url>"),
        ("RuntimeError: mail to bob@example.com bounced", "RuntimeError", "mail to <email> bounced"),
        ("RuntimeError: redis at 192.168.1.10:6379 down", "RuntimeError", "redis at <ip> down"),
        (
            "RuntimeError: object 0xdeadbeef and sha 9fceb02d0ae598e9",
            "RuntimeError",
            "object <hex> and sha <hex>",
        ),
        ("RuntimeError: request req_8f3kD92kfLq01mZx failed", "RuntimeError", "request <id> failed"),
        (
            'RuntimeError: bad value "x y z" in   field\t\tamount',
            "RuntimeError",
            "bad value <str> in field amount",
        ),
        ("RuntimeError: can't connect, don't retry", "RuntimeError", "can't connect, don't retry"),
        (
            "AttemptTimeout: the attempt ran past its timeout of 0.3s and was cancelled; raise the job's "
            "timeout, or make the handler faster\nTraceback (most recent call last):\n...",
            "AttemptTimeout",
            "the attempt ran past its timeout of <num>s and was cancelled; raise the job's timeout, or make "
            "the handler faster",
        ),
        ("no handler named 'summarize' on worker w:12 (it serves: a)", "UnknownJobName", None),
        (
            'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nZeroDivisionError: '
            "division by zero\n",
            "ZeroDivisionError",
            "division by zero",
        ),
        ("", "Error", "<empty>"),
        ("RuntimeError: " + "x" * 1000, "RuntimeError", "x" * 299 + "…"),
    ],
)
def test_a_fingerprint_masks_what_varies(error: str, error_type: str, message: str | None) -> None:
    fp = fingerprint(error, "job")
    assert fp.error_type == error_type
    if message is not None:
        assert fp.message == message
    assert len(fp.id) == 16 and fp.id == fingerprint(error, "job").id


def test_the_same_failure_with_other_ids_is_one_fingerprint_and_other_types_are_not() -> None:
    def err(n: int) -> str:
        return f"ValueError: no user {uuid.uuid4()} in org {n}\nTraceback (most recent call last):\n  ..."

    assert len({fingerprint(err(n), "sync").id for n in range(20)}) == 1
    assert fingerprint(err(1), "sync").id != fingerprint(err(1), "other").id
    assert fingerprint(err(1), "sync").id != fingerprint(err(1).replace("ValueError", "KeyError"), "sync").id
    assert fingerprint(err(1), "sync", queue="a").id != fingerprint(err(1), "sync", queue="b").id
    # a rejection names no class: its status does
    reason = "budget acme cannot admit 500 tokens (0 of 1000 left)"
    assert fingerprint(reason, "llm", status="REJECTED").error_type == "JobRejected"
    assert fingerprint(reason, "llm", status="EXHAUSTED").error_type == "JobExhausted"
    assert error_head("Name: first\nsecond\nTraceback (most recent call last):\n x") == "Name: first second"


# ---- classification ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("error", "status", "category"),
    [
        ("RateLimitError: slow down", None, Category.THROTTLE),
        ("RuntimeError: HTTP 429 Too Many Requests", None, Category.THROTTLE),
        ("RuntimeError: you exceeded your current quota for requests per minute", None, Category.THROTTLE),
        ("RuntimeError: insufficient_quota: you exceeded your current quota", None, Category.BUDGET),
        ("BudgetNotFound: no budget named 'x'; create it first", None, Category.BUDGET),
        ("budget acme cannot admit 500 tokens (0 of 1000 left)", "REJECTED", Category.BUDGET),
        (
            "token estimate 5000 exceeds the queue token-rate limit of 1000; split it",
            "REJECTED",
            Category.BUDGET,
        ),
        ("budget acme cannot admit 500 tokens (0 of 1000 left)", "EXHAUSTED", Category.BUDGET),
        ("payload of 2000000 bytes is over this queue's limit", "REJECTED", Category.PERMANENT),
        ("ProviderRejected: openai: HTTP 401: Incorrect API key provided", None, Category.CONFIGURATION),
        ("ProviderRejected: openai: the model `gpt-9` does not exist", None, Category.CONFIGURATION),
        ("RuntimeError: 403 Forbidden", None, Category.CONFIGURATION),
        ("ConfigurationError: OPENAI_API_KEY is not set", None, Category.CONFIGURATION),
        ("KeyError: environment variable 'DB_URL' is missing", None, Category.CONFIGURATION),
        ("no handler named 'summarize' on worker w (it serves: a)", None, Category.CONFIGURATION),
        ("MissingExtra: this needs the 'llm' extra", None, Category.CONFIGURATION),
        ("ValueError: invalid api key", None, Category.CONFIGURATION),
        (
            "AttemptTimeout: the attempt ran past its timeout of 5s and was cancelled",
            None,
            Category.TRANSIENT,
        ),
        ("ConnectionResetError: [Errno 104] Connection reset by peer", None, Category.TRANSIENT),
        ("ProviderUnavailable: anthropic: HTTP 529 overloaded", None, Category.TRANSIENT),
        ("RuntimeError: upstream answered status 503", None, Category.TRANSIENT),
        ("PermanentError: upstream answered status 503, do not retry", None, Category.PERMANENT),
        ("PermanentError: email jobs need payload.to", None, Category.PERMANENT),
        ("KeyError: 'prompt'", None, Category.PERMANENT),
        ("TypeError: unsupported operand type(s) for +: 'int' and 'str'", None, Category.PERMANENT),
        ("ProviderRejected: openai: HTTP 400: max_tokens is too large", None, Category.PERMANENT),
        ("JobFailed: payload.fail is true (attempt 2 of 2)", None, Category.UNKNOWN),
        ("RuntimeError: something odd", None, Category.UNKNOWN),
    ],
)
def test_the_rules_classify_failures(error: str, status: str | None, category: Category) -> None:
    fp = fingerprint(error, "job", status=status)
    assert classify(fp.error_type, fp.head, status=status) is category


def test_every_category_says_what_to_do() -> None:
    assert set(ADVICE) == set(Category) and all(len(a) > 40 for a in ADVICE.values())


def test_secrets_are_masked_before_they_leave_for_a_provider() -> None:
    raw = (
        "ProviderRejected: openai: HTTP 401: Incorrect API key provided: sk-proj-abcdef1234567890XYZ "
        "(Authorization: Bearer abcdefghijklmnop) at https://user:hunter2@api.example.com/v1 "
        "password=hunter2 AKIAIOSFODNN7EXAMPLE for bob@example.com"
    )
    masked = mask_secrets(raw)
    for secret in (
        "sk-proj-abcdef",
        "abcdefghijklmnop",
        "hunter2",
        "AKIAIOSFODNN7EXAMPLE",
        "bob@example.com",
    ):
        assert secret not in masked
    assert "Incorrect API key provided" in masked and "api.example.com" in masked


@pytest.mark.parametrize(
    ("answer", "root_cause", "fix"),
    [
        ('{"root_cause": "a bad key", "fix": "rotate it"}', "a bad key", "rotate it"),
        ('```json\n{"root_cause": "a bad key", "fix": "rotate it"}\n```', "a bad key", "rotate it"),
        ('Here: {"root_cause": "a bad key"} hope it helps', "a bad key", ""),
        ("The key is wrong; rotate it.", "The key is wrong; rotate it.", ""),
        ('{"fix": "x"}', '{"fix": "x"}', ""),
    ],
)
def test_an_answer_is_read_as_json_or_kept_as_text(answer: str, root_cause: str, fix: str) -> None:
    assert parse_answer(answer) == {"root_cause": root_cause, "fix": fix}


# ---- real dead-lettered jobs -------------------------------------------------------------------------------
class FakeProvider:
    """A stand-in for a paid LLM API: answers what it is told, records what it was sent.
    ``name``: the provider it stands in for (its tokens are counted as that one's);
    ``default_model``: the model the worker's environment would configure (None: none)."""

    def __init__(
        self,
        answer: str = "",
        *,
        fail: Exception | None = None,
        name: str = "fake",
        default_model: str | None = None,
    ) -> None:
        self.answer = answer
        self.fail = fail
        self.name = name
        self.default_model = default_model
        self.calls: list[tuple[list[Message], str, int]] = []

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str,
        max_tokens: int,
        temperature: float | None = None,
        idempotency_key: str | None = None,
    ) -> Completion:
        self.calls.append((list(messages), model, max_tokens))
        if self.fail is not None:
            raise self.fail
        return Completion(
            self.answer, model, self.name, Usage(prompt_tokens=150, completion_tokens=50), cost=0.01
        )

    async def embed(self, texts: Sequence[str], *, model: str, dimensions: int | None = None) -> Embeddings:
        raise ProviderRejected(self.name, "no embeddings", kind="unsupported")

    async def aclose(self) -> None:
        return None


def test_the_fake_is_a_provider() -> None:
    assert isinstance(FakeProvider(), Provider)


async def sync_user(job: JobContext) -> None:
    raise ValueError(f"no user {uuid.uuid4()} in org {job.payload['org']}")


async def slow_call(job: JobContext) -> None:
    await asyncio.sleep(10)


async def charge(job: JobContext) -> None:
    raise PermanentError(f"card declined for order {job.payload['order']}")


async def llm_call(job: JobContext) -> None:
    raise ProviderRejected(
        "openai", "HTTP 401: Incorrect API key provided: sk-proj-abcdef1234567890XYZ", status=401, kind="auth"
    )


def failing_worker(prefix: str) -> Worker:
    worker = service_worker(prefix=prefix, concurrency=8, timeout=0.3)
    for name, fn in (
        ("sync-user", sync_user),
        ("slow-call", slow_call),
        ("charge", charge),
        ("llm-call", llm_call),
    ):
        worker.register(name, fn)
    return worker


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def submit(api: Running, key: str, jobs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    ids = []
    for job_type, payload in jobs:
        body = {"type": job_type, "payload": payload, "max_attempts": 1}
        resp = await api.client.post("/v1/jobs", json=body, headers=auth(key))
        assert resp.status_code == 201, resp.text
        ids.append(resp.json()["id"])
    return ids


async def until_finished(api: Running, ids: list[str], status: str = "DEAD_LETTER") -> None:
    async def done() -> bool:
        await api.drain_events()
        rows = [await api.svc.store.get(uuid.UUID(i)) for i in ids]
        return all(r is not None and r.status == status for r in rows)

    await eventually(done, timeout=30, interval=0.05)


def later() -> datetime:
    return datetime.now(UTC) + timedelta(seconds=1)


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix, auth=True) as svc:
        yield svc


async def test_dead_lettered_jobs_become_patterns_counted_once(
    api: Running, prefix: str, redis_url: str
) -> None:
    _, acme = await api.svc.keys.create("acme", admin=True)
    _, globex = await api.svc.keys.create("globex", admin=True)
    # Given jobs that die in four ways (three of one kind, with other ids each time), and one of
    # another tenant that dies as the first three do
    acme_ids = await submit(
        api,
        acme,
        [("sync-user", {"org": n}) for n in (1, 2, 3)]
        + [("slow-call", {}), ("charge", {"order": 17}), ("charge", {"order": 18}), ("llm-call", {})],
    )
    globex_ids = await submit(api, globex, [("sync-user", {"org": 9})])
    async with running(failing_worker(prefix), redis_url):
        await until_finished(api, acme_ids + globex_ids)
    # When the collector passes (two at once, as when the sink's lead changes hands)
    collector, other = PatternCollector(api.svc.db, settle=0), PatternCollector(api.svc.db, settle=0)
    done, also = await asyncio.gather(collector.collect(now=later()), other.collect(now=later()))
    # Then there is one pattern per kind of failure and tenant, counted once, classified and dated
    assert (done.looked, also.looked, done.counted + also.counted) == (8, 8, 8)
    assert (await other.collect(now=later())).counted == 0
    listed = await api.client.get("/v1/failures/patterns", headers=auth(acme))
    assert listed.status_code == 200, listed.text
    patterns = listed.json()["patterns"]
    by_type = {p["job_type"]: p for p in patterns}
    assert [p["job_type"] for p in patterns][:1] == ["sync-user"]  # most frequent first
    assert {t: (p["error_type"], p["category"], p["count"]) for t, p in by_type.items()} == {
        "sync-user": ("ValueError", "permanent", 3),
        "slow-call": ("AttemptTimeout", "transient", 1),
        "charge": ("PermanentError", "permanent", 2),
        "llm-call": ("ProviderRejected", "configuration", 1),
    }
    sync = by_type["sync-user"]
    assert sync["message"] == "no user <uuid> in org <num>"
    assert sync["advice"] == ADVICE[Category.PERMANENT] and sync["analysis_state"] == "none"
    async with api.svc.db.sessions() as session:
        times = (
            await session.execute(
                select(func.min(JobStateRow.updated_at), func.max(JobStateRow.updated_at)).where(
                    JobStateRow.id.in_([uuid.UUID(i) for i in acme_ids[:3]])
                )
            )
        ).one()
    assert (datetime.fromisoformat(sync["first_seen"]), datetime.fromisoformat(sync["last_seen"])) == tuple(
        times
    )
    assert sync["sample_job_id"] in acme_ids[:3] and "Traceback" in sync["sample_error"]

    # A second pass, and a collector that starts afresh, count nothing again
    assert (await collector.collect(now=later())).counted == 0
    assert (await PatternCollector(api.svc.db, settle=0).collect(now=later())).counted == 0
    async with api.svc.db.sessions() as session:
        assert await session.scalar(select(func.sum(FailurePatternRow.count))) == 8

    # Filters, orders, one pattern and its jobs
    transient = await api.client.get(
        "/v1/failures/patterns", params={"category": "transient"}, headers=auth(acme)
    )
    assert [p["job_type"] for p in transient.json()["patterns"]] == ["slow-call"]
    recent = await api.client.get(
        "/v1/failures/patterns", params={"sort": "last_seen", "limit": 2}, headers=auth(acme)
    )
    assert len(recent.json()["patterns"]) == 2 and recent.json()["next_offset"] == 2
    one = await api.client.get(f"/v1/failures/patterns/{sync['id']}", headers=auth(acme))
    assert one.status_code == 200 and one.json()["count"] == 3
    jobs = await api.client.get(
        f"/v1/failures/patterns/{sync['id']}/jobs", params={"limit": 2}, headers=auth(acme)
    )
    first = jobs.json()
    more = await api.client.get(
        f"/v1/failures/patterns/{sync['id']}/jobs",
        params={"cursor": first["next_cursor"]},
        headers=auth(acme),
    )
    assert sorted(j["id"] for j in first["jobs"] + more.json()["jobs"]) == sorted(acme_ids[:3])
    assert more.json()["next_cursor"] is None

    # Tenants see their own patterns only: the same failure is a pattern of each (same id, own
    # counts and jobs), and an id only another tenant has is a 404
    theirs = (await api.client.get("/v1/failures/patterns", headers=auth(globex))).json()["patterns"]
    assert [(p["id"], p["count"]) for p in theirs] == [(sync["id"], 1)]
    their_jobs = (
        await api.client.get(f"/v1/failures/patterns/{sync['id']}/jobs", headers=auth(globex))
    ).json()
    assert [j["id"] for j in their_jobs["jobs"]] == globex_ids
    only_acme = by_type["charge"]["id"]
    for path in (f"/v1/failures/patterns/{only_acme}", f"/v1/failures/patterns/{only_acme}/jobs"):
        assert (await api.client.get(path, headers=auth(globex))).status_code == 404
    assert (
        await api.client.post(f"/v1/failures/patterns/{only_acme}/analysis", headers=auth(globex))
    ).status_code == 404
    assert (await api.client.get("/v1/failures/patterns/not-an-id", headers=auth(acme))).status_code == 422

    # ArQueue's routes: a dead task's analysis, and the patterns
    arq = await api.client.get(f"/dead_letter/{acme_ids[0]}/analysis", headers=auth(acme))
    assert arq.status_code == 200, arq.text
    body = arq.json()
    assert (body["task_id"], body["pattern_id"], body["category"], body["count"]) == (
        acme_ids[0],
        sync["id"],
        "permanent",
        3,
    )
    assert body["normalized_message"] == sync["message"] and body["ai_status"] == "none"
    assert body["first_seen"] <= body["last_seen"] and isinstance(body["first_seen"], int)
    assert (
        await api.client.get(f"/dead_letter/{globex_ids[0]}/analysis", headers=auth(acme))
    ).status_code == 404
    assert (
        await api.client.get(f"/dead_letter/{uuid.uuid4()}/analysis", headers=auth(acme))
    ).status_code == 404
    assert (await api.client.get("/dead_letter/nope/analysis", headers=auth(acme))).status_code == 404
    ai = await api.client.get("/ai/patterns", headers=auth(acme))
    assert ai.status_code == 200
    assert {p["pattern_id"]: p["count"] for p in ai.json()} == {p["id"]: p["count"] for p in patterns}
    assert {"normalized_message", "error_type", "advice", "sample_task_id", "ai_status"} <= set(ai.json()[0])

    # No AI provider configured: asking for an LLM analysis says so
    refused = await api.client.post(f"/v1/failures/patterns/{sync['id']}/analysis", headers=auth(acme))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "ai_not_configured"
    assert "AI_PROVIDER" in refused.json()["message"]

    # A redriven job that dies again counts again (a new death), once
    redrive = await api.client.post(
        "/v1/dead-letters/redrive", json={"ids": [acme_ids[0]]}, headers=auth(acme)
    )
    assert redrive.json() == {"redriven": 1}
    await api.drain_events()
    async with running(failing_worker(prefix), redis_url):
        await until_finished(api, [acme_ids[0]])
    assert (await collector.collect(now=later())).counted == 1
    assert (await collector.collect(now=later())).counted == 0
    again = (await api.client.get(f"/v1/failures/patterns/{sync['id']}", headers=auth(acme))).json()
    assert again["count"] == 4 and again["last_seen"] > sync["last_seen"]


async def test_a_job_dead_but_not_counted_yet_has_the_rules_analysis(
    api: Running, prefix: str, redis_url: str
) -> None:
    _, acme = await api.svc.keys.create("acme")
    (job_id,) = await submit(api, acme, [("llm-call", {})])
    async with running(failing_worker(prefix), redis_url):
        await until_finished(api, [job_id])
    body = (await api.client.get(f"/dead_letter/{job_id}/analysis", headers=auth(acme))).json()
    assert (body["category"], body["count"], body["first_seen"], body["ai_status"]) == (
        "configuration",
        0,
        None,
        "none",
    )
    after = await PatternCollector(api.svc.db, settle=0).collect(now=later())
    assert after.counted == 1
    counted = (await api.client.get(f"/dead_letter/{job_id}/analysis", headers=auth(acme))).json()
    assert counted["pattern_id"] == body["pattern_id"] and counted["count"] == 1
    # a job that did not die has no analysis
    (ok,) = await submit(api, acme, [("generic", {})])
    async with running(service_worker(prefix=prefix), redis_url):
        await until_finished(api, [ok], "COMPLETED")
    assert (await api.client.get(f"/dead_letter/{ok}/analysis", headers=auth(acme))).status_code == 409


ANSWER = (
    '{"root_cause": "The workers send a revoked OpenAI key.", "fix": "Rotate OPENAI_API_KEY on the workers."}'
)


async def test_the_llm_analysis_runs_as_a_job_under_its_budget(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    async with running_service(
        redis_url,
        sluice_database_url,
        prefix,
        auth=True,
        SLUICE_LLM_PROVIDER="fake",
        SLUICE_LLM_MODEL="fake-1",
        analysis_budget_tokens=50_000,
    ) as api:
        _, admin = await api.svc.keys.create("acme", admin=True)
        _, reader = await api.svc.keys.create("acme")
        ids = await submit(api, admin, [("llm-call", {}), ("sync-user", {"org": 1})])
        async with running(failing_worker(prefix), redis_url):
            await until_finished(api, ids)
        await PatternCollector(api.svc.db, settle=0).collect(now=later())
        by_type = {
            p["job_type"]: p
            for p in (await api.client.get("/v1/failures/patterns", headers=auth(admin))).json()["patterns"]
        }
        config, sync = by_type["llm-call"], by_type["sync-user"]
        path = f"/v1/failures/patterns/{config['id']}/analysis"
        assert (await api.client.post(path, headers=auth(reader))).status_code == 403

        # Asked for, it is a job on the queue under the analysis budget, made with a daily window
        asked = await api.client.post(path, headers=auth(admin))
        assert asked.status_code == 202, asked.text
        job_id = asked.json()["job_id"]
        assert asked.json()["state"] == "pending"
        again = await api.client.post(path, headers=auth(admin))
        assert (again.status_code, again.json()["job_id"]) == (202, job_id)  # one job, however often asked
        job = await api.svc.store.get(uuid.UUID(job_id))
        assert job is not None and (job.type, job.budget, job.tenant) == (
            ANALYSIS_JOB_TYPE,
            DEFAULT_BUDGET,
            "acme",
        )
        assert job.tokens == estimate_tokens(job.payload, provider="fake", model="fake-1")
        assert job.tokens > 400
        assert "sk-proj" not in str(job.payload)  # masked before it entered the queue
        budget = (await api.client.get(f"/v1/budgets/{DEFAULT_BUDGET}", headers=auth(admin))).json()
        assert (budget["limit"], budget["window"], budget["used"]) == (50_000, "day", 0)
        pending = (await api.client.get(f"/v1/failures/patterns/{config['id']}", headers=auth(admin))).json()
        assert (pending["analysis_state"], pending["analysis_job_id"]) == ("pending", job_id)

        # When a worker runs it (the provider is a fake), the answer is the pattern's analysis
        fake = FakeProvider(ANSWER)
        worker = service_worker(prefix=prefix, analysis=fake)
        async with running(worker, redis_url):
            await until_finished(api, [job_id], "COMPLETED")
        (messages, model, max_tokens), *_ = fake.calls
        assert model == "fake-1" and max_tokens == 400
        prompt = messages[-1]["content"]
        assert "ProviderRejected" in prompt and "configuration" in prompt and "sk-proj" not in prompt
        done = (await api.client.get(f"/v1/failures/patterns/{config['id']}", headers=auth(admin))).json()
        assert done["analysis_state"] == "done" and done["analysis_job_id"] is None
        assert done["analysis"]["root_cause"] == "The workers send a revoked OpenAI key."
        assert (done["analysis"]["fix"], done["analysis"]["model"], done["analysis"]["tokens"]) == (
            "Rotate OPENAI_API_KEY on the workers.",
            "fake-1",
            200,
        )
        # the budget was charged what the provider reported
        assert (await api.svc.queue.budgets.get(DEFAULT_BUDGET)).used == 200
        # asked again: the cached analysis, no new job
        cached = await api.client.post(path, headers=auth(admin))
        assert (cached.status_code, cached.json()["state"]) == (200, "done")
        assert cached.json()["analysis"]["root_cause"] == done["analysis"]["root_cause"]
        arq = (await api.client.get(f"/dead_letter/{ids[0]}/analysis", headers=auth(admin))).json()
        assert (
            arq["ai_status"] == "done"
            and arq["ai_analysis"]["fix"] == "Rotate OPENAI_API_KEY on the workers."
        )

        # An analysis job that fails says why; asking again makes a new job
        sync_path = f"/v1/failures/patterns/{sync['id']}/analysis"
        first = (await api.client.post(sync_path, headers=auth(admin))).json()["job_id"]
        broken = FakeProvider(
            fail=ProviderRejected("fake", "HTTP 404: no such model", status=404, kind="model")
        )
        worker = service_worker(prefix=prefix, analysis=broken)
        async with running(worker, redis_url):
            await until_finished(api, [first])
        failed = (await api.client.get(f"/v1/failures/patterns/{sync['id']}", headers=auth(admin))).json()
        assert failed["analysis_state"] == "failed" and "no such model" in failed["analysis_error"]

        # Never without a budget: when the budget cannot be made, nothing is enqueued ...
        async def no_budget(*args: Any, **kwargs: Any) -> Any:
            raise BudgetError("budgets may be nested at most 8 deep")

        budgets = api.svc.queue.budgets
        budgets.create = no_budget  # type: ignore[method-assign]
        refused = await api.client.post(sync_path, headers=auth(admin))
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "analysis_refused"
        assert "runs under a budget" in refused.json()["message"]
        del budgets.create
        async with api.svc.db.sessions() as session:
            made = await session.scalar(select(func.count()).where(JobRow.type == ANALYSIS_JOB_TYPE))
        assert made == 2
        # ... and asked again properly, the failed analysis gets a new job
        retry = await api.client.post(sync_path, headers=auth(admin))
        assert retry.status_code == 202 and retry.json()["job_id"] != first
        used = (await api.svc.queue.budgets.get(DEFAULT_BUDGET)).used
        fake = FakeProvider(ANSWER)
        worker = service_worker(prefix=prefix, analysis=fake)
        async with running(worker, redis_url):
            await until_finished(api, [retry.json()["job_id"]], "COMPLETED")
        assert len(fake.calls) == 1
        assert (await api.svc.queue.budgets.get(DEFAULT_BUDGET)).used == used + 200


async def test_the_command_line_lists_shows_and_asks_for_analyses(
    redis_url: str, sluice_database_url: str, prefix: str
) -> None:
    from tests.cli.test_cli import invoke

    async with running_service(redis_url, sluice_database_url, prefix) as api:  # sluice dev: tenant default
        ids = []
        for job_type, payload in [("sync-user", {"org": 1}), ("sync-user", {"org": 2}), ("llm-call", {})]:
            body = {"type": job_type, "payload": payload, "max_attempts": 1}
            ids.append((await api.client.post("/v1/jobs", json=body)).json()["id"])
        async with running(failing_worker(prefix), redis_url):
            await until_finished(api, ids)
        db = ("--database", sluice_database_url)
        # --collect counts what the service's collector has not yet
        listed = json.loads((await invoke("failures", "patterns", *db, "--collect", "--json")).stdout)
        assert [(p["job_type"], p["count"], p["category"]) for p in listed] == [
            ("sync-user", 2, "permanent"),
            ("llm-call", 1, "configuration"),
        ]
        table = (await invoke("failures", "patterns", *db, "--category", "configuration")).stdout
        assert "llm-call" in table and "sync-user" not in table
        config = listed[1]["id"]
        shown = (await invoke("failures", "show", config, *db)).stdout
        assert "configuration" in shown and "ProviderRejected" in shown and ids[2] in shown
        assert "no failure pattern" in (await invoke("failures", "show", "0" * 16, *db, code=1)).output
        assert (
            await invoke("failures", "patterns", *db, "--tenant", "other", "--json")
        ).stdout.strip() == "[]"

        where = ("--redis", redis_url, "--prefix", prefix)
        off = {"SLUICE_LLM_PROVIDER": "", "AI_PROVIDER": ""}
        refused = await invoke("failures", "analyze", config, *db, *where, code=1, env=off)
        assert "AI_PROVIDER" in refused.output
        on = {"SLUICE_LLM_PROVIDER": "", "AI_PROVIDER": "fake", "AI_MODEL": "fake-2"}
        asked = json.loads(
            (await invoke("failures", "analyze", config, *db, *where, "--json", env=on)).stdout
        )
        assert asked["state"] == "pending"
        job = await api.svc.store.get(uuid.UUID(asked["job_id"]))
        assert job is not None and (job.type, job.budget, job.payload["model"]) == (
            ANALYSIS_JOB_TYPE,
            DEFAULT_BUDGET,
            "fake-2",
        )
        again = json.loads(
            (await invoke("failures", "analyze", config, *db, *where, "--json", env=on)).stdout
        )
        assert again["job_id"] == asked["job_id"]
        assert (await api.svc.queue.budgets.get(DEFAULT_BUDGET)).window == "day"


async def test_without_a_provider_given_the_worker_environment_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sluice.llm.analysis import _provider

    monkeypatch.setenv("SLUICE_LLM_PROVIDER", "no-such-provider")
    with pytest.raises(PermanentError, match="ConfigurationError: SLUICE_LLM_PROVIDER='no-such-provider'"):
        await _provider(None)
    fake = FakeProvider()
    assert await _provider(fake) == (fake, False)
    assert await _provider(lambda: fake) == (fake, True)


# ---- the analysis's reservation bounds what it sends ---------------------------------------------------
def _ping(depth: int, org: int) -> None:
    if depth == 0:
        raise ValueError(
            f"組織 {org} の請求書を作成できませんでした: 顧客データが見つかりません (Счёт не создан, "
            "données introuvables)。" * 6
        )
    _pong(depth - 1, org)


def _pong(depth: int, org: int) -> None:
    _ping(depth - 1, org)  # two frames in turn: a traceback that does not fold its repeats


async def invoice(job: JobContext) -> None:
    """Dies with a long Japanese message on top of a deep traceback: a sample whose tokens a
    quarter of its characters does not bound (bytes per character, and code's punctuation)."""
    _ping(40, job.payload["org"])


@pytest.mark.parametrize(
    ("provider", "model"), [("openai", "gpt-4o"), ("anthropic", "claude-sonnet-4-5")], ids=["exact", "bytes"]
)
async def test_the_analysis_reserves_what_its_prompt_and_answer_can_use(
    redis_url: str, sluice_database_url: str, prefix: str, provider: str, model: str
) -> None:
    async with running_service(
        redis_url,
        sluice_database_url,
        prefix,
        auth=True,
        SLUICE_LLM_PROVIDER=provider,
        SLUICE_LLM_MODEL=model,
        analysis_budget="ops-analysis",
    ) as api:
        _, admin = await api.svc.keys.create("acme", admin=True)
        ids = await submit(api, admin, [("invoice", {"org": 7})])
        worker = failing_worker(prefix)
        worker.register("invoice", invoice)
        async with running(worker, redis_url):
            await until_finished(api, ids)
        await PatternCollector(api.svc.db, settle=0).collect(now=later())
        (pattern,) = (await api.client.get("/v1/failures/patterns", headers=auth(admin))).json()["patterns"]
        asked = await api.client.post(f"/v1/failures/patterns/{pattern['id']}/analysis", headers=auth(admin))
        assert asked.status_code == 202, asked.text
        job = await api.svc.store.get(uuid.UUID(asked.json()["job_id"]))
        assert job is not None and job.budget == "ops-analysis"

        # When a worker runs it (a fake of the configured provider, counted as that one)
        fake = FakeProvider(ANSWER, name=provider)
        async with running(service_worker(prefix=prefix, analysis=fake), redis_url):
            await until_finished(api, [str(job.id)], "COMPLETED")
        ((messages, used, max_tokens),) = fake.calls
        sample = messages[-1]["content"]
        assert "請求書" in sample and "Traceback" in sample and sample.count('File "') >= 6
        # Then the reservation is at least what the tokens module counts for the very messages it
        # sent, to the model it asked, and the longest answer it asked for: the whole answer
        assert (used, max_tokens) == (model, MAX_TOKENS)
        assert job.tokens >= count_prompt_tokens(messages, provider=fake.name, model=used) + max_tokens

        # The analysis budget is the service's: a caller's job may not spend from it
        spend = {"type": "generic", "payload": {}, "budget": "ops-analysis", "tokens": 10}
        refused = await api.client.post("/v1/jobs", json=spend, headers=auth(admin))
        assert refused.status_code == 422 and "failure analyses'" in refused.json()["message"]


async def test_the_handler_bounds_the_sample_and_asks_the_workers_model(
    queue: Queue, redis_url: str, prefix: str
) -> None:
    # Given analysis jobs put on the queue by a producer with Redis access, past the API's checks:
    # one with a huge sample and a model of its choosing, one without a budget
    await queue.budgets.create(DEFAULT_BUDGET, 1_000_000, window="day")
    payload = {
        "pattern": "0" * 16,
        "job_type": "t" * 5_000,
        "error_type": "ValueError",
        "message": "m" * 5_000,
        "category": "permanent",
        "count": 3,
        "sample": "ValueError: " + "秘" * 30_000,
        "model": "the-priciest-model",
        "max_tokens": MAX_TOKENS,
    }
    big = await queue.add(ANALYSIS_JOB_TYPE, payload, tokens=200_000, budget=DEFAULT_BUDGET, max_attempts=1)
    bare = await queue.add(ANALYSIS_JOB_TYPE, {"pattern": "0" * 16}, max_attempts=1)
    # When a worker configured with its own model runs them
    fake = FakeProvider(ANSWER, default_model="worker-model")
    async with running(service_worker(queue.name, prefix=prefix, analysis=fake), redis_url):
        await big.result(timeout=30)
        with pytest.raises(JobFailed, match="run under a budget"):
            await bare.result(timeout=30)
    # Then the provider was asked once, with the worker's model, and a prompt cut to its bounds
    ((messages, model, _),) = fake.calls
    assert model == "worker-model"
    prompt = messages[-1]["content"]
    assert prompt.count("秘") <= MAX_SAMPLE_CHARS and prompt.count("m") < 400 and prompt.count("t") < 400
    assert len(prompt) < MAX_SAMPLE_CHARS + 1_500


# ---- only the service makes analysis jobs ---------------------------------------------------------------
@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "routes"])
async def test_callers_cannot_make_analysis_jobs_nor_spend_the_analysis_budget(
    redis_url: str, sluice_database_url: str, prefix: str, fast_lane: bool
) -> None:
    # A service with no AI provider configured, and the analysis budget already made
    async with running_service(redis_url, sluice_database_url, prefix, auth=True, fast_lane=fast_lane) as api:
        _, key = await api.svc.keys.create("acme", admin=True)
        await api.svc.queue.budgets.create(DEFAULT_BUDGET, 200_000, window="day")
        await api.svc.queue.budgets.create("mine", 1_000)
        forged = {"pattern": "0" * 16, "sample": "x" * 50_000, "model": "the-priciest-model"}
        # the key the next analysis of a pattern asks for (llm.analysis.idempotency_key)
        claim = f"{ANALYSIS_JOB_TYPE}:jobs:{'0' * 16}:{datetime.now(UTC).date().isoformat()}:0"
        made_by = "failure-analysis jobs are made by POST /v1/failures/patterns/{id}/analysis"
        theirs = "is the failure analyses'"
        reserved = "are the service's"
        attempts: list[tuple[str, dict[str, Any], str]] = [
            (
                "/v1/jobs",
                {"type": ANALYSIS_JOB_TYPE, "payload": forged, "budget": DEFAULT_BUDGET, "tokens": 500},
                made_by,
            ),
            ("/v1/jobs", {"type": ANALYSIS_JOB_TYPE, "payload": forged}, made_by),
            ("/v1/jobs/batch", {"jobs": [{"type": ANALYSIS_JOB_TYPE, "payload": forged}]}, made_by),
            ("/jobs", {"type": ANALYSIS_JOB_TYPE, "payload": forged}, made_by),
            ("/enqueue", {"type": ANALYSIS_JOB_TYPE, "payload": forged}, made_by),
            ("/v1/jobs", {"type": "generic", "payload": {}, "budget": DEFAULT_BUDGET, "tokens": 10}, theirs),
            (
                "/v1/jobs/batch",
                {"jobs": [{"type": "generic", "payload": {}, "budget": DEFAULT_BUDGET, "tokens": 10}]},
                theirs,
            ),
            (
                "/v1/jobs",
                {"type": "llm-inference", "payload": {"prompt": "hi", "budget_usd": DEFAULT_BUDGET}},
                theirs,
            ),
            ("/v1/jobs", {"type": "generic", "payload": {}, "idempotency_key": claim}, reserved),
            (
                "/v1/jobs/batch",
                {"jobs": [{"type": "generic", "payload": {}, "idempotency_key": claim}]},
                reserved,
            ),
            ("/jobs", {"type": "generic", "payload": {}, "idempotencyKey": claim}, reserved),
            ("/enqueue", {"type": "generic", "payload": {}, "idempotencyKey": claim}, reserved),
        ]
        for path, body, says in attempts:
            resp = await api.client.post(path, json=body, headers=auth(key))
            # ArQueue's route answers what a job type refuses with 400, as ArQueue does
            assert resp.status_code == (400 if path == "/enqueue" else 422), (path, body, resp.text)
            assert says in resp.json()["message"], (path, resp.text)
        # nothing was stored, nothing enqueued, nothing reserved
        async with api.svc.db.sessions() as session:
            assert await session.scalar(select(func.count()).select_from(JobRow)) == 0
        assert (await api.svc.queue.counts())["waiting"] == 0
        assert (await api.svc.queue.budgets.get(DEFAULT_BUDGET)).used == 0
        # a budget of the caller's own, and a key of its own, are fine
        mine = {
            "type": "generic",
            "payload": {},
            "budget": "mine",
            "tokens": 10,
            "idempotency_key": "analysis-1",
        }
        assert (await api.client.post("/v1/jobs", json=mine, headers=auth(key))).status_code == 201


# ---- a pattern's jobs, by its index -------------------------------------------------------------------
_FILL = """
WITH j AS (
    INSERT INTO jobs (id, tenant, queue, type, priority, max_attempts, payload, backoff, created_at)
    SELECT md5('job' || i)::uuid, 'acme', CASE WHEN i % 4 = 0 THEN 'other' ELSE 'jobs' END, 'sync',
           0, 1, '{}', '[]', now() - i * interval '1 second'
    FROM generate_series(1, 20000) AS i
    RETURNING id, tenant, queue, created_at
), s AS (
    INSERT INTO job_states (id, tenant, queue, created_at, status, error, updated_at)
    SELECT id, tenant, queue, created_at, 'DEAD_LETTER', 'ValueError: x', created_at FROM j
    RETURNING id, tenant, queue, updated_at
)
INSERT INTO failure_pattern_jobs (job_id, tenant, queue, pattern, status, token, dead_at)
SELECT id, tenant, queue, 'p' || (abs(hashtext(id::text)) % 3), 'DEAD_LETTER', 1, updated_at FROM s
"""


async def test_a_patterns_jobs_page_reads_its_index_in_order(sluice_database_url: str) -> None:
    from sqlalchemy import text

    from sluice.store.database import Database

    db = Database(sluice_database_url)
    try:
        await db.migrate()
        async with db.sessions() as session, session.begin():
            await session.execute(text(_FILL))
            for table in ("jobs", "job_states", "failure_pattern_jobs"):
                await session.execute(text(f"ANALYZE {table}"))

        async def plan(after: tuple[datetime, uuid.UUID] | None) -> str:
            query = pattern_jobs_query("acme", "jobs", "p1", limit=51, after=after)
            sql = query.compile(dialect=db.engine.dialect, compile_kwargs={"literal_binds": True})
            async with db.sessions() as session:
                return "\n".join(r[0] for r in await session.execute(text(f"EXPLAIN {sql}")))

        # a first page and one further on: the pattern's index, in its order, and no sort
        for after in (None, (datetime.now(UTC) - timedelta(hours=2), uuid.UUID(int=0))):
            found = await plan(after)
            assert "Scan using ix_failure_pattern_jobs_pattern" in found, found
            assert "Sort" not in found, found
            # the cursor is a condition of the index, not a filter of the rows it reads
            assert "Filter" not in found, found
        # and the page is the pattern's latest deaths of that queue
        page = await PatternStore(db).jobs("acme", "jobs", "p1", limit=5)
        assert len(page.jobs) == 5 and page.next_cursor is not None
        assert [at for _, at in page.jobs] == sorted((at for _, at in page.jobs), reverse=True)
        assert {j.queue for j, _ in page.jobs} == {"jobs"}
    finally:
        await db.close()


# ---- a death committed late is counted ------------------------------------------------------------------
async def test_a_death_committed_behind_the_collectors_cursor_is_counted(
    api: Running, prefix: str, redis_url: str
) -> None:
    _, acme = await api.svc.keys.create("acme")
    first = await submit(api, acme, [("sync-user", {"org": 1})])
    async with running(failing_worker(prefix), redis_url):
        await until_finished(api, first)
    collector = PatternCollector(api.svc.db, settle=0)
    assert (await collector.collect(now=later())).counted == 1
    cursor = await api.svc.store.get(uuid.UUID(first[0]))
    assert cursor is not None
    # Given a job whose death a sink batch committed late: its updated_at (stamped before the
    # batch connected) is behind the cursor the pass left
    await _dead_row(
        api,
        {"org": 2},
        f"ValueError: no user {uuid.uuid4()} in org 2",
        cursor.updated_at - timedelta(seconds=20),
    )
    # When the next pass runs, it is counted, into its pattern, once
    again = await collector.collect(now=later())
    assert (again.counted, again.late) == (1, 1)
    assert (await collector.collect(now=later())).counted == 0
    assert (await PatternCollector(api.svc.db, settle=0).collect(now=later())).counted == 0
    (pattern,) = (await api.client.get("/v1/failures/patterns", headers=auth(acme))).json()["patterns"]
    assert pattern["count"] == 2
    # a death older than the overlap the pass looks back over is left (a bounded look-back)
    await _dead_row(api, {"org": 3}, "ValueError: x", cursor.updated_at - timedelta(hours=1))
    assert (await collector.collect(now=later())).counted == 0


async def _dead_row(api: Running, payload: dict[str, Any], error: str, updated_at: datetime) -> uuid.UUID:
    """A stored job put straight into DEAD_LETTER with this error and updated_at, as a sink batch
    that committed late leaves it."""
    job, _ = await api.svc.store.create(
        NewJob("acme", "jobs", "sync-user", payload, priority=0, max_attempts=1, backoff=["fixed", 1, 1, 0])
    )
    async with api.svc.db.sessions() as session, session.begin():
        await session.execute(
            update(JobStateRow)
            .where(JobStateRow.id == job.id)
            .values(status="DEAD_LETTER", error=error, updated_at=updated_at)
        )
    return job.id
