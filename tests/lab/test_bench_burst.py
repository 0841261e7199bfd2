"""``sluice bench burst``, small: the command runs end to end and its figures agree with each other.

Whether a drain is fast is the benchmark's verdict on a quiet machine, never a
test's: this checks only that every job ran once, that the latency sketch
counted each of them, and that depth and drain time are plausible.

The BullMQ side needs Node and BullMQ installed outside the project (see
``burst_peer.install_hint``). Its real run is skipped, with the reason shown,
where they are missing; the error path that says how to install them is
tested everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.cli.app import app
from sluice_lab.burst import summarize
from sluice_lab.burst_peer import (
    PINNED,
    PeerFailed,
    PeerUnavailable,
    find_bullmq,
    parse_output,
    rank_quantiles,
    ratios,
    to_run,
)

METRICS = ("queue_wait", "processing", "end_to_end")


def _bullmq_missing() -> str | None:
    """Why the BullMQ side cannot run here (None: it can)."""
    try:
        find_bullmq()
    except PeerUnavailable as exc:
        return str(exc)
    return None


def _sluice(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    # Given no Redis URL, the bench starts a throw-away embedded server of its own
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}
    env["COLUMNS"] = "200"
    return subprocess.run(
        [sys.executable, "-m", "sluice", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_a_small_burst_drains_every_job_once_and_the_figures_agree(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    # When 100 jobs arrive at once on one serving worker process, twice, on Sluice alone
    proc = _sluice(
        *("bench", "burst", "--jobs", "100", "-p", "1", "-c", "10", "--reps", "2", "--peer", "none"),
        *("--json", str(out)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BullMQ not run: --peer none" in proc.stdout  # the caption says why there is no BullMQ row
    data = json.loads(out.read_text())
    assert "peer" not in data and "ratios" not in data
    assert len(data["runs"]) == 2
    for run in data["runs"]:
        # Then every job ran exactly once, by its own count
        assert run["complete"] and run["warnings"] == []
        assert (run["completed"], run["lost_or_unfinished"], run["duplicates"]) == (100, 0, 0)
        # and the latency sketch counted each job once per metric, in order p50 <= p95 <= p99
        for metric in ("queue_wait", "processing", "end_to_end"):
            m = run["latency"]["metrics"][metric]
            assert m["count"] == 100, (metric, m)
            assert m["p50"] is not None and m["p50"] <= m["p95"] <= m["p99"]
        assert run["drain_s"] > 0 and run["rate"] > 0
        assert 0 <= run["peak_waiting"] <= 100
        assert run["peak_active"] <= 10  # one process of concurrency 10
        assert run["timeline"]["rows"][-1][3] == 100
        assert run["sample_interval_ms"] == 10
    row = data["summary"][0]
    assert (row["jobs"], row["runs"], row["lost_max"], row["duplicates_max"]) == (100, 2, 0, 0)
    assert row["end_to_end"]["counts"] == [100, 100]
    assert out.with_suffix(".png").stat().st_size > 5_000


def test_the_summary_takes_medians_per_burst_size() -> None:
    def run(jobs: int, drain: float, p50: float) -> dict[str, object]:
        metric = {"count": jobs, "p50": p50, "p95": p50 * 2, "p99": p50 * 3, "max": p50 * 4}
        return {
            "jobs": jobs,
            "drain_s": drain,
            "rate": jobs / drain,
            "peak_waiting": jobs // 2,
            "add_s": 0.01,
            "lost_or_unfinished": 0,
            "duplicates": 0,
            "latency": {"metrics": {m: metric for m in ("queue_wait", "processing", "end_to_end")}},
        }

    rows = summarize([run(500, 1.0, 5.0), run(500, 3.0, 7.0), run(500, 2.0, 6.0), run(5000, 4.0, 9.0)])
    assert [(r["jobs"], r["runs"], r["drain_s"]) for r in rows] == [(500, 3, 2.0), (5000, 1, 4.0)]
    assert rows[0]["end_to_end"]["p50"] == 6.0 and rows[0]["end_to_end"]["counts"] == [500, 500, 500]


@pytest.mark.slow
@pytest.mark.skipif(
    _bullmq_missing() is not None, reason=f"BullMQ side not runnable here: {_bullmq_missing()}"
)
def test_the_same_burst_runs_on_bullmq_beside_sluice_and_the_ratios_come_from_both(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    # When 100 jobs arrive at once on one process of concurrency 10, on Sluice and then on BullMQ
    proc = _sluice(
        *("bench", "burst", "--jobs", "100", "-p", "1", "-c", "10", "--peer", "bullmq-node"),
        *("--json", str(out)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    peer = data["peer"]
    assert peer["name"] == "bullmq-node" and peer["versions"] == PINNED
    assert "BullMQ" in proc.stdout and "ratio" in proc.stdout
    (run,) = peer["runs"]
    # Then BullMQ's side, parsed from the Node runner, ran every job once, by the same counter
    assert run["complete"] and run["warnings"] == [], run["warnings"]
    assert (run["completed"], run["lost_or_unfinished"], run["duplicates"]) == (100, 0, 0)
    assert sum(run["per_worker"].values()) == 100 and len(run["per_worker"]) == 1
    assert run["engine_counts"]["completed"] == 100  # BullMQ's own count agrees
    # with one latency per job from BullMQ's stamps, end to end = wait + processing at the median's scale
    lat = run["latency"]["metrics"]
    for metric in METRICS:
        assert lat[metric]["count"] == 100
        assert 0 <= lat[metric]["p50"] <= lat[metric]["p95"] <= lat[metric]["p99"] <= lat[metric]["max"]
    assert lat["end_to_end"]["max"] <= run["drain_s"] * 1000 + 1_000  # stamped within the run
    assert run["peak_active"] <= 10 and 0 <= run["peak_waiting"] <= 100
    assert run["timeline"]["rows"][-1][3] == 100
    since = run["since_add"]
    assert (
        0 <= since["p50"] <= since["p95"] <= since["p99"] <= run["drain_s"] * 1000 + 0.1
    )  # drain_s is rounded
    # and each ratio is Sluice's median over BullMQ's
    (ratio,) = data["ratios"]
    mine, theirs = data["summary"][0], peer["summary"][0]
    assert ratio["drain_s"] == pytest.approx(mine["drain_s"] / theirs["drain_s"], abs=1e-3)
    if theirs["end_to_end"]["p99"] > 0:
        expected = mine["end_to_end"]["p99"] / theirs["end_to_end"]["p99"]
        assert ratio["end_to_end"]["p99"] == pytest.approx(expected, abs=1e-3)
    expected = mine["since_add"]["p95"] / theirs["since_add"]["p95"]
    assert ratio["since_add"]["p95"] == pytest.approx(expected, abs=1e-3)
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_without_bullmq_the_peer_option_says_how_to_install_it(tmp_path: Path) -> None:
    # Given a node_modules folder without bullmq
    empty = tmp_path / "node_modules"
    empty.mkdir()
    # When the burst is asked for the BullMQ side
    result = CliRunner().invoke(
        app,
        ["bench", "burst", "--peer", "bullmq-node", "--node-modules", str(empty)],
        env={"COLUMNS": "400"},
    )
    # Then it stops before any run and names the pinned install
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--peer bullmq-node" in text
    assert "npm install bullmq@6.7.0 ioredis@6.0.0" in text or "no 'node' on PATH" in text
    assert "Burst:" not in text  # nothing ran


def test_auto_without_bullmq_names_the_reason_and_a_given_url_off_loopback_is_refused() -> None:
    with pytest.raises(PeerUnavailable, match=r"npm install bullmq@6\.7\.0 ioredis@6\.0\.0"):
        find_bullmq(Path("/nonexistent/node_modules"))
    from sluice_lab.burst_peer import node_url

    assert node_url("redis://127.0.0.1:6390/0") == "redis://127.0.0.1:6390/0"
    with pytest.raises(PeerUnavailable, match="loopback"):
        node_url("unix:///tmp/redis.sock")
    with pytest.raises(PeerUnavailable, match="loopback"):
        node_url("redis://10.0.0.5:6379/0")


def test_the_node_result_line_is_parsed_and_a_missing_one_says_what_node_printed() -> None:
    line = json.dumps({"jobs": 3, "drain_s": 0.5, "durations_ms": {m: [3, 1, 2] for m in METRICS}})
    assert parse_output(f"ready\n@@BURST@@ {line}\n", "", 0)["jobs"] == 3
    with pytest.raises(PeerFailed, match=r"exit code 1\): Error: connect ECONNREFUSED"):
        parse_output("", "Error: connect ECONNREFUSED 127.0.0.1:1", 1)
    with pytest.raises(PeerFailed, match="broken result line"):
        parse_output("@@BURST@@ {not json", "", 0)


def test_bullmq_percentiles_are_exact_at_the_sketchs_rank() -> None:
    # 1..100 ms: rank floor(q * 99) of the sorted values, the rank Sluice's sketch reports
    values = list(range(100, 0, -1))
    assert rank_quantiles(values) == {"count": 100, "p50": 50.0, "p95": 95.0, "p99": 99.0, "max": 100.0}
    assert rank_quantiles([7]) == {"count": 1, "p50": 7.0, "p95": 7.0, "p99": 7.0, "max": 7.0}
    assert rank_quantiles([])["p99"] is None
    # A run missing stamps says so instead of passing for complete
    raw = {"jobs": 4, "drain_s": 0.2, "warnings": [], "durations_ms": {m: [1, 2, 3] for m in METRICS}}
    run = to_run(raw)
    assert run["rate"] == 20.0 and "durations_ms" not in run
    assert run["warnings"] == ["job stamps counted [3, 3, 3] != 4 jobs"]


def test_ratios_are_sluice_over_bullmq_per_burst_size() -> None:
    def row(jobs: int, drain: float, p95: float, p99: float) -> dict[str, object]:
        metric = {"p50": 1.0, "p95": p95, "p99": p99}
        return {"jobs": jobs, "drain_s": drain, **{m: metric for m in METRICS}}

    mine = [row(500, 0.3, 200.0, 240.0), row(5000, 2.0, 700.0, 800.0)]
    theirs = [row(500, 0.6, 400.0, 0.0)]
    (r,) = ratios(mine, theirs)  # 5000 has no BullMQ row: no ratio
    assert r["jobs"] == 500 and r["drain_s"] == 0.5
    assert r["end_to_end"] == {"p95": 0.5, "p99": None}  # no ratio to a zero
    assert r["since_add"] == {"p95": None, "p99": None}  # rows without it (older JSON): no ratio


def test_since_add_reads_the_first_sample_at_which_enough_jobs_were_done() -> None:
    from sluice_lab.burst import since_add

    # [ms since the add, waiting, active, done] for 100 jobs
    rows = [[0.0, 0, 0, 0], [10.0, 90, 10, 0], [20.0, 40, 10, 50], [30.0, 0, 5, 95], [40.0, 0, 0, 100]]
    # rank floor(q * 99) + 1 jobs: 50 for p50, 95 for p95, 99 for p99
    assert since_add(rows, 100) == {"p50": 20.0, "p95": 30.0, "p99": 40.0}
    assert since_add(rows[:3], 100) == {"p50": 20.0, "p95": None, "p99": None}  # never reached
