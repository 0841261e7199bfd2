"""Scale: what each script costs Redis when the queue is large, read from SLOWLOG.

Redis runs one script at a time and serves nobody meanwhile, so the figure
that matters is a script's own execution time, which Redis measures and
keeps in its SLOWLOG. The bench sets the log to record every command
(``slowlog-log-slower-than 0``), reads it every 0.1 s by entry id (nothing is
lost to a reset), and names each EVALSHA by the script it ran. Its phases,
each on a queue of its own, build the sizes a real deployment reaches:

* ``waiting``: N no-op jobs added at once and drained by worker processes,
  for each size asked (say 10k, 100k, 1M): the drain rate should be flat;
* ``delayed``: jobs that all fall due at once, promoted in capped steps;
* ``parked``: jobs on a full rolling budget (each parks), then a refund of
  a few tokens (only what fits may come back), then a top-up that lets all
  of them through in capped steps;
* ``token window``: a token-rate window filled with one entry per job, and
  the first dispatch after all of it has passed.

Per phase and script: calls, p50, p99 and worst (ms), with the drain rate.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.engine.job import JobSpec
from sluice.engine.queue import Queue
from sluice.engine.scripts import COMMANDS, source
from sluice_lab.common import drop_queue, new_queue_name
from sluice_lab.procs import WorkerGroup
from sluice_lab.stats import percentile, rate

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: The ceiling the issue sets for any one script call (ms).
TARGET_WORST_MS = 5.0
#: Completed jobs each phase keeps (so that trimming runs under the load, as in production).
RETAIN_COMPLETED = 10_000
#: SLOWLOG entries kept while the bench runs (it is read every 0.1 s, and emptied
#: when half full, so reads stay small).
MAX_LOG = 20_000


@dataclass
class ScaleSpec:
    """The sizes to build, and the workers that drain them."""

    waiting: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    delayed: int = 100_000
    parked: int = 100_000
    token_window: int = 60_000
    processes: int = 2
    concurrency: int = 50
    timeout: float = 900.0


@dataclass
class PhaseResult:
    """One phase: what it built, how fast it drained, and each script's times."""

    name: str
    size: int
    drain_s: float | None = None
    drain_rate: float | None = None
    scripts: dict[str, dict[str, float | int | None]] = field(default_factory=dict)


def script_names() -> dict[str, str]:
    """EVALSHA sha -> script name, as the engine loads them."""
    return {hashlib.sha1(source(name).encode()).hexdigest(): name for name in COMMANDS}  # noqa: S324


