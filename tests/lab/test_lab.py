"""The dispatch lab, run as a user runs it: `sluice bench lab` on its own embedded Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice_lab.lab_checks import max_concurrent, min_window_span, overuse_checks, overuse_figures
from sluice_lab.lab_workload import Workload

REFERENCE_FIELDS = {
    "workload": {"loadJobs", "workerProcesses", "globalConcurrency", "rateLimitMax", "rateLimitDurationMs"},
    "metrics": {
        "throughputJobsPerSecond",
        "maxConcurrent",
        "minimumMsBetweenEveryFifthStart",
        "queueWaitMs",
        "processingMs",
        "endToEndMs",
        "workerIds",
    },
    "loadBudget": {
        "initial",
        "remaining",
        "acceptedReservations",
        "rejectedReservations",
        "admittedTokens",
        "admittedUtilizationPct",
        "ledgerUtilizationPct",
    },
    "checks": {
        "usedTwoWorkers",
        "priorityOrderEnforced",
        "sharedConcurrencyCeilingHeld",
        "globalRateLimitObserved",
        "atomicBudgetNeverOverspent",
        "raceOutcomeMatchedExpectation",
        "allPassed",
    },
}
OVERUSE_FIELDS = {
    "limit",
    "estimate",
    "usage",
    "concurrency",
    "realSpend",
    "overspend",
    "bound",
    "ledgerUsed",
    "ledgerOverspent",
    "admittedJobs",
    "rejectedJobs",
    "maxConcurrent",
}
JOB_FIELDS = {
    "jobId",
    "phase",
    "workerId",
    "priority",
    "attempt",
    "enqueuedAt",
    "startedAt",
    "completedAt",
    "queueWaitMs",
    "serviceMs",
    "endToEndMs",
    "tokenCost",
    "reserved",
    "remainingBudget",
    "status",
}


def test_spans_open_at_once_are_counted_with_ends_before_starts() -> None:
    assert max_concurrent([]) == 0
    assert max_concurrent([(0, 10), (10, 20)]) == 1  # one ends as the next starts
    assert max_concurrent([(0, 10), (5, 20), (6, 7), (30, 40)]) == 3
    assert min_window_span([0, 250, 500, 750], 5) is None
    assert min_window_span([0, 250, 500, 750, 1000, 1100, 1200, 1300, 1400], 5) == 400


def _overuse(spent: list[int], used: int, overspent: int) -> dict[str, object]:
    """Figures of jobs estimating 100 that spent ``spent`` against 1,000 tokens, 4 at once (bound 1,200)."""
    return overuse_figures(
        spent,
        limit=1000,
        estimate=100,
        usage=150,
        concurrency=4,
        ledger_used=used,
        ledger_overspent=overspent,
    )


def test_overuse_is_checked_against_the_bound_and_the_handlers_figures() -> None:
    # the lab's workload allows 4 at once: the global ceiling, below the workers' 6 slots
    assert Workload().concurrency == 4
    assert Workload(global_concurrency=8).concurrency == 6
    # 8 jobs of 150 (4 of them running when the budget filled): 1,200, the bound itself, all in the ledger
    figures = _overuse([150] * 8 + [0] * 8, 1200, 200)
    assert (figures["realSpend"], figures["overspend"], figures["bound"]) == (1200, 200, 1200)
    assert overuse_checks(figures) == {"overuseWithinBound": True, "ledgerMatchesRealSpend": True}
    # a 9th admitted job: past the bound
    assert overuse_checks(_overuse([150] * 9, 1350, 350))["overuseWithinBound"] is False
    # a ledger that counted estimates only (the naive gate, or usage capped at the limit) says less
    assert overuse_checks(_overuse([150] * 10, 1000, 0)) == {
        "overuseWithinBound": False,
        "ledgerMatchesRealSpend": False,
    }
    assert overuse_checks(_overuse([150] * 8, 1000, 0))["ledgerMatchesRealSpend"] is False
    # used right but overspent wrong (or the other way round) is a ledger that does not tell the truth
    assert overuse_checks(_overuse([150] * 8, 1200, 0))["ledgerMatchesRealSpend"] is False
    assert overuse_checks(_overuse([150] * 6, 900, 0))["ledgerMatchesRealSpend"] is True
    assert overuse_checks(_overuse([150] * 6, 1000, 0))["ledgerMatchesRealSpend"] is False


@pytest.mark.slow
def test_lab_compare_reproduces_the_race_and_passes_its_checks(tmp_path: Path) -> None:
    # Given no Redis URL, the lab starts a throw-away embedded server of its own
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}
    env["COLUMNS"] = "120"
    # and two burst results: one in the output folder, one given with --burst
    burst = {"meta": {}, "summary": [{"jobs": 7, "drain_s": 0.25, "rate": 28.0}]}
    (tmp_path / "burst-in-out.json").write_text(json.dumps(burst))
    given = tmp_path / "elsewhere" / "given.json"
    given.parent.mkdir()
    given.write_text(json.dumps(burst))
    # When all three modes run, as the README's first command does
    proc = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "lab", "--out", str(tmp_path), "--burst", str(given)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    # Then every check passes, and the table and both files are there
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    page = (tmp_path / "lab-report.html").read_text(encoding="utf-8")
    assert len(page) > 10_000
    assert "<h3>given.json</h3>" in page and "<h3>burst-in-out.json</h3>" in page
    assert page.count("<td>7</td><td>Sluice</td><td>0.250</td><td>28</td>") == 2
    results = json.loads((tmp_path / "benchmark-results.json").read_text())
    assert [r["mode"] for r in results] == ["naive", "atomic", "admission"]
    by_mode = {r["mode"]: r for r in results}
    for r in results:
        for section, fields in REFERENCE_FIELDS.items():
            assert fields <= set(r[section]), (r["mode"], section)
        assert set(r["raceBudget"]) == set(r["loadBudget"])
        for latency in ("queueWaitMs", "processingMs", "endToEndMs"):
            assert set(r["metrics"][latency]) == {"p50", "p95", "p99"}
        assert len(r["jobs"]) == 44 and all(set(j) == JOB_FIELDS for j in r["jobs"])
        assert set(r["overuseBudget"]) == OVERUSE_FIELDS
        assert r["metrics"]["workerIds"] == ["worker-a", "worker-b"]
        assert r["metrics"]["maxConcurrent"] <= 4
        assert r["metrics"]["minimumMsBetweenEveryFifthStart"] >= 900
        # the 429: one extra attempt, the queue paused, the job completed uncounted
        t = r["throttle"]
        assert (t["attempts"], t["recordedAttempt"], t["failures"], t["status"]) == (2, 1, 0, "completed")
        assert t["pausedMs"] >= 500
        assert r["checks"]["allPassed"] is True
    # the naive gate admits all four racers (400 of 200 tokens) and the ledger shows 100 left
    naive = by_mode["naive"]["raceBudget"]
    assert (naive["acceptedReservations"], naive["admittedTokens"], naive["remaining"]) == (4, 400, 100)
    assert (naive["admittedUtilizationPct"], naive["ledgerUtilizationPct"]) == (200.0, 50.0)
    assert by_mode["naive"]["checks"]["atomicBudgetNeverOverspent"] is False
    # the atomic ledger and the admission gate admit exactly two, reject two, leave nothing
    for mode in ("atomic", "admission"):
        race = by_mode[mode]["raceBudget"]
        assert (race["acceptedReservations"], race["rejectedReservations"], race["remaining"]) == (2, 2, 0)
        assert by_mode[mode]["loadBudget"]["remaining"] == 0
        assert by_mode[mode]["checks"]["atomicBudgetNeverOverspent"] is True
    # the admission gate's rejected racers (and overuse jobs) never started
    rejected = [j for j in by_mode["admission"]["jobs"] if j["status"] == "rejected"]
    assert all(j["startedAt"] is None for j in rejected)
    assert len([j for j in rejected if j["phase"] == "race"]) == 2

    # overuse: 16 jobs estimating 100 that use 150 against 1,000 tokens, at most 4 at once.
    # The atomic ledger and the admission gate stop admitting once the estimate no longer
    # fits, so the spend passes the limit (no multiple of 150 lies in 901..1,000) by at
    # most 4 x 50, and the budget says what was spent, to the token.
    for mode in ("atomic", "admission"):
        over = by_mode[mode]["overuseBudget"]
        assert (over["limit"], over["bound"], over["concurrency"]) == (1000, 1200, 4)
        assert 1000 < over["realSpend"] <= over["bound"], over
        assert over["realSpend"] == 150 * over["admittedJobs"]
        assert over["admittedJobs"] + over["rejectedJobs"] == 16
        assert (over["ledgerUsed"], over["ledgerOverspent"]) == (over["realSpend"], over["realSpend"] - 1000)
        assert by_mode[mode]["checks"]["overuseWithinBound"] is True
        assert by_mode[mode]["checks"]["ledgerMatchesRealSpend"] is True
    overuse_rejected = [j for j in rejected if j["phase"] == "overuse"]
    assert len(overuse_rejected) == by_mode["admission"]["overuseBudget"]["rejectedJobs"]
    # the naive gate admits while the estimate fits its balance (at least 10 jobs: 1,500 tokens,
    # past the bound) and its balance counts only the estimates: it says "full", not overspent
    naive_over = by_mode["naive"]["overuseBudget"]
    assert naive_over["realSpend"] >= 1500 and naive_over["ledgerUsed"] <= 1000, naive_over
    assert naive_over["ledgerOverspent"] == 0
    assert by_mode["naive"]["checks"]["overuseWithinBound"] is False
    assert by_mode["naive"]["checks"]["ledgerMatchesRealSpend"] is False
