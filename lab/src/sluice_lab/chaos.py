"""``sluice bench chaos``: N jobs through a seeded schedule of faults, then a total-queue check.

The claim under test is the reference design's "zero job loss, verified
under chaos": every job a producer was told is accepted ends completed,
exactly one execution's commit is kept for it, and no late answer of a lost
lease is ever accepted, while

* workers are SIGKILLed mid-job (and replaced),
* workers are frozen (SIGSTOP) past their lease and thawed (SIGCONT), so
  that they answer late for jobs that others have run since (zombies),
* Redis itself is killed with SIGKILL and restarted on the same port from
  its append-only file (``appendfsync always``: what it answered, it kept),
* producers keep adding jobs through the outages, retrying each add with
  its idempotency key until it is accepted.

Everything runs on a Redis server of the run's own (it has to be killable)
and real worker processes (``sluice worker sluice_lab.chaos_worker:worker``).
The handlers keep a witness of every execution outside Redis
(:mod:`sluice_lab.chaos_worker`); :mod:`sluice_lab.chaos_check` holds the
producers' acceptances, Redis's records and the witnesses against each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engine.connection import connect
from sluice.engine.job import JobSpec
from sluice.engine.queue import Queue
from sluice.errors import OutcomeUnknown, RedisUnavailable
from sluice.local.embedded import EmbeddedRedis, RedisBinary
from sluice_lab.chaos_check import Fault, JobView, check, read_state, read_witness
from sluice_lab.chaos_plan import ChaosSpec, PlannedFault, plan_faults, work_ms
from sluice_lab.chaos_worker import EVENTS_MAXLEN, LEASE_S, WITNESS_PATTERN
from sluice_lab.common import machine_meta, new_queue_name
from sluice_lab.procs import WorkerGroup

if TYPE_CHECKING:
    from redis.asyncio import Redis

WORKER_TARGET = "sluice_lab.chaos_worker:worker"
JOB_NAME = "chaos_job"
#: A job may stall and run again this often before the queue gives up on it; a
#: chaos run must never be the reason a job is dead-lettered.
MAX_RUNS = 50
#: Seconds between two looks at the queue (progress, and whether it has drained).
POLL_S = 0.25
#: Seconds a kill or freeze waits, at most, for its worker to be running a job.
AIM_S = 2.0
#: Width of the timeline's bins, in seconds.
BIN_S = 0.25

#: Called with (jobs completed, what is happening now).
Progress = Callable[[int, str], None]


@dataclass(slots=True)
class _Run:
    """The moving parts of one run, shared by its producers, its faults and its watcher."""

    spec: ChaosSpec
    server: EmbeddedRedis
    group: WorkerGroup
    queue: Queue
    witness_dir: Path
    work: list[int]
    t0: float = 0.0
    #: worker slot -> index of its current process in the group
    slots: list[int] = field(default_factory=list)
    accepted: dict[int, str] = field(default_factory=dict)
    accepted_at: dict[int, float] = field(default_factory=dict)
    add_calls: int = 0
    add_errors: Counter[str] = field(default_factory=Counter)
    #: jobs whose add had been applied by a call that ended in OutcomeUnknown
    deduplicated: int = 0
    faults: list[Fault] = field(default_factory=list)
    redis_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    now_doing: str = "running"


async def run_chaos(
    spec: ChaosSpec,
    *,
    binary: RedisBinary | None = None,
    keep: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run ``spec`` and return every figure (JSON-ready); ``result["check"]["passed"]`` is the verdict.

    ``keep``: a folder for the run's Redis data, witness files and worker
    logs, left in place; without it they go to a temporary folder.
    """
    if keep is not None:
        await asyncio.to_thread(keep.mkdir, parents=True, exist_ok=True)
        return await _run_in(spec, keep, binary, progress)
    with tempfile.TemporaryDirectory(prefix="sluice-chaos-") as tmp:
        return await _run_in(spec, Path(tmp), binary, progress)


async def _run_in(
    spec: ChaosSpec, folder: Path, binary: RedisBinary | None, progress: Progress | None
) -> dict[str, Any]:
    for sub in ("redis", "witness", "logs"):
        (folder / sub).mkdir(exist_ok=True)
    server = EmbeddedRedis(
        folder / "redis", binary=binary, port=restartable_port(), persist=True, appendfsync="always"
    )
    await asyncio.to_thread(server.start)
    client = connect(server.url)
    name = new_queue_name("chaos")
    queue = Queue(name, redis=client, known_names={JOB_NAME}, events_maxlen=EVENTS_MAXLEN)
    group = WorkerGroup(server.url, name, spec.concurrency, log_dir=folder / "logs", target=WORKER_TARGET)
    run = _Run(spec, server, group, queue, folder / "witness", work_ms(spec))
    try:
        origin = f"embedded redis-server {server.binary.version} ({server.binary.origin}), appendfsync always"
        meta = await machine_meta(client, server.url, origin)
        return {"meta": meta, **await _drive(run, client, progress or (lambda _done, _what: None))}
    finally:
        for proc in group.procs:  # a frozen worker would ignore the SIGTERM below
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        await asyncio.to_thread(group.stop, 15.0)
        await queue.close()
        await client.aclose()
        await asyncio.to_thread(server.stop)


