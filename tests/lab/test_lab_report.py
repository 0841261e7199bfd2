"""The lab renderer: terminal tables, the one-file HTML report, and the report without matplotlib.

The results are synthetic but shaped like a real run of the lab's fixed
workload (24 load jobs at 4 starts per second on two workers, then a race of
4 jobs against a 200-token budget, then 16 jobs estimating 100 tokens that
use 150 against a 1,000-token budget), with percentiles computed from the jobs.
"""

from __future__ import annotations

import base64
import html
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

from sluice_lab.lab_report import lab_table, throttle_table, write_report
from sluice_lab.stats import percentile

T0 = 1_767_225_600_000.0  # unix ms
HOSTILE = '<script>alert("$\\bogus$")</script>'
WORKLOAD = {
    "loadJobs": 24,
    "workerProcesses": 2,
    "globalConcurrency": 4,
    "rateLimitMax": 4,
    "rateLimitDurationMs": 1000,
    "localConcurrency": 3,
    "raceJobs": 4,
    "tokensPerJob": 100,
    "overuseJobs": 16,
    "overuseTokensUsed": 150,
}


def _job(
    job_id: str, phase: str, worker: str, priority: int, enqueued: float, started: float
) -> dict[str, Any]:
    completed = started + 120.0
    return {
        "jobId": job_id,
        "phase": phase,
        "workerId": worker,
        "priority": priority,
        "attempt": 1,
        "enqueuedAt": enqueued,
        "startedAt": started,
        "completedAt": completed,
        "queueWaitMs": started - enqueued,
        "serviceMs": completed - started,
        "endToEndMs": completed - enqueued,
        "tokenCost": 100,
        "reserved": True,
        "remainingBudget": None,
        "status": "completed",
    }


