"""The total-queue check of a chaos run: what the producers were told, what Redis holds,
and what the witnesses saw, held against each other.

Three sources, none trusted alone:

* the producers' acceptances: idempotency key (job number) -> job id, each
  job accepted exactly once;
* Redis, after the run: every job's record (state, last lease token,
  result) and the queue's ``completed`` events, one per accepted commit,
  each carrying the result it stored;
* the witness files the handlers wrote outside Redis: one execution per
  (process, job, lease token), with its start and, unless the process died,
  its end.

:func:`read_state` and :func:`read_witness` gather the last two;
:func:`check` is a pure function of all three (and of the faults, to name
the cause of each re-execution), so a test can feed it a fabricated state
and see it report what is wrong.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from sluice.engine.codec import decode

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.queue import Queue

#: How many ids of each problem the report lists (the counts are complete).
SAMPLE = 20
#: Causes of re-executions, in the order the report shows them.
CAUSES = ("worker killed", "zombie (frozen past its lease)", "Redis restart", "unexplained")


@dataclass(frozen=True, slots=True)
class JobView:
    """What Redis holds about one job after the run (``state`` None: no record)."""

    id: str
    state: str | None
    #: the token of the job's last lease: the only one whose commit may be accepted
    token: int = 0
    #: the stored result, decoded: ``{"pid", "token", "n"}`` for a chaos job
    result: Any = None
    stalls: int = 0
    #: when it ended, wall-clock seconds (Redis's clock; the same host's as the witnesses')
    finished: float | None = None


@dataclass(slots=True)
class Execution:
    """One run of a handler, as its witness file tells it."""

    job: str
    n: int
    token: int
    pid: int
    worker: str
    attempt: int
    start: float
    end: float | None = None
    #: "returned", "cancelled", or None when the process died before the end
    status: str | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.token)


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault as it happened: wall-clock seconds (``time.time()``), the process it hit."""

    kind: str
    start: float
    end: float
    slot: int | None = None
    pid: int | None = None
    worker: str | None = None
    note: str = ""

    def as_dict(self, t0: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "at_s": round(self.start - t0, 3),
            "until_s": round(self.end - t0, 3),
        }
        for name in ("slot", "pid", "worker"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.note:
            out["note"] = self.note
        return out


@dataclass(slots=True)
class Witnessed:
    """Every execution the witness files describe, and any line that did not parse."""

    executions: list[Execution] = field(default_factory=list)
    bad_lines: int = 0


def read_witness(folder: Path) -> Witnessed:
    """Parse every ``witness-*.jsonl`` of ``folder`` into executions (start and end joined)."""
    out = Witnessed()
    by_key: dict[tuple[str, int, int], Execution] = {}
    for path in sorted(folder.glob("witness-*.jsonl")):
        for line in path.read_bytes().splitlines():
            try:
                rec = orjson.loads(line)
                key = (str(rec["job"]), int(rec["pid"]), int(rec["token"]))
                ex = by_key.get(key)
                if ex is None:
                    ex = by_key[key] = Execution(
                        key[0], int(rec["n"]), key[2], key[1], str(rec["worker"]), int(rec["attempt"]), 0.0
                    )
                    out.executions.append(ex)
                if rec["ev"] == "start":
                    ex.start = float(rec["t"])
                else:
                    ex.end, ex.status = float(rec["t"]), str(rec["status"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                out.bad_lines += 1
    return out


@dataclass(slots=True)
class RedisState:
    """What Redis holds about a run's queue once it is over."""

    #: every job record, by id
    jobs: dict[str, JobView] = field(default_factory=dict)
    #: per job, the result each accepted commit stored (its 'completed' events, in order)
    commits: dict[str, list[Any]] = field(default_factory=dict)
    #: per job, the names of its lifecycle events, in order (empty: not read)
    lifecycle: dict[str, list[str]] = field(default_factory=dict)
    #: the queue's counters
    stats: dict[str, int] = field(default_factory=dict)


async def read_state(redis: Redis, queue: Queue) -> RedisState:
    """Every job record, every lifecycle event (commits among them), and the counters."""
    k = queue.keys
    state = RedisState()
    ids = [
        key.decode()[len(k.job_prefix) :]
        async for key in redis.scan_iter(match=k.job_prefix + "*", count=1000)
    ]
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in chunk:
                pipe.hmget(k.job(job_id), "state", "token", "result", "stalls", "finished")
            rows = await pipe.execute()
        for job_id, (status, token, result, stalls, finished) in zip(chunk, rows, strict=True):
            state.jobs[job_id] = JobView(
                job_id,
                status.decode() if status else None,
                int(token or 0),
                decode(result) if result is not None else None,
                int(stalls or 0),
                int(finished) / 1000 if finished else None,
            )
    after = "-"
    while True:
        entries: Any = await redis.xrange(k.events, after, "+", count=10_000)
        if not entries:
            break
        for _, fields in entries:
            job_id, event = fields.get(b"id", b"").decode(), fields.get(b"ev", b"").decode()
            state.lifecycle.setdefault(job_id, []).append(event)
            if event == "completed":
                state.commits.setdefault(job_id, []).append(decode(fields.get(b"result", b"null")))
        after = "(" + entries[-1][0].decode()
    raw: dict[bytes, bytes] = await redis.hgetall(k.stats)  # type: ignore[assignment]
    state.stats = {key.decode(): int(v) for key, v in raw.items()}
    return state


def _execution_of(result: Any) -> tuple[int, int] | None:
    """The (pid, token) a stored result names, or None if it names none."""
    if (
        isinstance(result, Mapping)
        and isinstance(result.get("pid"), int)
        and isinstance(result.get("token"), int)
    ):
        return (int(result["pid"]), int(result["token"]))
    return None


def _commit_after_lost_lease(events: Sequence[str]) -> bool:
    """True if a 'completed' event follows anything but the lease it ends ('active').

    After 'stalled' (the lease expired and the job went back to waiting) or
    another 'completed', a commit can only have come from a lease that was
    already lost, even when it carries the job's last token. A cancel request
    does not end a lease (a success still wins over it), so it is skipped.
    """
    last = ""
    for event in events:
        if event == "completed" and last != "active":
            return True
        if event != "cancel_requested":
            last = event
    return False


def _overlaps(a0: float, a1: float, b0: float, b1: float) -> bool:
    return a0 <= b1 and b0 <= a1


def cause_of(ex: Execution, faults: Sequence[Fault], lease_s: float) -> str:
    """Why an execution did not count, as far as the witness and the faults tell.

    Its process was killed, or frozen, while it ran or within a lease of its
    end (a handler that has returned still has to report its outcome, and a
    frozen one ends only after the thaw), or it started within a lease after
    its process was thawed (a job leased just before the freeze, started on
    waking up); or Redis was down then (the outcome or a lease renewal could
    not reach it in time). The process's own fault wins over an outage.
    Anything else is unexplained.
    """
    # When its outcome was surely reported, had nothing gone wrong.
    settled = (ex.end if ex.end is not None else float("inf")) + lease_s
    for f in faults:
        if f.kind == "kill" and f.pid == ex.pid and _overlaps(ex.start, settled, f.start, f.end):
            return CAUSES[0]
    for f in faults:
        if f.kind == "freeze" and f.pid == ex.pid and _overlaps(ex.start, settled, f.start, f.end + lease_s):
            return CAUSES[1]
    for f in faults:
        if f.kind == "redis" and _overlaps(ex.start, settled, f.start, f.end + lease_s):
            return CAUSES[2]
    return CAUSES[3]


def check(
    accepted: Mapping[int, str],
    redis: RedisState,
    executions: Sequence[Execution],
    faults: Sequence[Fault] = (),
    *,
    lease_s: float = 2.0,
) -> dict[str, Any]:
    """Hold the three sources against each other; ``passed`` is False if anything was lost or doubled.

    ``accepted``: job number -> id, as the producers were told. ``redis``:
    what Redis holds after the run. ``executions``: what the witnesses saw.
    ``faults``: what happened, to name the cause of each re-execution.
    """
    jobs, commits = redis.jobs, redis.commits
    ids = set(accepted.values())
    by_job: dict[str, list[Execution]] = defaultdict(list)
    for ex in executions:
        by_job[ex.job].append(ex)
    by_key = {(ex.job, *ex.key): ex for ex in executions}

    lost, wrong_end, duplicates, stale, unwitnessed, unrecorded = [], [], [], [], [], []
    causes: Counter[str] = Counter()
    for n, job_id in sorted(accepted.items()):
        view = jobs.get(job_id)
        if view is None or view.state not in ("completed", "dead", "cancelled", "rejected"):
            lost.append(job_id)
            continue
        if view.state != "completed":
            wrong_end.append(job_id)
            continue
        kept = _execution_of(view.result)
        job_commits = [_execution_of(c) for c in commits.get(job_id, ())]
        if len(job_commits) > 1:
            duplicates.append(job_id)
        elif not job_commits:
            unrecorded.append(job_id)
        # A commit is only to be accepted from the job's current lease: any other is stale.
        if (
            kept is None
            or kept[1] != view.token
            or any(c is None or c[1] != view.token for c in job_commits)
            or _commit_after_lost_lease(redis.lifecycle.get(job_id, ()))
        ):
            stale.append(job_id)
        winner = by_key.get((job_id, *kept)) if kept is not None else None
        if winner is None or winner.status != "returned" or winner.n != n:
            unwitnessed.append(job_id)
        for other in by_job.get(job_id, ()):
            if other is not winner:
                causes[cause_of(other, faults, lease_s)] += 1

    unexpected = [ex for ex in executions if ex.job not in ids or accepted.get(ex.n) != ex.job]
    extra_jobs = sorted(set(jobs) - ids, key=int)
    completed = sum(1 for job_id in ids if (v := jobs.get(job_id)) is not None and v.state == "completed")
    # The queue's own count of accepted commits: a second witness of doubled ones.
    counter = redis.stats.get("completed")
    records = sum(1 for v in jobs.values() if v.state == "completed")
    excess = max(0, counter - records) if counter is not None else 0
    counts = {
        "accepted": len(accepted),
        "completed": completed,
        "lost": len(lost),
        "ended_otherwise": len(wrong_end),
        "unexpected_executions": len(unexpected),
        "unexpected_jobs": len(extra_jobs),
        "duplicate_results": max(len(duplicates), excess),
        "stale_commits_accepted": len(stale),
        "results_not_witnessed": len(unwitnessed),
        "completed_without_event": len(unrecorded),
    }
    executed = {ex.job for ex in executions}
    # Executions that began after their job had completed: allowed (delivery is at-least-once)
    # but each one repeats a side effect for nothing, so the report counts them.
    after_completion = sum(
        1
        for ex in executions
        if (v := jobs.get(ex.job)) is not None and v.finished is not None and ex.start > v.finished
    )
    return {
        "passed": all(v == 0 for k, v in counts.items() if k not in ("accepted", "completed"))
        and completed == len(accepted),
        "counts": counts,
        "executions": len(executions),
        "jobs_executed": len(executed & ids),
        "re_executions": sum(causes.values()),
        "re_executions_by_cause": {c: causes.get(c, 0) for c in CAUSES},
        "started_after_completion": after_completion,
        "executions_per_job": dict(sorted(Counter(len(v) for v in by_job.values()).items())),
        "completed_counter_excess": excess,
        "examples": {
            "lost": lost[:SAMPLE],
            "ended_otherwise": wrong_end[:SAMPLE],
            "duplicate_results": duplicates[:SAMPLE],
            "stale_commits_accepted": stale[:SAMPLE],
            "results_not_witnessed": unwitnessed[:SAMPLE],
            "completed_without_event": unrecorded[:SAMPLE],
            "unexpected_executions": [f"{ex.job} (n={ex.n}, pid {ex.pid})" for ex in unexpected[:SAMPLE]],
            "unexpected_jobs": extra_jobs[:SAMPLE],
        },
    }