class SlowlogSampler:
    """Every command's execution time from SLOWLOG, grouped by script while it runs."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.names = script_names()
        self.times: dict[str, list[float]] = {}
        self._last_id = -1
        self._saved: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SlowlogSampler:
        saved: Any = await self.redis.config_get("slowlog-*")
        self._saved = dict(saved)
        await self.redis.config_set("slowlog-max-len", MAX_LOG)
        await self.redis.config_set("slowlog-log-slower-than", 0)
        await self.redis.slowlog_reset()
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.collect()
        for key, value in self._saved.items():
            await self.redis.config_set(key, value)

    def take(self) -> dict[str, list[float]]:
        """The times gathered since the last take (ms per script), and start afresh."""
        times, self.times = self.times, {}
        return times

    async def collect(self) -> None:
        # Only what is new since the last read: SLOWLOG GET of the whole log would
        # itself hold Redis for tens of ms (it keeps up to 100,000 entries here).
        count = 256
        while True:
            entries: list[dict[str, Any]] = await self.redis.slowlog_get(count)
            whole_log = len(entries) < count
            if whole_log or entries[-1]["id"] <= self._last_id + 1 or count >= MAX_LOG:
                break
            count *= 4
        if len(entries) >= MAX_LOG // 2:
            # Read now; emptied so the next read stays small (what Redis logs between
            # the two calls is lost: a few commands of many thousands).
            await self.redis.slowlog_reset()
        for entry in reversed(entries):  # oldest first
            if entry["id"] <= self._last_id:
                continue
            self._last_id = entry["id"]
            command = entry["command"]
            words = (command.decode(errors="replace") if isinstance(command, bytes) else str(command)).split()
            if len(words) < 2 or words[0].upper() not in ("EVALSHA", "EVAL"):
                continue
            name = self.names.get(words[1], "other script")
            self.times.setdefault(name, []).append(entry["duration"] / 1000)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            await self.collect()


def summarize(times: dict[str, list[float]]) -> dict[str, dict[str, float | int | None]]:
    out: dict[str, dict[str, float | int | None]] = {}
    for name, values in sorted(times.items()):
        values.sort()
        p50, p99 = percentile(values, 50), percentile(values, 99)
        out[name] = {
            "calls": len(values),
            "p50_ms": round(p50, 3) if p50 is not None else None,
            "p99_ms": round(p99, 3) if p99 is not None else None,
            "worst_ms": round(values[-1], 3),
        }
    return out


async def _wait_for(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"scale bench: {what} did not happen within {timeout:.0f}s")
        await asyncio.sleep(0.2)


async def _completed(queue: Queue) -> int:
    return (await queue.counts())["completed"]


async def _drain(queue: Queue, group: WorkerGroup, spec: ScaleSpec, n: int) -> float:
    """Start the workers and wait until ``n`` jobs of the queue completed; the seconds it took."""
    t0 = time.perf_counter()
    if not group.procs:
        group.start(spec.processes)

    async def done() -> bool:
        return await _completed(queue) >= n

    await _wait_for(done, spec.timeout, f"draining {n:,} jobs")
    return time.perf_counter() - t0


Phase = Callable[[Queue, WorkerGroup, ScaleSpec, PhaseResult], Awaitable[None]]


async def _waiting(q: Queue, g: WorkerGroup, spec: ScaleSpec, r: PhaseResult) -> None:
    await q.add_bulk(JobSpec("noop") for _ in range(r.size))
    r.drain_s = await _drain(q, g, spec, r.size)


async def _delayed(q: Queue, g: WorkerGroup, spec: ScaleSpec, r: PhaseResult) -> None:
    # Each is due 2 s after it is added; the workers start once the last is due,
    # so every one of them is due at once.
    await q.add_bulk(JobSpec("noop", delay=2.0) for _ in range(r.size))
    await asyncio.sleep(2.5)
    r.drain_s = await _drain(q, g, spec, r.size)


async def _parked(q: Queue, g: WorkerGroup, spec: ScaleSpec, r: PhaseResult) -> None:
    await q.budgets.create("scale", 1000, window=3600)
    await q.budgets.reserve("scale", 1000, "fill")
    await q.add_bulk(JobSpec("noop", tokens=1, budget="scale", on_exhausted="wait") for _ in range(r.size))
    g.start(spec.processes)

    async def all_parked() -> bool:
        return (await q.counts())["parked"] >= r.size

    await _wait_for(all_parked, spec.timeout, f"parking {r.size:,} jobs")
    # Ten tokens come back: only the ten jobs they admit may leave the parked set.
    await q.budgets.commit("fill", 990)
    await _wait_for(lambda: _at_least(q, 10), spec.timeout, "the jobs ten tokens admit")
    await asyncio.sleep(0.5)
    # Then a top-up lets every parked job through, in capped steps.
    t0 = time.perf_counter()
    await q.budgets.credit("scale", r.size)
    await _wait_for(lambda: _at_least(q, r.size), spec.timeout, "draining the parked jobs")
    r.drain_s = time.perf_counter() - t0


async def _token_window(q: Queue, g: WorkerGroup, spec: ScaleSpec, r: PhaseResult) -> None:
    window_s = 20.0
    await q.set_token_rate_limit(r.size, per=window_s)
    t0 = time.perf_counter()
    await q.add_bulk(JobSpec("noop", tokens=1) for _ in range(r.size))
    r.drain_s = await _drain(q, g, spec, r.size)
    # The window passes; the next dispatch finds all of it expired at once.
    await asyncio.sleep(max(0.0, window_s - (time.perf_counter() - t0)) + 0.5)
    await q.add_bulk(JobSpec("noop", tokens=1) for _ in range(100))
    await _wait_for(lambda: _at_least(q, r.size + 100), spec.timeout, "the jobs after the window")


async def run_scale(
    redis: Redis, url: str, spec: ScaleSpec, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run every phase, each on a fresh queue; the JSON-ready result."""
    plan: list[tuple[PhaseResult, Phase]] = [(PhaseResult("waiting", n), _waiting) for n in spec.waiting]
    if spec.delayed:
        plan.append((PhaseResult("delayed", spec.delayed), _delayed))
    if spec.parked:
        plan.append((PhaseResult("parked", spec.parked), _parked))
    if spec.token_window:
        plan.append((PhaseResult("token window", spec.token_window), _token_window))
    async with SlowlogSampler(redis) as slowlog:
        for result, body in plan:
            name = new_queue_name("scale")
            queue = Queue(name, redis=redis)
            # The workers' trim step runs all along, forgetting completed jobs past this
            # count as fast as they finish, as it would on a queue that has run for days.
            await queue.set_retention("completed", count=RETAIN_COMPLETED)
            group = WorkerGroup(url, name, spec.concurrency)
            if progress is not None:
                progress(f"{result.name}: {result.size:,} jobs")
            await slowlog.collect()
            slowlog.take()
            try:
                await body(queue, group, spec, result)
            finally:
                group.stop()
                await slowlog.collect()
                result.scripts = summarize(slowlog.take())
                await queue.close()
                await drop_queue(redis, name)
            if result.drain_s:
                result.drain_rate = rate(result.size, result.drain_s)
    phases = [r for r, _ in plan]
    worst = max((s["worst_ms"] or 0 for p in phases for s in p.scripts.values()), default=0.0)
    return {
        "spec": asdict(spec),
        "target_worst_ms": TARGET_WORST_MS,
        "worst_ms": worst,
        "phases": [asdict(p) for p in phases],
    }


async def _at_least(queue: Queue, n: int) -> bool:
    return await _completed(queue) >= n