def _jobs(mode: str, workers: tuple[str, str]) -> list[dict[str, Any]]:
    """24 load jobs (16 at priority 10, then 8 at 1), 4 per second; then 4 race jobs at once;
    then 16 overuse jobs, 4 at a time (naive admits 10 of them, the others 8)."""
    jobs = []
    for i in range(24):
        enqueued = T0 + i * 2.0
        started = T0 + 60.0 + 1000.0 * (i // 4) + 7.0 * (i % 4)
        job = _job(f"load-{i:02d}", "load", workers[i % 2], 10 if i < 16 else 1, enqueued, started)
        job["remainingBudget"] = 2400 - 100 * (i + 1)
        jobs.append(job)
    admitted = 4 if mode == "naive" else 2
    for i in range(4):
        job = _job(f"race-{i}", "race", workers[i % 2], 5, T0 + 6200.0, T0 + 6210.0 + 3.0 * i)
        job["remainingBudget"] = 100 if mode == "naive" else max(0, 100 - 100 * i)
        if i >= admitted:
            job.update(status="rejected", reserved=False, completedAt=job["startedAt"] + 1.0, serviceMs=None)
            job["endToEndMs"] = job["completedAt"] - job["enqueuedAt"]
        jobs.append(job)
    admitted = 10 if mode == "naive" else 8
    for i in range(16):
        job = _job(f"over-{i:02d}", "overuse", workers[i % 2], 5, T0 + 6500.0, T0 + 6510.0 + 130.0 * (i // 4))
        if i >= admitted:
            job.update(status="rejected", reserved=False, completedAt=job["startedAt"] + 1.0, serviceMs=None)
            job["endToEndMs"] = job["completedAt"] - job["enqueuedAt"]
        jobs.append(job)
    if mode == "admission":
        jobs[5]["attempt"] = 2  # the throttled job is one of the load jobs here
    return jobs


def _pcts(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {p: float(percentile(ordered, int(p[1:])) or 0.0) for p in ("p50", "p95", "p99")}


def _result(mode: str, workers: tuple[str, str] = ("worker-a", "worker-b")) -> dict[str, Any]:
    jobs = _jobs(mode, workers)
    done = [j for j in jobs if j["status"] == "completed"]
    naive = mode == "naive"
    race_budget = {
        "initial": 200,
        "remaining": 100 if naive else 0,
        "acceptedReservations": 4 if naive else 2,
        "rejectedReservations": 0 if naive else 2,
        "admittedTokens": 400 if naive else 200,
        "admittedUtilizationPct": 200.0 if naive else 100.0,
        "ledgerUtilizationPct": 50.0 if naive else 100.0,
    }
    spend = 1500 if naive else 1200
    overuse_budget = {
        "limit": 1000,
        "estimate": 100,
        "usage": 150,
        "concurrency": 4,
        "realSpend": spend,
        "overspend": spend - 1000,
        "bound": 1200,
        # the naive gate counts estimates only: the budget says "full, not overspent"
        "ledgerUsed": 1000 if naive else spend,
        "ledgerOverspent": 0 if naive else spend - 1000,
        "admittedJobs": 10 if naive else 8,
        "rejectedJobs": 6 if naive else 8,
        "maxConcurrent": 4,
    }
    throttled_at = T0 + 8000.0
    return {
        "mode": mode,
        "workload": dict(WORKLOAD),
        "metrics": {
            "throughputJobsPerSecond": {"naive": 4.31, "atomic": 4.12, "admission": 4.05}[mode],
            "maxConcurrent": 4,
            "minimumMsBetweenEveryFifthStart": 1003.25,
            "queueWaitMs": _pcts([j["queueWaitMs"] for j in done]),
            "processingMs": _pcts([j["serviceMs"] for j in done]),
            "endToEndMs": _pcts([j["endToEndMs"] for j in done]),
            "workerIds": list(workers),
        },
        "loadBudget": {
            "initial": 2400,
            "remaining": 0,
            "acceptedReservations": 24,
            "rejectedReservations": 0,
            "admittedTokens": 2400,
            "admittedUtilizationPct": 100.0,
            "ledgerUtilizationPct": 100.0,
        },
        "raceBudget": race_budget,
        "overuseBudget": overuse_budget,
        "checks": {
            "usedTwoWorkers": True,
            "priorityOrderEnforced": True,
            "sharedConcurrencyCeilingHeld": True,
            "globalRateLimitObserved": True,
            "atomicBudgetNeverOverspent": not naive,
            "raceOutcomeMatchedExpectation": True,
            "overuseWithinBound": not naive,
            "ledgerMatchesRealSpend": not naive,
            "allPassed": True,
        },
        "jobs": jobs,
        "throttle": {
            "jobId": "load-05" if mode == "admission" else "throttle-1",
            "retryAfterMs": 250,
            "throttledAt": throttled_at,
            "resumedAt": throttled_at + 262.5,
            "pausedMs": 262.5,
            "attempts": 2,
            "failures": 0,
            "status": "completed",
            "noFailureRecorded": mode != "atomic",
        },
    }


def lab_results(hostile_worker: bool = False) -> list[dict[str, Any]]:
    """naive, atomic, admission; naive overspends the race budget and the overuse bound (its ledger
    counting estimates only), atomic's throttle records a failure."""
    workers = (HOSTILE, "worker-b") if hostile_worker else ("worker-a", "worker-b")
    return [_result(mode, workers) for mode in ("naive", "atomic", "admission")]


def render(table: Table) -> str:
    console = Console(record=True, width=100, color_system=None)
    console.print(table)
    return console.export_text()


def cells(text: str, label: str) -> list[str]:
    """The cells right of ``label`` on the one table line that starts with it, left to right."""
    (line,) = [ln for ln in text.splitlines() if re.match(rf"[│┃|]\s*{re.escape(label)}\s+[│┃|]", ln)]
    return [c.strip() for c in re.split(r"[│┃|]", line)[2:-1]]


def marks(text: str, label: str) -> list[str]:
    """The ✓/✗/- marks on the one table line that starts with ``label``, left to right."""
    (line,) = [ln for ln in text.splitlines() if re.match(rf"[│┃|]?\s*{re.escape(label)}\s", ln)]
    return re.findall(r"[✓✗]|(?<=\s)-(?=\s)", line)


def test_lab_table_shows_modes_figures_and_checks() -> None:
    text = render(lab_table(lab_results()))

    header = next(ln for ln in text.splitlines() if "naive" in ln)
    assert header.index("naive") < header.index("atomic") < header.index("admission")
    assert "4.31" in text and "4.05" in text  # throughput
    assert "1,003.2" in text  # least ms between every 5th start
    assert "4 of 4" in text  # max concurrent against the global ceiling
    assert "400 (4 jobs)" in text and "200 (2 jobs)" in text  # race admitted tokens
    assert "200.0" in text and "50.0" in text  # naive: admitted vs ledger utilization
    assert "0 of 2,400" in text  # load budget spent
    assert marks(text, "budget never overspent") == ["✗", "✓", "✓"]
    assert marks(text, "overuse spend within bound") == ["✗", "✓", "✓"]
    assert marks(text, "ledger used = real spend") == ["✗", "✓", "✓"]
    assert marks(text, "all checks") == ["✓", "✓", "✓"]
    assert marks(text, "two workers used") == ["✓", "✓", "✓"]
    assert "…" not in text, "a cell was cut short at 100 columns"
    assert max(len(line) for line in text.splitlines()) <= 100


def test_lab_table_latency_rows_match_the_metrics() -> None:
    results = lab_results()
    results[1]["metrics"]["queueWaitMs"]["p99"] = 5432.1
    results[2]["checks"]["allPassed"] = False
    del results[2]["checks"]["usedTwoWorkers"]
    text = render(lab_table(results))

    (p99,) = [ln for ln in text.splitlines() if "queue wait p99 ms" in ln]
    assert "5,432.1" in p99
    assert marks(text, "all checks") == ["✓", "✓", "✗"]
    assert marks(text, "two workers used") == ["✓", "✓", "-"]


def test_lab_table_shows_the_overuse_phase() -> None:
    # Given a run whose admission mode spent past the bound and whose atomic ledger missed 150 tokens
    results = lab_results()
    over = results[2]["overuseBudget"]
    over.update(realSpend=1350, overspend=350, ledgerUsed=1350, ledgerOverspent=350, admittedJobs=9)
    results[2]["checks"].update(overuseWithinBound=False, allPassed=False)
    results[1]["overuseBudget"].update(ledgerUsed=1050, ledgerOverspent=50)
    results[1]["checks"].update(ledgerMatchesRealSpend=False, allPassed=False)

    text = render(lab_table(results))

    # Then each figure is in its mode's column, and the failed checks show
    assert cells(text, "overuse spend, tokens") == ["1,500 of 1,000", "1,200 of 1,000", "1,350 of 1,000"]
    assert cells(text, "overuse overspend") == ["500", "200", "350"]
    assert cells(text, "overuse bound") == ["1,200", "1,200", "1,200"]
    assert cells(text, "overuse ledger used") == ["1,000", "1,050", "1,350"]
    assert cells(text, "overuse ledger overspent") == ["0", "50", "350"]
    assert cells(text, "overuse admitted, jobs") == ["10", "8", "9"]
    assert marks(text, "overuse spend within bound") == ["✗", "✓", "✗"]
    assert marks(text, "ledger used = real spend") == ["✗", "✗", "✓"]
    assert marks(text, "all checks") == ["✓", "✗", "✗"]
    assert "bound = limit + 4 running at once x (150 - 100)" in " ".join(text.split())


def test_throttle_table() -> None:
    text = render(throttle_table(lab_results()))

    assert "throttle-1" in text and "load-05" in text
    (paused,) = [ln for ln in text.splitlines() if "paused ms" in ln]
    assert paused.count("262.5") == 3
    assert marks(text, "no failure recorded") == ["✓", "✗", "✓"]


def test_rich_markup_in_results_is_shown_not_parsed() -> None:
    results = lab_results()
    results[0]["metrics"]["workerIds"] = ["[bold]w[/]", "[/oops]"]
    text = render(lab_table(results))
    assert "[bold]w[/]" in text and "[/oops]" in text


def test_write_report_is_one_portable_file(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "lab"
    path = write_report(lab_results(hostile_worker=True), out)

    assert path == out / "lab-report.html"
    page = path.read_text(encoding="utf-8")
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3
    assert all(base64.b64decode(img).startswith(b"\x89PNG\r\n\x1a\n") for img in images)
    for mode in ("naive", "atomic", "admission"):
        assert f"<h3>{mode}</h3>" in page
    assert "<style>" in page and "<link" not in page and 'src="http' not in page
    assert "pip install sluice-lab" not in page  # charts are there, so no install hint


def test_write_report_escapes_what_it_is_given(tmp_path: Path) -> None:
    page = write_report(lab_results(hostile_worker=True), tmp_path).read_text(encoding="utf-8")

    assert "<script" not in page
    assert html.escape(HOSTILE) in page  # in the summary's workers row and the job tables
    # each mode's column of the workers row, and its 22 jobs on that worker (12 load, 2 race, 8 overuse)
    assert page.count(html.escape(HOSTILE)) == 3 + 3 * 22


def test_write_report_summary_has_figures_and_checks(tmp_path: Path) -> None:
    page = write_report(lab_results(), tmp_path).read_text(encoding="utf-8")

    (row,) = re.findall(r"<tr><td>budget never overspent</td>.*?</tr>", page)
    assert re.findall(r'class="(pass|fail)"', row) == ["fail", "pass", "pass"]
    assert "<td>400 (4 jobs)</td><td>200 (2 jobs)</td><td>200 (2 jobs)</td>" in page
    assert "16 at priority 10, then 8 at priority 1" in page
    assert "<summary>44 jobs</summary>" in page
    # the overuse phase: real spend against the limit, the bound, and what the ledger says
    (row,) = re.findall(r"<tr><td>overuse spend within bound</td>.*?</tr>", page)
    assert re.findall(r'class="(pass|fail)"', row) == ["fail", "pass", "pass"]
    (row,) = re.findall(r"<tr><td>ledger used = real spend</td>.*?</tr>", page)
    assert re.findall(r'class="(pass|fail)"', row) == ["fail", "pass", "pass"]
    assert "<td>1,500 of 1,000</td><td>1,200 of 1,000</td><td>1,200 of 1,000</td>" in page
    assert "<tr><td>overuse bound</td><td>1,200</td><td>1,200</td><td>1,200</td></tr>" in page
    assert "<tr><td>overuse ledger used</td><td>1,000</td><td>1,200</td><td>1,200</td></tr>" in page
    assert "<tr><td>overuse ledger overspent</td><td>0</td><td>200</td><td>200</td></tr>" in page
    assert "16 jobs estimating 100 tokens whose calls use 150 against a 1,000-token budget" in page


def test_write_report_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: matplotlib cannot be imported (None in sys.modules makes `import` raise ImportError)
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)

    # When
    page = write_report(lab_results(), tmp_path).read_text(encoding="utf-8")

    # Then: the tables are all there, with the way to get the charts
    assert "data:image/png" not in page and "<img" not in page
    assert html.escape("pip install sluice-lab") in page
    for mode in ("naive", "atomic", "admission"):
        assert f"<h3>{mode}</h3>" in page
    assert "queue wait p95 ms" in page


def test_charts_leave_no_pyplot_behind(tmp_path: Path) -> None:
    """A fresh interpreter: whether pyplot got imported is only meaningful before anyone else imports it."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from sluice_lab.lab_report import write_report\n"
        "from tests.lab.test_lab_report import lab_results\n"
        f"write_report(lab_results()[:1], Path({str(tmp_path)!r}))\n"
        "assert 'matplotlib.figure' in sys.modules\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "lab-report.html").exists()


def burst_result(peer: bool = True) -> dict[str, Any]:
    """A small ``sluice bench burst --json`` result: 500 jobs, Sluice and (optionally) BullMQ."""
    from sluice_lab.burst import summarize
    from sluice_lab.burst_peer import ratios

    def run(drain: float, p: float) -> dict[str, Any]:
        metric = {"count": 500, "p50": p, "p95": p * 2, "p99": p * 3, "max": p * 4}
        rows = [[float(ms), max(0, 400 - ms), 100, min(500, ms * 2)] for ms in range(0, 260, 10)]
        return {
            "jobs": 500,
            "processes": 2,
            "concurrency": 50,
            "drain_s": drain,
            "rate": 500 / drain,
            "peak_waiting": 400,
            "add_s": 0.05,
            "lost_or_unfinished": 0,
            "duplicates": 0,
            "latency": {"metrics": {m: metric for m in ("queue_wait", "processing", "end_to_end")}},
            "timeline": {"columns": ["ms", "waiting", "active", "done"], "rows": rows},
        }

    data: dict[str, Any] = {
        "meta": {"processes": 2, "concurrency": 50, "work_ms": 0, "reps": 1, "peers": "<b>note</b>"},
        "summary": summarize([run(0.3, 100.0)]),
        "runs": [run(0.3, 100.0)],
    }
    if peer:
        theirs = summarize([run(0.6, 200.0)])
        data["peer"] = {"name": "bullmq-node", "summary": theirs, "runs": [run(0.6, 200.0)]}
        data["ratios"] = ratios(data["summary"], theirs)
    return data


def test_write_report_shows_burst_results_with_their_charts(tmp_path: Path) -> None:
    import json

    from sluice_lab.burst import write_plot
    from sluice_lab.burst_report import find_bursts

    # Given a burst result with its PNG in the lab's output folder, and one given from elsewhere
    out = tmp_path / "lab"
    out.mkdir()
    inside = out / "burst-a.json"
    inside.write_text(json.dumps(burst_result()))
    write_plot(burst_result(), inside.with_suffix(".png"))
    elsewhere = tmp_path / "results" / "burst-b.json"
    elsewhere.parent.mkdir()
    elsewhere.write_text(json.dumps(burst_result(peer=False)))
    bursts = find_bursts(out, [elsewhere, inside])
    assert bursts == [elsewhere, inside]  # given first, each once

    # When the report is written
    page = write_report(lab_results(), out, bursts).read_text(encoding="utf-8")

    # Then it has a burst section with both files' figures, BullMQ's row and the ratios from the JSON
    assert "<h2>Burst: N jobs at once</h2>" in page
    assert "<h3>burst-a.json</h3>" in page and "<h3>burst-b.json</h3>" in page
    assert page.count("<td>Sluice</td><td>0.300</td><td>1,667</td><td>400</td><td>0/0</td>") == 2
    assert page.count("<td>BullMQ (Node)</td><td>0.600</td>") == 1  # burst-b ran Sluice alone
    assert "<td>Sluice / BullMQ</td><td>0.50x</td>" in page
    assert "<td>-/0.50x/0.50x</td>" in page
    # the chart embedded byte for byte, and links relative to the report
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="burst-a', page)
    assert [base64.b64decode(i) for i in images] == [inside.with_suffix(".png").read_bytes()]
    assert '<a href="burst-a.png">' in page and '<a href="../results/burst-b.json">' in page
    assert html.escape("<b>note</b>") in page and "<b>note</b>" not in page


def test_write_report_without_bursts_has_no_burst_section_and_says_why_a_file_is_not_shown(
    tmp_path: Path,
) -> None:
    from sluice_lab.burst_report import find_bursts

    assert find_bursts(tmp_path / "missing") == []
    page = write_report(lab_results(), tmp_path).read_text(encoding="utf-8")
    assert "Burst" not in page
    broken = tmp_path / "burst-broken.json"
    broken.write_text('{"runs": []}')
    page = write_report(lab_results(), tmp_path, find_bursts(tmp_path)).read_text(encoding="utf-8")
    assert '<h3>burst-broken.json</h3><p class="note">Not shown: no &#x27;summary&#x27; list' in page
