"""Memory: Redis stays flat under a steady load once retention trims what has finished.

A queue that keeps every finished job grows until Redis runs out of memory;
one with retention (``queue.set_retention``) should level off at what the
retention window holds and stay there however long the load goes on. This
benchmark shows which: it adds jobs at a steady ``rate`` for ``seconds``
through real worker processes (``sluice worker sluice_lab.memory:worker``),
with the parts of a real LLM workload that leave state behind:

* every job names a rolling budget (``tokens`` each; the window's log holds
  one entry per reservation) large enough to admit the rate, and a share
  of them report their usage through the handler's context (the
  reservation is settled to it);
* a share fails with :class:`~sluice.PermanentError` (dead-lettered at once),
  a share is cancelled while delayed, and a share names a budget of 0
  tokens and ends ``rejected``, so every retention kind holds records.

Every ``sample_interval`` seconds it reads ``INFO memory`` (``used_memory``:
what Redis allocated, which is what an out-of-memory limit compares) and the
records each kind retains (the sizes of its finished index: ``finished:<kind>``,
the dead set for dead jobs). At the end it measures what one retained job
costs (:func:`measure_retained_bytes`) and judges the plateau (:func:`plateau`):
the least-squares growth of ``used_memory`` over the last half of the run.

The threshold is relative to what retention saves: keeping every job would
grow Redis by ``rate * 60 * bytes_per_retained_job`` bytes a minute, and the
run is flat when the plateau grows by less than ``flat_share`` of that (5 %
by default). A leak of a small record per job (a reservation, an
idempotency key, an index entry that is never trimmed) shows as a growth of
10-30 % of it.

Besides retention, two structures hold a bounded amount that the run must
fill before the plateau means anything: the events stream (capped at
``events_maxlen``; about 3 events per job, so the default 10,000 fills in
half a minute at 100 jobs/s) and the budget's rolling window (one entry per
reservation for ``budget_window`` seconds). The plateau is the last half of
the run, so choose ``seconds`` at least twice the longest of the retention
age, the budget window and the time to fill the stream.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engine.context import JobContext
from sluice.engine.job import JobSpec
from sluice.engine.queue import Queue
from sluice.engine.worker import Worker
from sluice.errors import PermanentError
from sluice.settings import DEFAULT_EVENTS_MAXLEN
from sluice_lab.common import drop_queue, new_queue_name
from sluice_lab.procs import WorkerGroup

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: The retention kinds, each with its own finished index.
KINDS = ("completed", "dead", "cancelled", "rejected")
#: The handler module the worker processes run (this one: see :data:`worker`).
WORKER_TARGET = "sluice_lab.memory:worker"
#: The budget every job spends from, and the one of 0 tokens the rejected share names.
BUDGET = "memory-bench"
STARVED_BUDGET = "memory-bench-starved"
#: Seconds between two adds: the rate is kept by adding what is due at each tick.
ADD_TICK_S = 0.1
#: How long a cancelled job is delayed (it is cancelled at once, long before it is due).
CANCEL_DELAY_S = 300.0
#: Bytes per retained job assumed for the threshold when no record could be measured.
FALLBACK_JOB_BYTES = 1000

#: Called with (seconds elapsed, the sample just taken) while the run goes on.
Progress = Callable[[float, dict[str, Any]], None]

#: The benchmark passes --queue and --concurrency; these are only defaults.
worker = Worker("bench-memory", concurrency=16, shutdown_grace=5.0)


@worker.handler
async def llm(job: JobContext) -> str:
    """A stand-in LLM call: wait ``work_ms``, then fail for good, or report usage, and answer.

    The payload says what to do (see :func:`job_mix`), so one worker serves
    every share of the workload and the mix is decided by the producer alone.
    """
    p: dict[str, Any] = job.payload
    await asyncio.sleep(p["work_ms"] / 1000)
    if p.get("fail"):
        raise PermanentError("the memory benchmark's permanent failure")
    usage = p.get("usage")
    if usage is not None:
        job.record_usage(int(usage))
    return "a" * int(p["result_bytes"])


@dataclass(frozen=True, slots=True)
class MemorySpec:
    """One memory run: the load, its mix, the retention and the verdict's threshold."""

    seconds: float = 600.0
    #: jobs added per second, evenly (every ADD_TICK_S)
    rate: float = 100.0
    #: age of every retention kind, seconds (None = no age limit)
    retain_seconds: float | None = 60.0
    #: most records kept per kind (None = no count limit)
    retain_count: int | None = None
    processes: int = 2
    concurrency: int = 16
    #: each job's token estimate, and the budget's rolling window (seconds)
    tokens: int = 50
    budget_window: float = 60.0
    #: seconds each job's handler takes
    work_ms: float = 5.0
    #: bytes of each job's prompt and of its result
    payload_bytes: int = 256
    result_bytes: int = 128
    #: shares of the jobs: reporting usage (of those that complete), failing
    #: permanently, cancelled while delayed, naming a budget of 0 tokens
    usage_share: float = 0.5
    fail_share: float = 0.01
    cancel_share: float = 0.01
    reject_share: float = 0.005
    #: the cap of the events stream (the producer's adds trim it to this)
    events_maxlen: int = DEFAULT_EVENTS_MAXLEN
    sample_interval: float = 1.0
    #: flat when the plateau grows by less than this share of what keeping every job would add
    flat_share: float = 0.05
    #: retained records per kind measured with MEMORY USAGE (completed; a fifth for the others)
    probe_jobs: int = 50
    seed: int = 1

    def __post_init__(self) -> None:
        shares = (self.usage_share, self.fail_share, self.cancel_share, self.reject_share, self.flat_share)
        if not all(0 <= s <= 1 for s in shares):
            raise ValueError("every share must be from 0 to 1")
        if self.fail_share + self.cancel_share + self.reject_share > 1:
            raise ValueError("the failing, cancelled and rejected shares add up to more than 1")
        if self.seconds <= 0 or self.rate <= 0 or self.sample_interval <= 0:
            raise ValueError("seconds, rate and the sample interval must be more than 0")
        if self.tokens < 1:
            raise ValueError("tokens must be at least 1 (the budget is what the run exercises)")
        if self.retain_seconds is not None and self.retain_seconds <= 0:
            raise ValueError("retain_seconds must be more than 0 (or None: no age limit)")

    @property
    def budget_limit(self) -> int:
        """Twice what the rate reserves in one window: the budget admits every job."""
        return math.ceil(2 * self.rate * self.tokens * self.budget_window)


