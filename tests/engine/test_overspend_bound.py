"""The bound on overspend, with real worker processes (docs/architecture.md, "The token ledger").

Jobs estimate E tokens and their handlers report U > E, so every admitted job
spends U - E beyond its reservation. A budget admits a job only while its
estimate fits, so it can pass its limit L only by what the jobs already
running when it filled use beyond their estimates: with at most C running at
once, the real spend stays within L + C * (U - E). And the budget is the money
spent: its ``used`` is that spend, its ``overspent`` the excess, to the token.

Two worker processes (4 slots each) share a global concurrency of C = 6.
Every figure checked comes from the handlers: each one writes what it
reported to a Redis hash (:func:`spends_key`), and the real spend is their
sum, never the ledger's own count.

The worker runs in its processes as ``sluice worker
tests.engine.test_overspend_bound:worker`` (this module; see :func:`make_worker`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from redis.asyncio import Redis

from sluice import JobContext, JobSpec, JobState, Queue, Worker
from sluice.engine.connection import connect
from tests.conftest import eventually
from tests.harness.proc_harness import WorkerProcs

TARGET = "tests.engine.test_overspend_bound:worker"
#: the jobs' estimate, and what each call really uses
E, U = 50, 80
#: the binding limit. No multiple of U lies in (L - E, L]: a budget refuses a job only
#: when it has charged more than L - E, so the spend (a multiple of U) passes L on
#: every run, not by luck of timing.
L = 3030
#: the global concurrency, below the two processes' 8 slots
C = 6
JOBS = 80
PROCESSES = ("A", "B")
SLOTS = 4


def spends_key(prefix: str) -> str:
    return f"{prefix}:test:spends"


def make_worker(redis_url: str, prefix: str) -> Worker:
    """A Worker of queue ``q`` whose handler ``spend`` sleeps ``payload["ms"]``, reports
    ``payload["used"]`` tokens and writes what it reported, with its span, to :func:`spends_key`."""
    worker = Worker("q", prefix=prefix, lease=10.0, shutdown_grace=5.0)

    @worker.handler
    async def spend(job: JobContext) -> int:
        payload: dict[str, Any] = job.payload
        client = connect(redis_url)
        try:
            start = time.time_ns() // 1_000_000
            await asyncio.sleep(payload["ms"] / 1000)
            used = int(payload["used"])
            job.record_usage(used)
            end = time.time_ns() // 1_000_000
            span = {
                "worker": job.worker_id,
                "budget": payload["budget"],
                "used": used,
                "start": start,
                "end": end,
            }
            await client.hset(spends_key(prefix), job.id, orjson.dumps(span))
        finally:
            await client.aclose()
        return used

    return worker


def __getattr__(name: str) -> Worker:
    # Built on first use, in the worker processes, from the environment WorkerProcs gives them.
    if name == "worker":
        return make_worker(os.environ["SLUICE_TEST_REDIS"], os.environ["SLUICE_TEST_PREFIX"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@pytest.fixture
def procs(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[WorkerProcs]:
    with WorkerProcs(redis_url, prefix, tmp_path) as p:
        yield p


def most_at_once(spans: list[dict[str, Any]]) -> int:
    """The most handler spans open at one instant (an end at t closes before a start at t)."""
    edges = sorted([(s["start"], 1) for s in spans] + [(s["end"], -1) for s in spans])
    return max(itertools.accumulate(step for _, step in edges))


async def run_jobs(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue, budgets: list[str], on_exhausted: str
) -> tuple[dict[str, JobState], dict[str, dict[str, Any]]]:
    """Run JOBS jobs (E tokens each, spread over ``budgets``) on two worker processes until each
    has completed or ended as its policy says; returns every job's state and the handlers' spans."""
    await queue.set_global_concurrency(C)
    for wid in PROCESSES:
        procs.launch(wid, TARGET, "--concurrency", str(SLOTS))

    async def all_up() -> bool:
        return len(await redis.hkeys(queue.keys.workers)) == len(PROCESSES)

    await eventually(all_up, timeout=20)
    specs = [
        JobSpec(
            "spend",
            {"used": U, "ms": 10 + i * 7 % 40, "budget": budgets[i % len(budgets)]},
            tokens=E,
            budget=budgets[i % len(budgets)],
            on_exhausted=on_exhausted,
            max_attempts=1,
        )
        for i in range(JOBS)
    ]
    ids = [job.id for job in await queue.add_bulk(specs)]
    not_admitted = JobState.REJECTED if on_exhausted == "reject" else JobState.PARKED

    async def settled() -> dict[str, JobState] | None:
        counts = await queue.counts()
        if counts["active"] or counts["waiting"] or counts["delayed"]:
            return None
        states = {i: r.state for i in ids if (r := await queue.get_job(i)) is not None}
        done = all(s in (JobState.COMPLETED, not_admitted) for s in states.values())
        return states if done and len(states) == JOBS else None

    states: dict[str, JobState] = await eventually(settled, timeout=30, interval=0.05)
    raw: dict[bytes, bytes] = await redis.hgetall(spends_key(prefix))  # type: ignore[assignment]
    spans = {k.decode(): orjson.loads(v) for k, v in raw.items()}
    return states, spans


def check_jobs(states: dict[str, JobState], spans: dict[str, dict[str, Any]], on_exhausted: str) -> int:
    """Every job either completed (and its handler wrote its spend) or ended as its policy says;
    the handlers ran on both processes, never more than C at once. Returns the real spend."""
    completed = {i for i, s in states.items() if s is JobState.COMPLETED}
    assert set(spans) == completed
    others = {s for i, s in states.items() if i not in completed}
    assert others == {JobState.REJECTED if on_exhausted == "reject" else JobState.PARKED}, others
    assert {s["worker"] for s in spans.values()} == set(PROCESSES)
    assert most_at_once(list(spans.values())) <= C
    return sum(s["used"] for s in spans.values())


@pytest.mark.slow
async def test_overspend_stays_within_the_bound_and_the_budget_says_what_was_spent(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a budget of L tokens, and JOBS jobs estimating E that really use U, rejected if they do not fit
    await queue.budgets.create("b", L)

    # When two worker processes run them, C at once
    states, spans = await run_jobs(procs, redis, prefix, queue, ["b"], "reject")

    # Then the budget was overspent, by no more than the jobs running when it filled used beyond E
    spent = check_jobs(states, spans, "reject")
    admitted = len(spans)
    assert spent == admitted * U
    assert L < spent <= L + C * (U - E), (spent, admitted)
    # and the budget says what the handlers spent, to the token
    state = await queue.budgets.get("b")
    assert (state.used, state.overspent, state.remaining) == (spent, spent - L, 0)
    assert state.beyond_estimates == admitted * (U - E)
    assert (state.accepted, state.rejected) == (admitted, JOBS - admitted)
    # and every job it did not admit was rejected, with nothing left parked or running
    counts = await queue.counts()
    assert (counts["completed"], counts["rejected"], counts["parked"]) == (admitted, JOBS - admitted, 0)


@pytest.mark.slow
async def test_overspend_of_a_parent_stays_within_the_bound_and_every_level_says_what_was_spent(
    procs: WorkerProcs, redis: Redis, prefix: str, queue: Queue
) -> None:
    # Given a parent budget of L tokens over two teams whose own limits are far above it,
    # and JOBS jobs (half on each team) estimating E that really use U, parked if they do not fit
    await queue.budgets.create("org", L)
    for team in ("team-a", "team-b"):
        await queue.budgets.create(team, 10 * L, parent="org")

    # When two worker processes run them, C at once
    states, spans = await run_jobs(procs, redis, prefix, queue, ["team-a", "team-b"], "wait")

    # Then the parent was overspent, by no more than the jobs running when it filled used beyond E
    spent = check_jobs(states, spans, "wait")
    admitted = len(spans)
    assert spent == admitted * U
    assert L < spent <= L + C * (U - E), (spent, admitted)
    # and the parent says what all the handlers spent, to the token
    org = await queue.budgets.get("org")
    assert (org.used, org.overspent, org.remaining) == (spent, spent - L, 0)
    assert org.beyond_estimates == admitted * (U - E)
    # and each team says what its own jobs' handlers spent (under its limit: not overspent)
    for team in ("team-a", "team-b"):
        mine = [s for s in spans.values() if s["budget"] == team]
        state = await queue.budgets.get(team)
        assert (state.used, state.overspent) == (sum(s["used"] for s in mine), 0), team
        assert state.beyond_estimates == len(mine) * (U - E)
    # and every job the parent did not admit is parked, waiting for a top-up, none rejected
    counts = await queue.counts()
    assert (counts["completed"], counts["parked"], counts["rejected"]) == (admitted, JOBS - admitted, 0)
