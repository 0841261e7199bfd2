"""The dispatch lab: the same workload under three budget gates, and checks of every claim.

One mode runs on a queue of its own:

1. set the shared controls: global concurrency 4, at most 4 starts per 1,000 ms;
2. load phase: enqueue 24 jobs of 100 tokens (16 at priority 10 first, then 8
   at priority 1; simulated latency 40/60/80 ms by index % 3) against a budget
   of 2,400, and only then start two worker processes (worker-a, worker-b,
   3 jobs at once each). The first call of one job meets a provider 429 with
   retry-after 500 ms;
3. race phase: 4 jobs of 100 tokens against a budget of 200, all four held at
   a barrier until each has read the balance (naive) or is about to reserve
   (atomic);
4. overuse phase: the rate limit is lifted (the concurrency ceiling stays),
   and 16 jobs that estimate 100 tokens but whose calls use 150 run against a
   budget of 1,000. A budget can pass its limit by what the jobs running when
   it filled use beyond their estimates, so the real spend must stay within
   limit + C * (150 - 100), C the concurrency the lab allows (4), and the
   ledger's ``used`` must be that spend, to the token;
5. read back every job record and every span the handlers wrote, compute the
   figures and the checks (:mod:`sluice_lab.lab_checks`).

Nothing here trusts the engine's own counters for a check: starts, ends,
balances and the tokens spent come from the handlers (lab_worker.py) and the
records, so a gate that leaked, or a ledger that counted less than was
spent, would show. The report keeps the field names of the reference
lab (camelCase), so results compare across implementations.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sluice.engine.job import JobSpec
from sluice.engine.queue import Queue
from sluice.local.processes import worker_process
from sluice_lab.common import drop_queue
from sluice_lab.lab_checks import _report
from sluice_lab.lab_worker import ENV_URL, lab_key
from sluice_lab.lab_workload import Workload

if TYPE_CHECKING:
    from redis.asyncio import Redis

MODES = ("naive", "atomic", "admission")


WORKER_TARGET = "sluice_lab.lab_worker:worker"


Progress = Callable[[str, int, int], None]


async def run_mode(
    redis: Redis, url: str, mode: str, workload: Workload, progress: Progress | None = None
) -> dict[str, Any]:
    """Run one mode on a fresh queue and return its report (the queue is dropped after)."""
    if mode not in MODES:
        raise ValueError(f"unknown lab mode {mode!r}; use one of {', '.join(MODES)}")
    name = f"lab-{mode}-{secrets.token_hex(3)}"
    queue = Queue(name, redis=redis)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await _prepare(queue, mode, workload)
        load = await _enqueue(queue, mode, "load", workload)
        procs = _start_workers(url, name, workload)
        total = workload.total_jobs
        await _wait_finished(queue, load, lambda done: progress and progress(mode, done, total), procs)
        race = await _enqueue(queue, mode, "race", workload)
        await _wait_finished(
            queue, race, lambda done: progress and progress(mode, len(load) + done, total), procs
        )
        # The bound on overspend depends on how many jobs run at once, not on how
        # fast they start: without the rate limit the phase takes a fraction of a
        # second, and as many jobs as the ceiling allows are running when the
        # budget fills (the rate-limit check reads only the load and race phases).
        await queue.set_rate_limit(None)
        overuse = await _enqueue(queue, mode, "overuse", workload)
        before = len(load) + len(race)
        await _wait_finished(
            queue, overuse, lambda done: progress and progress(mode, before + done, total), procs
        )
        return await _report(queue, mode, workload, load, race, overuse)
    finally:
        _stop_workers(procs)
        await drop_queue(redis, name)
        await queue.close()


async def _prepare(queue: Queue, mode: str, w: Workload) -> None:
    await queue.set_global_concurrency(w.global_concurrency)
    await queue.set_rate_limit(w.rate_limit_max, per=w.rate_limit_ms / 1000)
    budgets = {"load": w.load_budget, "race": w.race_budget, "overuse": w.overuse_budget}
    for phase, limit in budgets.items():
        if mode == "naive":
            await queue.redis.set(lab_key(queue.name, f"naive:{phase}"), limit)
        else:
            await queue.budgets.create(f"lab-{phase}", limit)


async def _enqueue(queue: Queue, mode: str, phase: str, w: Workload) -> list[tuple[str, int, int]]:
    """Add one phase's jobs; returns (job id, index, priority) in the order added."""
    if phase == "load":
        low = w.load_jobs - w.high_priority_jobs
        plan = [(i, 10) for i in range(low)] + [(i, 1) for i in range(low, w.load_jobs)]
    elif phase == "race":
        plan = [(i, 5) for i in range(w.race_jobs)]
    else:
        plan = [(i, 5) for i in range(w.overuse_jobs)]
    specs = []
    for index, priority in plan:
        payload = {
            "mode": mode,
            "phase": phase,
            "index": index,
            "tokens": w.tokens_per_job,
            "usage": w.overuse_usage if phase == "overuse" else w.tokens_per_job,
            "latency_ms": w.latencies_ms[index % len(w.latencies_ms)],
            "budget": f"lab-{phase}",
            # The admission race needs no barrier: the jobs that do not fit never start.
            "barrier": w.race_jobs if phase == "race" and mode != "admission" else 0,
            "throttle": phase == "load" and index == w.throttled_index,
        }
        extra: dict[str, Any] = {}
        if mode == "admission":
            extra = {"tokens": w.tokens_per_job, "budget": f"lab-{phase}", "on_exhausted": "reject"}
        specs.append(JobSpec("llm_call", payload, priority=priority, max_attempts=1, **extra))
    jobs = await queue.add_bulk(specs)
    return [(job.id, index, priority) for job, (index, priority) in zip(jobs, plan, strict=True)]


def _start_workers(url: str, queue: str, w: Workload) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, ENV_URL: url, "SLUICE_LOG_LEVEL": "warning"}
    return [
        worker_process(url, queue, w.local_concurrency, wid, WORKER_TARGET, env=env, stderr=subprocess.PIPE)
        for wid in w.worker_ids
    ]


def _stop_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


async def _wait_finished(
    queue: Queue,
    jobs: list[tuple[str, int, int]],
    on_progress: Callable[[int], Any],
    procs: list[subprocess.Popen[bytes]],
    timeout: float = 120.0,
) -> None:
    deadline = time.monotonic() + timeout
    ids = [job_id for job_id, _, _ in jobs]
    while True:
        states = [await queue.job_state(i) for i in ids]
        done = sum(1 for s in states if s is not None and s.finished)
        on_progress(done)
        if done == len(ids):
            return
        for p in procs:
            if p.poll() is not None:
                err = p.stderr.read().decode(errors="replace")[-2000:] if p.stderr else ""
                raise RuntimeError(f"a lab worker exited (code {p.returncode}):\n{err}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"lab jobs did not finish in {timeout:g}s: states {states}")
        await asyncio.sleep(0.05)