@dataclass(frozen=True, slots=True)
class Planned:
    """One job of the mix, and how it should end."""

    spec: JobSpec
    ends: str
    cancel: bool = False


def job_mix(spec: MemorySpec) -> Iterator[Planned]:
    """The jobs in the order they are added, the same on every run with the same seed."""
    rng = random.Random(spec.seed)
    prompt = ("Summarize this support ticket in three bullet points. " * 64)[: spec.payload_bytes]
    base = {"prompt": prompt, "work_ms": spec.work_ms, "result_bytes": spec.result_bytes}
    while True:
        u = rng.random()
        if u < spec.fail_share:
            yield Planned(JobSpec("llm", {**base, "fail": True}, tokens=spec.tokens, budget=BUDGET), "dead")
        elif u < spec.fail_share + spec.cancel_share:
            job = JobSpec("llm", base, delay=CANCEL_DELAY_S, tokens=spec.tokens, budget=BUDGET)
            yield Planned(job, "cancelled", cancel=True)
        elif u < spec.fail_share + spec.cancel_share + spec.reject_share:
            yield Planned(JobSpec("llm", base, tokens=spec.tokens, budget=STARVED_BUDGET), "rejected")
        else:
            payload = dict(base)
            if rng.random() < spec.usage_share:
                payload["usage"] = rng.randint(spec.tokens // 2, spec.tokens)
            yield Planned(JobSpec("llm", payload, tokens=spec.tokens, budget=BUDGET), "completed")


def index_key(queue: Queue, kind: str) -> str:
    """The sorted set that indexes the records ``kind`` retains (dead jobs: the dead set)."""
    return queue.keys.dead if kind == "dead" else queue.keys.finished_prefix + kind


async def run_memory(
    redis: Redis,
    url: str,
    spec: MemorySpec,
    log_dir: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the load once on a fresh queue; the JSON-ready result (``meta`` is the caller's)."""
    info: Any = await redis.info("cluster")
    if int(info.get("cluster_enabled", 0)):
        raise ValueError("the memory benchmark measures one Redis server; give it a server, not a cluster")
    name = new_queue_name("memory")
    queue = Queue(name, redis=redis, events_maxlen=spec.events_maxlen)
    group = WorkerGroup(url, name, spec.concurrency, log_dir=log_dir, target=WORKER_TARGET)
    try:
        retention = await _configure(queue, spec)
        group.start(spec.processes)
        await _wait_for_workers(queue, group)
        out = await _measure(redis, queue, group, spec, progress)
        out["graceful_exit_s"] = group.stop()
    finally:
        if group.procs:
            group.stop()
        await queue.close()
        await drop_queue(redis, name)
    return {"spec": asdict(spec), "retention": retention, **out}


async def _configure(queue: Queue, spec: MemorySpec) -> dict[str, dict[str, float | int | None]]:
    """Retention for every kind, the budgets; returns the retention as the queue reads it back."""
    for kind in KINDS:
        await queue.set_retention(kind, age=spec.retain_seconds, count=spec.retain_count)
    await queue.budgets.create(BUDGET, spec.budget_limit, window=spec.budget_window)
    await queue.budgets.create(STARVED_BUDGET, 0)
    return {kind: {"age": r.age, "count": r.count} for kind, r in (await queue.retention()).items()}


async def _wait_for_workers(queue: Queue, group: WorkerGroup, timeout: float = 60.0) -> None:
    """Every worker process serves (its heartbeat is in) before the first job is added."""
    deadline = time.monotonic() + timeout
    while await queue.redis.hlen(queue.keys.workers) < len(group.ids):
        if group.exited():
            raise RuntimeError(f"a memory bench worker exited at start: {group.log_tail(group.exited()[0])}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the memory bench workers did not start within {timeout:g} s")
        await asyncio.sleep(0.05)


async def _measure(
    redis: Redis, queue: Queue, group: WorkerGroup, spec: MemorySpec, progress: Progress | None
) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    planned: dict[str, int] = dict.fromkeys(KINDS, 0)
    t0 = time.monotonic()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(_produce(queue, spec, t0, planned))
        tasks.create_task(_sample_until(redis, queue, spec, t0, samples, progress))
    per_job = await measure_retained_bytes(redis, queue, spec.probe_jobs)
    job_bytes = per_job["bytes_per_retained_job"] or FALLBACK_JOB_BYTES
    threshold = spec.flat_share * spec.rate * 60 * job_bytes
    counts = await _drained(queue)
    judged = verdict(samples, spec.seconds / 2, threshold)
    return {
        "flat": judged["flat"],
        "verdict": judged,
        "samples": samples,
        "planned": planned,
        "bytes_per_retained_job": per_job["bytes_per_retained_job"],
        "retained_bytes": per_job,
        "memory_vs_retained": memory_vs_retained(samples),
        "keep_everything_bytes_per_min": round(spec.rate * 60 * job_bytes),
        "plateau": plateau(samples, spec.seconds / 2),
        "engine_counts": counts,
        "warnings": _warnings(spec, group, planned, samples[-1]["backlog"]),
    }


async def _drained(queue: Queue, timeout: float = 10.0) -> dict[str, int]:
    """The engine's counters once the last jobs added have ended (or ``timeout`` passed).

    Only waiting and running jobs are waited for (the run's delayed jobs were
    cancelled as soon as they were added): those were added in its last moments.
    """
    deadline = time.monotonic() + timeout
    while True:
        counts = await queue.counts()
        if counts["waiting"] + counts["active"] == 0 or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.05)


async def _produce(queue: Queue, spec: MemorySpec, t0: float, planned: dict[str, int]) -> None:
    """Add what is due every ADD_TICK_S, on an absolute schedule (a slow add does not lower the rate)."""
    mix = job_mix(spec)
    added = 0
    tick = 0
    while True:
        elapsed = min(time.monotonic() - t0, spec.seconds)
        due = int(elapsed * spec.rate) - added
        if due > 0:
            batch = [next(mix) for _ in range(due)]
            jobs = await queue.add_bulk(p.spec for p in batch)
            for p, job in zip(batch, jobs, strict=True):
                planned[p.ends] += 1
                if p.cancel:
                    await job.cancel()
            added += due
        if elapsed >= spec.seconds:
            return
        tick += 1
        await asyncio.sleep(max(0.0, t0 + tick * ADD_TICK_S - time.monotonic()))


async def _sample_until(
    redis: Redis,
    queue: Queue,
    spec: MemorySpec,
    t0: float,
    samples: list[dict[str, Any]],
    progress: Progress | None,
) -> None:
    n = 0
    while True:
        elapsed = time.monotonic() - t0
        sample = await take_sample(redis, queue, round(elapsed, 3))
        samples.append(sample)
        if progress is not None:
            progress(elapsed, sample)
        if elapsed >= spec.seconds:
            return
        n += 1
        next_at = min(t0 + n * spec.sample_interval, t0 + spec.seconds)
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def take_sample(redis: Redis, queue: Queue, t: float) -> dict[str, Any]:
    """Redis's memory and what the queue holds, at ``t`` seconds into the run.

    ``used_memory`` is what the verdict uses; ``dataset`` (used_memory_dataset:
    the keys alone, without client buffers and Redis's own overhead) and
    ``rss`` (what the process holds from the OS) are there to explain it.
    ``keys`` is the whole database's (DBSIZE), other data included.

    ``retained`` is the size of each kind's index. A record expires at its
    kind's age exactly, but its index entry stays until a worker's next trim
    (the workers trim with their reaper, every 5 s with the default lease),
    so an index holds up to that many seconds of jobs more than the age.
    """
    memory: Any = await redis.info("memory")
    k = queue.keys
    async with redis.pipeline(transaction=False) as pipe:
        for kind in KINDS:
            pipe.zcard(index_key(queue, kind))
        pipe.xlen(k.events)
        pipe.zcard(k.budget_log_prefix + BUDGET)
        pipe.dbsize()
        *retained, events, window_log, keys = await pipe.execute()
    counts = await queue.counts()
    return {
        "t": t,
        "used_memory": int(memory["used_memory"]),
        "dataset": int(memory.get("used_memory_dataset", 0)),
        "rss": int(memory.get("used_memory_rss", 0)),
        "retained": dict(zip(KINDS, (int(r) for r in retained), strict=True)),
        "completed": counts["completed"],
        "added": counts["added"],
        "backlog": counts["waiting"] + counts["active"] + counts["delayed"] + counts["parked"],
        "events": int(events),
        "window_log": int(window_log),
        "keys": int(keys),
    }


async def measure_retained_bytes(redis: Redis, queue: Queue, probe_jobs: int) -> dict[str, Any]:
    """What one retained job costs Redis, measured with ``MEMORY USAGE ... SAMPLES 0``.

    Per kind, up to ``probe_jobs`` retained records (a fifth as many for the
    kinds other than completed), spread evenly over the kind's index: the
    job's hash, the reservation record its last attempt left
    (``resv:<rid>``; none for a job rejected or cancelled before it ran), and
    its share of the index (the index's MEMORY USAGE over its size). This
    is what retention frees per job, the figure the verdict's threshold is
    built on; the budget window's log entries and the events stream are
    bounded by their own limits and not counted. ``bytes_per_retained_job``
    is the mean over the kinds, weighted by how many records each retains.
    """
    k = queue.keys
    kinds: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        index = index_key(queue, kind)
        retained = int(await redis.zcard(index))
        want = min(retained, probe_jobs if kind == "completed" else max(1, probe_jobs // 5))
        entry: dict[str, Any] = {"retained": retained, "sampled": 0, "job_hash": None}
        entry.update(reservation=None, index_entry=None, total=None)
        kinds[kind] = entry
        if not want:
            continue
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(want):
                pipe.zrange(index, i * retained // want, i * retained // want)
            picked: list[list[bytes]] = await pipe.execute()
        ids = [r[0].decode() for r in picked if r]
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.memory_usage(k.job(job_id), samples=0)
                pipe.hget(k.job(job_id), "rid")
            raw = await pipe.execute()
        found = [(raw[2 * i], raw[2 * i + 1]) for i in range(len(ids)) if raw[2 * i] is not None]
        async with redis.pipeline(transaction=False) as pipe:
            for _, rid in found:
                if rid:
                    pipe.memory_usage(k.reservation_prefix + rid.decode(), samples=0)
            resv = [int(b or 0) for b in await pipe.execute()] if any(r for _, r in found) else []
        index_bytes = int(await redis.memory_usage(index, samples=0) or 0)
        if not found:
            continue
        job_hash = statistics.fmean(int(b) for b, _ in found)
        reservation = sum(resv) / len(found)
        index_entry = index_bytes / max(1, retained)
        entry.update(
            sampled=len(found),
            job_hash=round(job_hash, 1),
            reservation=round(reservation, 1),
            index_entry=round(index_entry, 1),
            total=round(job_hash + reservation + index_entry, 1),
        )
    weighted = [(e["retained"], e["total"]) for e in kinds.values() if e["total"] is not None]
    weight = sum(n for n, _ in weighted)
    overall = round(sum(n * t for n, t in weighted) / weight, 1) if weight else None
    return {"method": "MEMORY USAGE SAMPLES 0", "bytes_per_retained_job": overall, "kinds": kinds}


def memory_vs_retained(samples: list[dict[str, Any]]) -> dict[str, float | None]:
    """The least-squares slope of ``used_memory`` over the records retained, across all samples.

    A second, whole-server estimate of bytes per retained job: it charges
    each record with everything that grew alongside it while retention was
    filling (the budget window's log, the events stream, allocator overhead),
    so it is at least the MEMORY USAGE figure; ``r2`` says how well a line fits.
    """
    xs = [float(sum(s["retained"].values())) for s in samples]
    ys = [float(s["used_memory"]) for s in samples]
    if len(set(xs)) < 2:
        return {"bytes_per_retained_job": None, "r2": None}
    fit = statistics.linear_regression(xs, ys)
    r = statistics.correlation(xs, ys) if len(set(ys)) > 1 else 0.0
    return {"bytes_per_retained_job": round(fit.slope, 1), "r2": round(r * r, 3)}


def plateau(samples: list[dict[str, Any]], since_s: float) -> dict[str, Any]:
    """``used_memory`` from ``since_s`` on: min, max, mean, first, last and its least-squares growth."""
    pts = [(float(s["t"]), float(s["used_memory"])) for s in samples if s["t"] >= since_s]
    if len(pts) < 2:
        raise ValueError(f"the plateau needs at least 2 samples from {since_s:g} s on, got {len(pts)}")
    ts, ys = [t for t, _ in pts], [y for _, y in pts]
    slope = statistics.linear_regression(ts, ys).slope if len(set(ts)) > 1 else 0.0
    return {
        "since_s": since_s,
        "samples": len(pts),
        "min": int(min(ys)),
        "max": int(max(ys)),
        "mean": round(statistics.fmean(ys)),
        "first": int(ys[0]),
        "last": int(ys[-1]),
        "growth_per_min": round(slope * 60),
        "growth_over_plateau": round(slope * (ts[-1] - ts[0])),
    }


def verdict(samples: list[dict[str, Any]], since_s: float, threshold_per_min: float) -> dict[str, Any]:
    """Flat when the plateau's least-squares growth is at most ``threshold_per_min`` bytes a minute."""
    growth = plateau(samples, since_s)["growth_per_min"]
    return {
        "flat": growth <= threshold_per_min,
        "growth_per_min": growth,
        "threshold_per_min": round(threshold_per_min),
        "rule": "least-squares growth of used_memory over the last half <= flat_share x rate x 60 "
        "x bytes_per_retained_job (that share of what keeping every job would add a minute)",
    }


def _warnings(spec: MemorySpec, group: WorkerGroup, planned: dict[str, int], backlog: int) -> list[str]:
    out = []
    expected = int(spec.rate * spec.seconds)
    if sum(planned.values()) < expected:
        out.append(f"the producer added {sum(planned.values()):,} of {expected:,} jobs")
    if backlog > 2 * spec.rate:
        out.append(
            f"{backlog:,} jobs waiting, delayed or running at the end: the workers did not keep up, "
            "so memory grew with the backlog as well (more --processes or --concurrency)"
        )
    for wid in group.exited():
        out.append(f"worker {wid} exited during the run: {group.log_tail(wid)}")
    return out
