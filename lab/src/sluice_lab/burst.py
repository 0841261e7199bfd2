"""Burst: N jobs added at once to a queue that serving workers drain (ArQueue's case).

Unlike the throughput bench (jobs first, workers after), the workers here are
already serving when the burst arrives, as in production:

* W worker processes start on a fresh queue and the run waits for every one
  of them to heartbeat; then all N jobs are added with ``add_bulk``;
* a sampler reads ``queue.counts()`` and the jobs' own counter every
  :data:`SAMPLE_S` from just before the add until every job has counted
  itself: the peak waiting depth and the drain time (add to last completion,
  to within one sampling interval) come from these samples;
* the job sleeps ``work_ms`` (0: returns at once) and ``HINCRBY``\\ s a counter
  like the throughput bench's job, so a lost or twice-run job shows;
* after the drain, the latency percentiles are read from ``Queue.latency(60)``
  (the bins every worker flushes about once a second) until each metric
  counts all N jobs;
* "since the add": the time from the add call until the k-th job counted
  itself, read off the samples (:func:`since_add`), so to within a sampling
  interval and the same for any queue, whatever it stamps its jobs with.

The peer harness (bench-peers) has no burst mode, so the same burst on BullMQ
for Node is :mod:`sluice_lab.burst_peer`'s, run right after each of these on
the same Redis when BullMQ is installed; :func:`write_plot` draws both.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engine.connection import connect
from sluice.engine.context import JobContext
from sluice.engine.job import JobSpec
from sluice.engine.queue import Queue
from sluice.engine.sketch import METRICS
from sluice.engine.worker import Worker
from sluice_lab.common import drop_queue, new_queue_name
from sluice_lab.noop import ENV_DONE_KEY, ENV_URL
from sluice_lab.procs import WorkerGroup
from sluice_lab.stats import rate

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from redis.asyncio import Redis

#: Seconds between two samples of the queue's depth while it drains.
SAMPLE_S = 0.010
#: Seconds to wait after the last job for duplicates to show up.
SETTLE_S = 0.5
#: Seconds to wait for the workers' latency bins to hold every job (they flush about once a second).
LATENCY_WAIT_S = 10.0
#: The window the latency percentiles are read over.
LATENCY_WINDOW_S = 60.0

#: The handler module the burst's worker processes run.
WORKER_TARGET = "sluice_lab.burst:worker"
worker = Worker("bench-burst", concurrency=50, shutdown_grace=5.0)

_DONE_KEY = os.environ.get(ENV_DONE_KEY)
_clients: dict[int, Redis] = {}

Progress = Callable[[int], None]


def _client() -> Redis:
    loop_id = id(asyncio.get_running_loop())
    client = _clients.get(loop_id)
    if client is None:
        client = _clients[loop_id] = connect(os.environ[ENV_URL])
    return client


@worker.handler
async def burst(job: JobContext) -> int:
    """Sleep the payload's ``ms`` (if any), then count this run like the throughput bench's job."""
    payload = job.payload
    ms = payload.get("ms", 0) if isinstance(payload, dict) else 0
    if isinstance(ms, int | float) and ms > 0:
        await asyncio.sleep(ms / 1000)
    if _DONE_KEY:
        await _client().hincrby(_DONE_KEY, job.worker_id, 1)
    return 1


@dataclass(frozen=True, slots=True)
class BurstSpec:
    """One burst."""

    jobs: int = 500
    processes: int = 2
    concurrency: int = 50
    work_ms: float = 0.0
    #: seconds the drain may take
    timeout: float = 120.0


async def burst_once(
    redis: Redis, url: str, spec: BurstSpec, log_dir: Path | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Start the workers, add ``spec.jobs`` at once, measure the drain; the queue is dropped after."""
    name = new_queue_name("burst")
    queue = Queue(name, redis=redis)
    done_key = queue.keys.base + "bench-done"
    group = WorkerGroup(
        url,
        name,
        spec.concurrency,
        env={ENV_URL: url, ENV_DONE_KEY: done_key},
        log_dir=log_dir,
        target=WORKER_TARGET,
    )
    out: dict[str, Any] = {
        "jobs": spec.jobs,
        "processes": spec.processes,
        "concurrency": spec.concurrency,
        "work_ms": spec.work_ms,
    }
    try:
        group.start(spec.processes)
        out["workers_serving_after_s"] = await _until_serving(queue, group)
        out.update(await _burst(redis, queue, group, spec, done_key, progress))
        out["graceful_exit_s"] = group.stop()
    finally:
        if group.procs:
            group.stop()
        await queue.close()
        await drop_queue(redis, name)
    return out