def restartable_port() -> int:
    """A free loopback port below the ephemeral range, where a restarted Redis can bind again.

    A port from ``bind(0)`` (what ``free_port`` returns) is ephemeral: while
    Redis is down, any program on the machine that asks for a free port, a
    test suite's next server for instance, may be given it, and the restart
    then fails with "address already in use". Ports below the range are
    never handed out that way.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(max(1024, low - 12_000), low), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low} for the chaos run's Redis")


async def _drive(run: _Run, client: Redis, progress: Progress) -> dict[str, Any]:
    spec = run.spec
    plan = plan_faults(spec)
    run.group.start(spec.workers)
    run.slots = list(range(spec.workers))
    await _until_workers_serve(run.queue, run.group)
    run.t0 = time.time()
    watching = asyncio.create_task(_watch(run, progress))
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_inject(run, plan.faults))
            for p in range(spec.producers):
                tasks.create_task(_produce(run, p))
        run.now_doing = "draining"
        drained = await _drain(run.queue, spec.drain_timeout)
    finally:
        watching.cancel()
    run.now_doing = "stopping workers"
    progress(len(run.accepted), run.now_doing)
    wids = list(run.group.ids)
    exit_s = await asyncio.to_thread(run.group.stop, 15.0)
    state = await read_state(client, run.queue)
    jobs = state.jobs
    witnessed = read_witness(run.witness_dir)
    verdict = check(run.accepted, state, witnessed.executions, run.faults, lease_s=LEASE_S)
    if not drained:
        verdict["passed"] = False
    finished = [v.finished for v in jobs.values() if v.finished is not None]
    end = max(finished, default=time.time())
    warnings = [f"skipped: {s}" for s in plan.skipped]
    if not drained:
        warnings.append(f"the queue still had work {spec.drain_timeout:g}s after the last add")
    if witnessed.bad_lines:
        warnings.append(f"{witnessed.bad_lines} witness line(s) did not parse")
    run_s = end - run.t0
    added_s = max(run.accepted_at.values(), default=run.t0) - run.t0
    return {
        "config": {**spec.as_dict(), "redis_version": run.server.binary.version, "queue": run.queue.name},
        "faults": [f.as_dict(run.t0) for f in sorted(run.faults, key=lambda f: f.start)],
        "faults_planned": [
            {"at_s": f.at, "kind": f.kind, "slot": f.slot, "hold_s": f.hold} for f in plan.faults
        ],
        "producers": {
            "add_calls": run.add_calls,
            "errors": dict(run.add_errors),
            "applied_before_outcome_unknown": run.deduplicated,
        },
        "timings": {
            "last_add_s": round(added_s, 3),
            "run_s": round(run_s, 3),
            "last_fault_ends_s": round(max((f.end for f in run.faults), default=run.t0) - run.t0, 3),
            "drain_after_last_add_s": round(end - run.t0 - added_s, 3),
            "jobs_per_s": round(len(run.accepted) / run_s, 1) if run_s > 0 else None,
            "workers_exit_s": exit_s,
        },
        "engine_counts": state.stats,
        "refusals_logged": sum(run.group.log_tail(w, 10**9).count("outcome refused") for w in wids),
        "check": verdict,
        "timeline": _timeline(run, jobs, witnessed.executions, end),
        "warnings": warnings,
    }


async def _until_workers_serve(queue: Queue, group: WorkerGroup, timeout: float = 60.0) -> None:
    """Wait until every worker has sent its first heartbeat: a fault must hit a serving worker."""
    deadline = time.monotonic() + timeout
    while len(await queue.workers()) < len(group.ids):
        if exited := group.exited():
            tails = "; ".join(f"{w}: {group.log_tail(w, 500).strip()}" for w in exited)
            raise RuntimeError(f"chaos worker(s) exited at start: {tails}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {len(group.ids)} chaos workers started within {timeout:g}s")
        await asyncio.sleep(0.1)


async def _produce(run: _Run, producer: int) -> None:
    """Add this producer's share of the jobs at an even pace, in batches, until each is accepted."""
    spec = run.spec
    mine = list(range(producer, spec.jobs, spec.producers))
    pace = spec.duration / spec.jobs
    i = 0
    while i < len(mine):
        due = run.t0 + mine[i] * pace
        await asyncio.sleep(max(0.0, due - time.time()))
        now = time.time()
        batch = [n for n in mine[i : i + spec.batch] if run.t0 + n * pace <= now] or [mine[i]]
        await _add_until_accepted(run, batch)
        i += len(batch)


