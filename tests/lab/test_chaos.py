"""The chaos bench: a short run under real faults, and its checker caught lying.

The run kills a worker, freezes one past its lease and kills Redis, on the
Redis version of the session's server (so both 6.2 and 7.x). The checker
tests feed it fabricated states with a lost job, a doubled result and a
stale commit, so a checker that saw nothing wrong would fail here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sluice.cli.app import app
from sluice.testing import EmbeddedRedis
from sluice_lab import chaos
from sluice_lab.chaos import run_chaos
from sluice_lab.chaos_check import CAUSES, Execution, Fault, JobView, RedisState, cause_of, check
from sluice_lab.chaos_plan import FREEZE_S, WINDOW, ChaosSpec, plan_faults

SHORT = ChaosSpec(
    jobs=400,
    workers=3,
    concurrency=4,
    producers=2,
    duration=10.0,
    seed=7,
    kills=1,
    freezes=1,
    redis_restarts=1,
    redis_down_s=0.5,
    work_ms=(20, 120),
    drain_timeout=60.0,
)


@pytest.mark.slow
async def test_short_chaos_run_loses_and_doubles_nothing(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    # Given 400 jobs added over 10 s by two producers, on three worker processes,
    # When a worker is SIGKILLed, another frozen past its lease, and Redis killed and restarted
    result = await run_chaos(SHORT, binary=redis_server.binary, keep=tmp_path)

    # Then the faults happened: the killed and the frozen worker's jobs ran again elsewhere,
    # and the producers met the outage
    kinds = [f["kind"] for f in result["faults"]]
    assert sorted(kinds) == ["freeze", "kill", "redis"], result["faults"]
    causes = result["check"]["re_executions_by_cause"]
    assert causes[CAUSES[0]] >= 1 and causes[CAUSES[1]] >= 1, (causes, result["faults"])
    assert sum(result["producers"]["errors"].values()) > 0
    # and every accepted job completed once, with the result of the one execution kept
    counts = result["check"]["counts"]
    assert counts["accepted"] == counts["completed"] == SHORT.jobs
    for key in (
        "lost",
        "ended_otherwise",
        "unexpected_executions",
        "unexpected_jobs",
        "duplicate_results",
        "stale_commits_accepted",
        "results_not_witnessed",
        "completed_without_event",
    ):
        assert counts[key] == 0, (key, result["check"]["examples"])
    assert result["check"]["passed"], result["check"]
    assert result["engine_counts"]["completed"] == SHORT.jobs
    assert result["check"]["executions"] == SHORT.jobs + result["check"]["re_executions"]
    assert result["warnings"] == []


def _ex(job: str, n: int, pid: int, token: int, start: float, end: float | None = None) -> Execution:
    return Execution(job, n, token, pid, f"w{pid}", token, start, end, "returned" if end else None)


def test_checker_reports_lost_doubled_stale_and_unexpected_jobs() -> None:
    # Given five accepted jobs, as the producers were told
    accepted = {0: "1", 1: "2", 2: "3", 3: "4", 4: "5"}
    # and what Redis holds: job 1 fine; job 2 gone; job 3 committed twice; job 4 kept the
    # answer of its first lease (token 1) although its last lease was token 2; job 5 was
    # committed after its lease had expired (stalled, then completed, never leased again);
    # and a job 9 that no producer added
    state = RedisState(
        jobs={
            "1": JobView("1", "completed", 1, {"pid": 10, "token": 1, "n": 0}),
            "3": JobView("3", "completed", 2, {"pid": 11, "token": 2, "n": 2}),
            "4": JobView("4", "completed", 2, {"pid": 10, "token": 1, "n": 3}),
            "5": JobView("5", "completed", 1, {"pid": 12, "token": 1, "n": 4}),
            "9": JobView("9", "completed", 1, {"pid": 11, "token": 1, "n": 9}),
        },
        commits={
            "1": [{"pid": 10, "token": 1, "n": 0}],
            "3": [{"pid": 10, "token": 1, "n": 2}, {"pid": 11, "token": 2, "n": 2}],
            "4": [{"pid": 10, "token": 1, "n": 3}],
            "5": [{"pid": 12, "token": 1, "n": 4}],
            "9": [{"pid": 11, "token": 1, "n": 9}],
        },
        lifecycle={"1": ["added", "active", "completed"], "5": ["added", "active", "stalled", "completed"]},
        stats={"completed": 6},
    )
    # and what the witnesses saw
    executions = [
        _ex("1", 0, 10, 1, 1.0, 1.1),
        _ex("3", 2, 10, 1, 1.0, 1.2),
        _ex("3", 2, 11, 2, 5.0, 5.1),
        _ex("4", 3, 10, 1, 1.0, 9.0),
        _ex("4", 3, 11, 2, 5.0, 5.1),
        _ex("5", 4, 12, 1, 1.0, 9.0),
        _ex("9", 9, 11, 1, 6.0, 6.1),
    ]

    # When the checker holds them against each other
    report = check(accepted, state, executions)

    # Then it fails the run and names each problem
    assert not report["passed"]
    counts = report["counts"]
    assert (counts["lost"], counts["duplicate_results"], counts["stale_commits_accepted"]) == (1, 1, 3)
    assert (counts["unexpected_executions"], counts["unexpected_jobs"]) == (1, 1)
    examples = report["examples"]
    assert examples["lost"] == ["2"]
    assert examples["duplicate_results"] == ["3"]
    assert examples["stale_commits_accepted"] == ["3", "4", "5"]
    assert examples["unexpected_jobs"] == ["9"]
    assert report["re_executions"] == 2


def test_checker_passes_a_clean_state_and_counts_a_surplus_commit() -> None:
    # Given a job whose first execution died with its worker, and whose second was kept
    result = {"pid": 11, "token": 2, "n": 0}
    clean = RedisState(
        jobs={"1": JobView("1", "completed", 2, result)},
        commits={"1": [result]},
        lifecycle={"1": ["added", "active", "stalled", "active", "cancel_requested", "completed"]},
        stats={"completed": 1},
    )
    executions = [_ex("1", 0, 10, 1, 1.0), _ex("1", 0, 11, 2, 3.0, 3.1)]
    kill = Fault("kill", 1.5, 1.5, 0, pid=10, worker="w10")
    # Then the check passes, and names the kill as the cause of the one re-execution
    report = check({0: "1"}, clean, executions, [kill])
    assert report["passed"], report
    assert report["re_executions_by_cause"][CAUSES[0]] == 1
    # but the queue's own counter saying two commits were accepted for one job fails the run
    doubled = RedisState(clean.jobs, clean.commits, clean.lifecycle, {"completed": 2})
    assert check({0: "1"}, doubled, executions, [kill])["counts"]["duplicate_results"] == 1
    # and so does a result that names no execution that returned
    other = {"pid": 12, "token": 2, "n": 0}
    unwitnessed = RedisState({"1": JobView("1", "completed", 2, other)}, {"1": [other]})
    report = check({0: "1"}, unwitnessed, executions, [kill])
    assert report["counts"]["results_not_witnessed"] == 1 and not report["passed"]


def test_causes_follow_the_faults() -> None:
    freeze = Fault("freeze", 2.0, 8.0, 1, pid=20)
    outage = Fault("redis", 10.0, 11.0)
    faults = [freeze, outage]
    assert cause_of(_ex("1", 0, 20, 1, 1.0, 8.5), faults, 2.0) == CAUSES[1]
    assert cause_of(_ex("1", 0, 21, 1, 9.5, 9.6), faults, 2.0) == CAUSES[2]
    assert cause_of(_ex("1", 0, 21, 1, 14.0, 14.1), faults, 2.0) == CAUSES[3]


def test_the_schedule_is_seeded_and_keeps_a_worker_running() -> None:
    spec = ChaosSpec(jobs=10, workers=2, duration=40.0, seed=3, kills=3, freezes=3, redis_restarts=2)
    plan = plan_faults(spec)
    assert plan == plan_faults(spec)
    assert plan != plan_faults(ChaosSpec(jobs=10, workers=2, duration=40.0, seed=4, kills=3, freezes=3))
    assert len(plan.faults) + len(plan.skipped) == 8
    low, high = (f * spec.duration for f in WINDOW)
    assert all(low <= f.at <= high for f in plan.faults)
    freezes = [f for f in plan.faults if f.kind == "freeze"]
    for a in freezes:  # never both workers frozen at once
        assert FREEZE_S[0] <= a.hold <= FREEZE_S[1]
        assert not any(b is not a and a.at <= b.at <= a.at + a.hold for b in freezes)


def test_the_command_exits_1_when_the_check_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Given a run whose check found a lost job (the run itself is replaced: this is about the command)
    failed = {
        "config": {"seed": 1},
        "faults": [{"kind": "kill", "at_s": 1.0, "until_s": 1.0, "worker": "w1", "pid": 1}],
        "producers": {"add_calls": 1, "errors": {}, "applied_before_outcome_unknown": 0},
        "timings": {"run_s": 2.0, "jobs_per_s": 1.0},
        "engine_counts": {"completed": 1},
        "timeline": {"bin_s": 0.25, "added": [1, 2], "started": [1, 1], "completed": [0, 1]},
        "warnings": [],
        "check": check(
            {0: "1", 1: "2"},
            RedisState(
                {"1": JobView("1", "completed", 1, {"pid": 1, "token": 1})}, {"1": [{"pid": 1, "token": 1}]}
            ),
            [_ex("1", 0, 1, 1, 0.5, 0.6)],
        ),
    }

    async def fake_run(*_args: object, **_kwargs: object) -> dict[str, Any]:
        return failed

    monkeypatch.setattr(chaos, "run_chaos", fake_run)
    out = tmp_path / "chaos.json"

    # When the command runs
    result = CliRunner().invoke(app, ["bench", "chaos", "--json", str(out)], env={"COLUMNS": "200"})

    # Then it says so and exits 1, with the JSON and the plot written
    assert result.exit_code == 1, result.output
    assert "FAILED" in result.output and "chaos check failed" in result.output
    assert json.loads(out.read_text())["check"]["counts"]["lost"] == 1
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