async def _until_serving(queue: Queue, group: WorkerGroup, timeout: float = 60.0) -> float:
    """Wait until every worker has sent its first heartbeat; the seconds that took."""
    t0 = time.monotonic()
    while len(await queue.workers()) < len(group.ids):
        if exited := group.exited():
            tails = "; ".join(f"{w}: {group.log_tail(w, 500).strip()}" for w in exited)
            raise RuntimeError(f"burst worker(s) exited at start: {tails}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"fewer than {len(group.ids)} burst workers started within {timeout:g}s")
        await asyncio.sleep(0.05)
    return round(time.monotonic() - t0, 3)


async def _done(redis: Redis, done_key: str) -> dict[str, int]:
    raw: Any = await redis.hgetall(done_key)
    return {k.decode(): int(v) for k, v in raw.items()}


async def _burst(
    redis: Redis, queue: Queue, group: WorkerGroup, spec: BurstSpec, done_key: str, progress: Progress | None
) -> dict[str, Any]:
    n = spec.jobs
    samples: list[list[float]] = []  # [ms since the add began, waiting, active, done]
    stop = asyncio.Event()
    t0 = 0.0
    finished_at: float | None = None
    warnings: list[str] = []

    async def sample() -> None:
        nonlocal finished_at
        tick = time.perf_counter()
        while True:
            counts = await queue.counts()
            done = sum((await _done(redis, done_key)).values())
            now = time.perf_counter()
            samples.append([round((now - t0) * 1000, 2), counts["waiting"], counts["active"], done])
            if progress is not None:
                progress(done)
            if done >= n:
                finished_at = now
                return
            if stop.is_set():
                return
            tick += SAMPLE_S
            await asyncio.sleep(max(0.0, tick - time.perf_counter()))

    specs = [JobSpec("burst", {"ms": spec.work_ms} if spec.work_ms else None) for _ in range(n)]
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample())
    await queue.add_bulk(specs)
    added_s = time.perf_counter() - t0
    try:
        await asyncio.wait_for(asyncio.shield(sampler), spec.timeout)
    except TimeoutError:
        warnings.append(f"time limit of {spec.timeout} s reached before every job was done")
        stop.set()
        await sampler
    drain_s = finished_at - t0 if finished_at is not None else None
    await asyncio.sleep(SETTLE_S)
    final = await _done(redis, done_key)
    total = sum(final.values())
    latency, latency_wait_s = await _latency(queue, n)
    if any(latency["metrics"][m]["count"] != n for m in METRICS):
        warnings.append(f"latency counts {[latency['metrics'][m]['count'] for m in METRICS]} != {n} jobs")
    return {
        "complete": finished_at is not None,
        "add_s": round(added_s, 4),
        "drain_s": round(drain_s, 4) if drain_s is not None else None,
        "rate": rate(n, drain_s),
        "peak_waiting": max((int(s[1]) for s in samples), default=0),
        "peak_active": max((int(s[2]) for s in samples), default=0),
        "sample_interval_ms": SAMPLE_S * 1000,
        "samples": len(samples),
        "completed": total,
        "duplicates": max(0, total - n),
        "lost_or_unfinished": max(0, n - total),
        "per_worker": final,
        "latency": latency,
        "since_add": since_add(samples, n),
        "latency_flush_wait_s": latency_wait_s,
        "engine_counts": await queue.counts(),
        "timeline": {"columns": ["ms", "waiting", "active", "done"], "rows": samples},
        "warnings": warnings,
    }


async def _latency(queue: Queue, n: int) -> tuple[dict[str, Any], float]:
    """``Queue.latency`` once every metric counts ``n`` (or after :data:`LATENCY_WAIT_S`)."""
    t0 = time.monotonic()
    while True:
        window = (await queue.latency(LATENCY_WINDOW_S)).to_dict()
        counts = [window["metrics"][m]["count"] for m in METRICS]
        if all(c >= n for c in counts) or time.monotonic() - t0 > LATENCY_WAIT_S:
            return window, round(time.monotonic() - t0, 2)
        await asyncio.sleep(0.2)


def peer_note(versions: Mapping[str, str] | None, unavailable: str) -> str:
    """What the JSON and the table say about the BullMQ side: its versions, or why it did not run."""
    if versions is not None:
        pins = ", ".join(f"{pkg} {v}" for pkg, v in versions.items())
        return f"BullMQ for Node ({pins}) on the same Redis, right after each Sluice run"
    return f"Sluice alone, BullMQ not run: {unavailable}"


def since_add(rows: Sequence[Sequence[float]], n: int) -> dict[str, float | None]:
    """p50/p95/p99 of the time from the add call to each job's completion, from the samples.

    The q-quantile is the first sample (ms since the add) at which at least
    ``floor(q * (n - 1)) + 1`` jobs had counted themselves: the same rank as
    Sluice's sketch, late by at most one sampling interval. None: never reached.
    """
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99)):
        need = math.floor(q * (n - 1)) + 1
        out[name] = next((float(row[0]) for row in rows if row[3] >= need), None)
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per burst size over the repetitions, in first-seen order."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(r["jobs"], []).append(r)
    rows = []
    for jobs, rs in groups.items():
        row: dict[str, Any] = {"jobs": jobs, "runs": len(rs)}
        for key in ("drain_s", "rate", "peak_waiting", "add_s"):
            vals = sorted(r[key] for r in rs if r.get(key) is not None)
            row[key] = statistics.median(vals) if vals else None
            row[key + "_all"] = vals
        for metric in METRICS:
            row[metric] = {
                q: _median([r["latency"]["metrics"][metric][q] for r in rs]) for q in ("p50", "p95", "p99")
            }
            row[metric]["counts"] = [r["latency"]["metrics"][metric]["count"] for r in rs]
        row["since_add"] = {
            q: _median([(r.get("since_add") or {}).get(q) for r in rs]) for q in ("p50", "p95", "p99")
        }
        row["lost_max"] = max(r["lost_or_unfinished"] for r in rs)
        row["duplicates_max"] = max(r["duplicates"] for r in rs)
        rows.append(row)
    return rows


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