async def _add_until_accepted(run: _Run, numbers: list[int]) -> None:
    """One add call for ``numbers``, repeated through any outage: the keys make a repeat harmless."""
    specs = [
        JobSpec(
            JOB_NAME,
            {"n": n, "ms": run.work[n], "dir": str(run.witness_dir)},
            idempotency_key=f"chaos-{n}",
            max_attempts=MAX_RUNS,
            max_stalls=MAX_RUNS,
        )
        for n in numbers
    ]
    failures = 0
    while True:
        run.add_calls += 1
        try:
            jobs = await run.queue.add_bulk(specs)
            break
        except OutcomeUnknown:
            run.add_errors["OutcomeUnknown"] += 1
        except RedisUnavailable:
            run.add_errors["RedisUnavailable"] += 1
        failures += 1
        await asyncio.sleep(min(0.5, 0.01 * 2**failures))
    now = time.time()
    for n, job in zip(numbers, jobs, strict=True):
        run.accepted[n] = job.id
        run.accepted_at[n] = now
        run.deduplicated += not job.created


async def _inject(run: _Run, faults: list[PlannedFault]) -> None:
    """Run every fault at its time (faults overlap: a freeze lasts while others happen)."""
    await asyncio.gather(*(_fault(run, f) for f in faults))


async def _fault(run: _Run, planned: PlannedFault) -> None:
    await asyncio.sleep(max(0.0, run.t0 + planned.at - time.time()))
    group = run.group
    if planned.kind == "redis":
        async with run.redis_lock:  # the plan spaces them; this makes sure
            start = time.time()
            run.now_doing = "Redis down"
            await asyncio.to_thread(run.server.kill)
            await asyncio.sleep(planned.hold)
            await asyncio.to_thread(run.server.start, 60.0)
            end = time.time()
            run.now_doing = "running"
            run.faults.append(Fault("redis", start, end, note=f"down {end - start:.2f}s"))
        return
    assert planned.slot is not None
    index = run.slots[planned.slot]
    proc, wid = group.procs[index], group.ids[index]
    running = await _aim(run.witness_dir, proc.pid)
    start = time.time()
    if planned.kind == "kill":
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        group.start(1)
        run.slots[planned.slot] = len(group.procs) - 1
        note = f"running {running} job(s); replaced by {group.ids[-1]}"
        run.faults.append(Fault("kill", start, start, planned.slot, proc.pid, wid, note))
        return
    proc.send_signal(signal.SIGSTOP)
    await asyncio.sleep(planned.hold)
    proc.send_signal(signal.SIGCONT)
    note = f"running {running} job(s)"
    run.faults.append(Fault("freeze", start, time.time(), planned.slot, proc.pid, wid, note))


async def _aim(witness_dir: Path, pid: int) -> int:
    """Wait (up to AIM_S) until the process runs a job, so the fault has something to break.

    Its witness file tells: a start without an end is a job running now.
    Returns how many run (0: the worker stayed idle, and is hit anyway).
    """
    path = witness_dir / WITNESS_PATTERN.format(pid=pid)
    deadline = time.monotonic() + AIM_S
    while True:
        running = await asyncio.to_thread(_running_in, path)
        if running or time.monotonic() > deadline:
            return running
        await asyncio.sleep(0.01)


def _running_in(path: Path) -> int:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    return data.count(b'{"ev":"start"') - data.count(b'{"ev":"end"')


async def _watch(run: _Run, progress: Progress) -> None:
    """Report progress until cancelled; a Redis outage only skips a reading."""
    done = 0
    while True:
        with contextlib.suppress(RedisUnavailable):
            done = (await run.queue.counts())["completed"]
        progress(done, run.now_doing)
        await asyncio.sleep(POLL_S)


async def _drain(queue: Queue, timeout: float) -> bool:
    """Wait until no job waits, runs or is due (a leased job whose lease is lost counts as running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c = await queue.counts()
            if c["waiting"] + c["delayed"] + c["active"] + c["parked"] == 0:
                return True
        except RedisUnavailable:
            pass
        await asyncio.sleep(POLL_S)
    return False


def _timeline(run: _Run, jobs: dict[str, JobView], executions: list[Any], end: float) -> dict[str, Any]:
    """Cumulative jobs added, executions started and jobs completed per bin, for the plot."""
    bins = int((end - run.t0) / BIN_S) + 2

    def cumulative(times: list[float]) -> list[int]:
        counts = [0] * bins
        for t in times:
            counts[min(bins - 1, max(0, int((t - run.t0) / BIN_S)))] += 1
        total, out = 0, []
        for c in counts:
            total += c
            out.append(total)
        return out

    return {
        "bin_s": BIN_S,
        "added": cumulative(list(run.accepted_at.values())),
        "started": cumulative([ex.start for ex in executions]),
        "completed": cumulative([v.finished for v in jobs.values() if v.finished is not None]),
    }
