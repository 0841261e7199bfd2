"""The dispatch lab, run as a user runs it: `sluice bench lab` on its own embedded Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.lab.lab import max_concurrent, min_window_span

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


@pytest.mark.slow
def test_lab_compare_reproduces_the_race_and_passes_its_checks(tmp_path: Path) -> None:
    # Given no Redis URL, the lab starts a throw-away embedded server of its own
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}
    env["COLUMNS"] = "120"
    # When all three modes run, as the README's first command does
    proc = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "lab", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    # Then every check passes, and the table and both files are there
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    assert (tmp_path / "lab-report.html").stat().st_size > 10_000
    results = json.loads((tmp_path / "benchmark-results.json").read_text())
    assert [r["mode"] for r in results] == ["naive", "atomic", "admission"]
    by_mode = {r["mode"]: r for r in results}
    for r in results:
        for section, fields in REFERENCE_FIELDS.items():
            assert fields <= set(r[section]), (r["mode"], section)
        assert set(r["raceBudget"]) == set(r["loadBudget"])
        for latency in ("queueWaitMs", "processingMs", "endToEndMs"):
            assert set(r["metrics"][latency]) == {"p50", "p95", "p99"}
        assert len(r["jobs"]) == 28 and all(set(j) == JOB_FIELDS for j in r["jobs"])
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
    # the admission gate's rejected racers never started
    rejected = [j for j in by_mode["admission"]["jobs"] if j["status"] == "rejected"]
    assert len(rejected) == 2 and all(j["startedAt"] is None for j in rejected)
