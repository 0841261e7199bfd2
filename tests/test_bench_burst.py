"""``sluice bench burst``, small: the command runs end to end and its figures agree with each other.

Whether a drain is fast is the benchmark's verdict on a quiet machine, never a
test's: this checks only that every job ran once, that the latency sketch
counted each of them, and that depth and drain time are plausible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.lab.burst import summarize


@pytest.mark.slow
def test_a_small_burst_drains_every_job_once_and_the_figures_agree(tmp_path: Path) -> None:
    # Given no Redis URL, the bench starts a throw-away embedded server of its own
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}
    env["COLUMNS"] = "200"
    out = tmp_path / "burst.json"
    # When 100 jobs arrive at once on one serving worker process, twice
    argv = ["bench", "burst", "--jobs", "100", "-p", "1", "-c", "10", "--reps", "2", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "sluice", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no burst mode" in proc.stdout  # the caption says why there is no BullMQ column
    data = json.loads(out.read_text())
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