_SLUICE_COLOR = "#0969da"
_PEER_COLOR = "#cf222e"


def _draw_depth(ax: Any, runs: list[dict[str, Any]], color: str, label: str) -> None:
    for i, r in enumerate(runs):
        rows = r["timeline"]["rows"]
        ms = [row[0] for row in rows]
        first = i == 0
        ax.plot(
            ms,
            [row[1] for row in rows],
            color=color,
            lw=1.2,
            alpha=0.9,
            label=f"{label} waiting" if first else None,
        )
        ax.plot(
            ms,
            [row[2] for row in rows],
            color=color,
            lw=0.8,
            ls=":",
            label=f"{label} active" if first else None,
        )


def _draw_bars(ax: Any, mine: Mapping[str, Any], theirs: Mapping[str, Any], ratio: Mapping[str, Any]) -> None:
    """Drain time, end-to-end and since-the-add p95/p99 (medians), both queues, the ratio above each pair."""
    keys = [
        ("drain_s", ""),
        ("end_to_end", "p95"),
        ("end_to_end", "p99"),
        ("since_add", "p95"),
        ("since_add", "p99"),
    ]
    labels = ["drain", "end to end\np95", "end to end\np99", "since add\np95", "since add\np99"]

    def value(row: Mapping[str, Any], key: str, q: str) -> float:
        v = row[key] * 1000 if not q else (row.get(key) or {}).get(q)
        return float(v) if v is not None else 0.0

    sluice = [value(mine, k, q) for k, q in keys]
    peer = [value(theirs, k, q) for k, q in keys]
    factors = [ratio[k] if not q else (ratio.get(k) or {}).get(q) for k, q in keys]
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], sluice, width=0.4, color=_SLUICE_COLOR, label="Sluice")
    ax.bar([x + 0.2 for x in xs], peer, width=0.4, color=_PEER_COLOR, label="BullMQ (Node)")
    for x, a, b, f in zip(xs, sluice, peer, factors, strict=True):
        if f is not None:
            ax.annotate(
                f"{f:.2f}x",
                (x, max(a, b)),
                ha="center",
                va="bottom",
                fontsize=9,
                xytext=(0, 3),
                textcoords="offset points",
            )
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ms (median of runs)")
    ax.set_title("Sluice / BullMQ above each pair (under 1: Sluice less)", loc="left", fontsize=10)
    ax.set_ylim(0, max(*sluice, *peer) * 1.3)
    ax.grid(axis="y", color="#d0d7de", lw=0.6)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", fontsize=7, frameon=False, ncols=2)


def write_plot(data: Mapping[str, Any], path: Path) -> Path:
    """Waiting (solid) and active (dotted) depth over time per burst size; with BullMQ, both and the ratios.

    With a BullMQ side the figure has a second row: drain time and end-to-end
    p95/p99 of both queues as bars, each pair labelled with Sluice / BullMQ.
    """
    from sluice_lab.deps import require

    require("the burst plot", "matplotlib")
    from matplotlib.figure import Figure

    peer = data.get("peer")
    sizes = list(dict.fromkeys(r["jobs"] for r in data["runs"]))
    rows = 2 if peer else 1
    fig = Figure(figsize=(6.0 * len(sizes), 4.0 * rows), dpi=100, layout="constrained")
    axes = fig.subplots(rows, len(sizes), squeeze=False)
    summary = {r["jobs"]: r for r in data["summary"]}
    peer_summary = {r["jobs"]: r for r in peer["summary"]} if peer else {}
    ratios = {r["jobs"]: r for r in data.get("ratios", [])}
    for col, size in enumerate(sizes):
        ax = axes[0][col]
        mine = [r for r in data["runs"] if r["jobs"] == size]
        _draw_depth(ax, mine, _SLUICE_COLOR, "Sluice")
        if peer:
            _draw_depth(ax, [r for r in peer["runs"] if r["jobs"] == size], _PEER_COLOR, "BullMQ")
        ax.set_title(
            f"{size:,} jobs at once, {mine[0]['processes']} x c={mine[0]['concurrency']}, {len(mine)} run(s)",
            loc="left",
            fontsize=10,
        )
        ax.set_xlabel(f"ms since the add (sampled every {SAMPLE_S * 1000:g} ms)")
        ax.set_ylabel("jobs")
        ax.grid(color="#d0d7de", lw=0.6)
        ax.set_axisbelow(True)
        ax.legend(loc="upper right", fontsize=7, frameon=False)
        if peer:
            if size in peer_summary and size in ratios:
                _draw_bars(axes[1][col], summary[size], peer_summary[size], ratios[size])
            else:
                axes[1][col].set_axis_off()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", facecolor="white")
    return path
