"""What a mode of ``sluice bench lab`` shows: its figures and checks, computed from the job
records and the spans the handlers wrote, never from the engine's own counters."""

from __future__ import annotations

from typing import Any

import orjson

from sluice.engine.job import JobState
from sluice.engine.queue import Queue
from sluice_lab.lab_worker import lab_key
from sluice_lab.lab_workload import Workload
from sluice_lab.stats import percentile

#: How much later than its dispatch a handler may record its start.
START_LAG_MS = 50


def _pcts(values: list[float]) -> dict[str, float | None]:
    s = sorted(values)
    return {k: _r(percentile(s, p)) for k, p in (("p50", 50), ("p95", 95), ("p99", 99))}


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def max_concurrent(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one instant (an end at t closes before a start at t opens)."""
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    peak = cur = 0
    for _, step in edges:
        cur += step
        peak = max(peak, cur)
    return peak


def min_window_span(starts: list[float], size: int) -> float | None:
    """The shortest time covered by ``size`` consecutive starts (None: fewer starts)."""
    s = sorted(starts)
    if len(s) < size:
        return None
    return min(s[i + size - 1] - s[i] for i in range(len(s) - size + 1))


def overuse_figures(
    spent: list[int],
    *,
    limit: int,
    estimate: int,
    usage: int,
    concurrency: int,
    ledger_used: int,
    ledger_overspent: int,
) -> dict[str, Any]:
    """The overuse phase's figures: ``spent`` is what each attempt's call used, as its handler
    reported it (the real spend is their sum); the ledger's figures are what the budget says.

    The bound: each job was admitted while its estimate fitted, so the budget
    can pass its limit only by what the jobs running when it filled (at most
    ``concurrency``) use beyond their estimates.
    """
    real = sum(spent)
    return {
        "limit": limit,
        "estimate": estimate,
        "usage": usage,
        "concurrency": concurrency,
        "realSpend": real,
        "overspend": real - limit,
        "bound": limit + concurrency * max(usage - estimate, 0),
        "ledgerUsed": ledger_used,
        "ledgerOverspent": ledger_overspent,
    }


def overuse_checks(figures: dict[str, Any]) -> dict[str, bool]:
    """Spend within the bound, and a ledger that says what was spent (used and overspent, to the token)."""
    real = figures["realSpend"]
    return {
        "overuseWithinBound": real <= figures["bound"],
        "ledgerMatchesRealSpend": figures["ledgerUsed"] == real
        and figures["ledgerOverspent"] == max(real - figures["limit"], 0),
    }


#: Checks the naive gate is expected to fail: its 'allPassed' does not count them.
NAIVE_EXPECTED_FAILURES = frozenset(
    {"atomicBudgetNeverOverspent", "overuseWithinBound", "ledgerMatchesRealSpend"}
)


async def _report(
    queue: Queue,
    mode: str,
    w: Workload,
    load: list[tuple[str, int, int]],
    race: list[tuple[str, int, int]],
    overuse: list[tuple[str, int, int]],
) -> dict[str, Any]:
    raw: list[bytes] = await queue.redis.lrange(lab_key(queue.name, "spans"), 0, -1)  # type: ignore[assignment]
    spans = [orjson.loads(r) for r in raw]
    by_job: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_job.setdefault(span["job"], []).append(span)
    phases = (("load", load), ("race", race), ("overuse", overuse))
    records = {
        r.id: r for r in await queue.get_jobs([i for _, plan in phases for i, _, _ in plan]) if r is not None
    }
    jobs = []
    for phase, plan in phases:
        for job_id, _index, priority in plan:
            jobs.append(_job_row(phase, job_id, priority, records.get(job_id), by_job.get(job_id, []), w))

    load_rows = [j for j in jobs if j["phase"] == "load"]
    done = [j for j in load_rows if j["status"] == "completed"]
    first_start = min((j["startedAt"] for j in done), default=None)
    last_end = max((j["completedAt"] for j in done), default=None)
    throughput = (
        len(done) / ((last_end - first_start) / 1000)
        if first_start and last_end and last_end > first_start
        else None
    )
    all_spans = [(s["start"], s["end"]) for s in spans]
    overuse_ids = {i for i, _, _ in overuse}
    # the overuse phase runs without the rate limit
    starts = [s["start"] for s in spans if s["job"] not in overuse_ids]
    fifth = min_window_span(starts, w.rate_limit_max + 1)
    worker_ids = sorted({s["worker"] for s in spans})

    load_budget = await _budget(queue, mode, "load", w.load_budget, load_rows)
    race_budget = await _budget(queue, mode, "race", w.race_budget, [j for j in jobs if j["phase"] == "race"])
    overuse_budget = await _overuse(
        queue,
        mode,
        w,
        [j for j in jobs if j["phase"] == "overuse"],
        [s for s in spans if s["job"] in overuse_ids],
    )
    until: bytes | None = await queue.redis.hget(queue.keys.control, "throttled_until")  # type: ignore[assignment]
    throttle = _throttle(load, records, by_job, spans, w, int(until or 0))

    high = [min(s["start"] for s in by_job[i]) for i, _, p in load if p == 1 and i in by_job]
    low = [min(s["start"] for s in by_job[i]) for i, _, p in load if p != 1 and i in by_job]
    fits = w.race_budget // w.tokens_per_job
    expected_race = (fits, w.race_jobs - fits, w.race_budget - fits * w.tokens_per_job)
    if mode == "naive":
        # Every racer read the full balance and wrote back balance - cost.
        expected_race = (w.race_jobs, 0, w.race_budget - w.tokens_per_job)
    got_race = (
        race_budget["acceptedReservations"],
        race_budget["rejectedReservations"],
        race_budget["remaining"],
    )
    load_workers = {j["workerId"] for j in done}
    checks = {
        "usedTwoWorkers": len(load_workers) >= 2,
        "priorityOrderEnforced": bool(high and low) and max(high) <= min(low),
        "sharedConcurrencyCeilingHeld": max_concurrent(all_spans) <= w.global_concurrency,
        "globalRateLimitObserved": fifth is None or fifth >= w.rate_check_min_ms,
        "atomicBudgetNeverOverspent": all(
            b["admittedTokens"] <= b["initial"] and b["remaining"] == b["initial"] - b["admittedTokens"]
            for b in (load_budget, race_budget)
        ),
        "raceOutcomeMatchedExpectation": got_race == expected_race,
        **overuse_checks(overuse_budget),
        "throttleRecovered": bool(throttle["recovered"]),
    }
    # The naive gate is expected to overspend (that is the race it shows);
    # raceOutcomeMatchedExpectation checks that it did, exactly as predicted.
    # It counts estimates only, so the overuse phase spends past the bound and
    # its ledger says less than was spent: shown, not counted.
    counted = {k: v for k, v in checks.items() if not (mode == "naive" and k in NAIVE_EXPECTED_FAILURES)}
    checks["allPassed"] = all(counted.values())
    return {
        "mode": mode,
        "workload": w.as_reference(),
        "metrics": {
            "throughputJobsPerSecond": _r(throughput),
            "maxConcurrent": max_concurrent(all_spans),
            "minimumMsBetweenEveryFifthStart": _r(fifth),
            "queueWaitMs": _pcts([j["queueWaitMs"] for j in done]),
            "processingMs": _pcts([j["serviceMs"] for j in done]),
            "endToEndMs": _pcts([j["endToEndMs"] for j in done]),
            "workerIds": worker_ids,
        },
        "loadBudget": load_budget,
        "raceBudget": race_budget,
        "overuseBudget": overuse_budget,
        "checks": checks,
        "jobs": jobs,
        "throttle": throttle,
    }


def _job_row(
    phase: str, job_id: str, priority: int, record: Any, spans: list[dict[str, Any]], w: Workload
) -> dict[str, Any]:
    final = max(spans, key=lambda s: s["start"]) if spans else None
    enqueued = float(record.created_ms) if record else None
    started = final["start"] if final else None
    ended = final["end"] if final else None
    refused = final is not None and final["outcome"] == "rejected"
    if refused or (record is not None and record.state is JobState.REJECTED):
        status = "rejected"
    elif record is not None:
        status = record.state.value
    else:
        status = "missing"
    completed = status == "completed"
    return {
        "jobId": job_id,
        "phase": phase,
        "workerId": final["worker"] if final else None,
        "priority": priority,
        "attempt": record.attempt if record else None,
        "enqueuedAt": enqueued,
        "startedAt": started,
        "completedAt": ended if completed else None,
        "queueWaitMs": _r(started - enqueued) if started and enqueued else None,
        "serviceMs": _r(ended - started) if completed and started and ended else None,
        "endToEndMs": _r(ended - enqueued) if completed and ended and enqueued else None,
        "tokenCost": w.tokens_per_job,
        "reserved": completed,
        "remainingBudget": final.get("remaining") if final else None,
        "status": status,
    }


async def _budget(
    queue: Queue, mode: str, phase: str, initial: int, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    if mode == "naive":
        remaining = int(await queue.redis.get(lab_key(queue.name, f"naive:{phase}")) or 0)
    else:
        remaining = (await queue.budgets.get(f"lab-{phase}")).remaining
    accepted = sum(1 for r in rows if r["reserved"])
    admitted = sum(r["tokenCost"] for r in rows if r["reserved"])
    return {
        "initial": initial,
        "remaining": remaining,
        "acceptedReservations": accepted,
        "rejectedReservations": sum(1 for r in rows if r["status"] == "rejected"),
        "admittedTokens": admitted,
        "admittedUtilizationPct": round(100 * admitted / initial, 1),
        "ledgerUtilizationPct": round(100 * (initial - remaining) / initial, 1),
    }


async def _overuse(
    queue: Queue, mode: str, w: Workload, rows: list[dict[str, Any]], spans: list[dict[str, Any]]
) -> dict[str, Any]:
    """The overuse phase: what the handlers spent against what the budget says."""
    limit = w.overuse_budget
    if mode == "naive":
        used = limit - int(await queue.redis.get(lab_key(queue.name, "naive:overuse")) or 0)
        overspent = max(used - limit, 0)
    else:
        state = await queue.budgets.get("lab-overuse")
        used, overspent = state.used, state.overspent
    figures = overuse_figures(
        [int(s.get("usage", 0)) for s in spans],
        limit=limit,
        estimate=w.tokens_per_job,
        usage=w.overuse_usage,
        concurrency=w.concurrency,
        ledger_used=used,
        ledger_overspent=overspent,
    )
    return {
        **figures,
        "admittedJobs": sum(1 for r in rows if r["status"] == "completed"),
        "rejectedJobs": sum(1 for r in rows if r["status"] == "rejected"),
        "maxConcurrent": max_concurrent([(s["start"], s["end"]) for s in spans]),
    }


def _throttle(
    load: list[tuple[str, int, int]],
    records: dict[str, Any],
    by_job: dict[str, list[dict[str, Any]]],
    spans: list[dict[str, Any]],
    w: Workload,
    until_ms: int,
) -> dict[str, Any]:
    job_id = next(i for i, index, _ in load if index == w.throttled_index)
    mine = sorted(by_job.get(job_id, []), key=lambda s: s["start"])
    hit = next((s for s in mine if s["outcome"] == "throttled"), None)
    record = records.get(job_id)
    out: dict[str, Any] = {
        "jobId": job_id,
        "retryAfterMs": w.throttle_retry_after_ms,
        "throttledAt": hit["end"] if hit else None,
        "resumedAt": None,
        "pausedMs": None,
        "attempts": len(mine),
        "recordedAttempt": record.attempt if record else None,
        "failures": record.failures if record else None,
        "status": record.state.value if record else "missing",
        "noFailureRecorded": bool(record and record.failures == 0),
        "pauseHeld": False,
        "recovered": False,
    }
    if hit is not None and until_ms > 0:
        # The dispatch script recorded the 429 at until - retry_after (its `now`).
        at = until_ms - w.throttle_retry_after_ms
        # A handler starts a few ms after its dispatch: a job dispatched just
        # before the 429 was recorded may start just after it.
        after = [s["start"] for s in spans if s["start"] > at + START_LAG_MS]
        resumed = min(after) if after else None
        out["throttledAt"] = at
        out["resumedAt"] = resumed
        out["pausedMs"] = _r(resumed - at) if resumed else None
        out["pauseHeld"] = resumed is not None and resumed >= until_ms
    out["recovered"] = (
        hit is not None
        and out["status"] == "completed"
        and out["noFailureRecorded"]
        and out["recordedAttempt"] == 1
        and out["pauseHeld"]
    )
    return out
