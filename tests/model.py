"""A plain-Python model of one queue's job lifecycle, for the model-based tests.

The model keeps jobs as objects with a state and counters; which sorted set a
job sits in (waiting, delayed, active, dead) and its score there are derived
from its state, so "one job, one place" holds by construction. It renders the
whole queue as the Lua scripts should leave it in Redis (job hashes, sorted
sets with scores, counters, idempotency keys, the wake marker, the event
stream), and answers each operation as the scripts should answer it.

Semantics are those stated in the script headers (src/sluice/engine/lua):

* add: ids are sequence numbers; the waiting score is
  ``priority * 2**32 + sequence``; a delayed job waits in ``delayed`` until
  its due time, then takes its place in line by that score; an idempotency
  key that already names a job returns that job (``created`` false).
* step: outcomes are fenced by state ``active`` and token; ``c`` completes,
  ``f`` retries (at ``retry_at``, or at once if that is not in the future)
  while ``attempt < max_attempts``, else dead-letters; ``p`` dead-letters;
  ``r`` returns to waiting and uncounts the attempt; ``x`` cancels. A job
  whose cancellation was requested ends cancelled unless it completed (a
  failure's error is kept). Then due delayed jobs are promoted and up to
  ``want`` best waiting jobs are leased, each lease counting an attempt and
  bumping the token.
* extend renews the lease of an active job holding that token (2 if a
  cancel was requested); reap returns expired leases to waiting counting a
  stall, dead-lettering a job once ``stalls > max_stalls``, and cancelling
  (after counting the stall) one whose cancellation was requested.
* cancel cancels waiting and delayed jobs at once and marks active ones;
  redrive puts dead jobs back in line with attempts, failures and stalls
  reset (and a cancel request dropped); purge deletes dead jobs (their
  idempotency keys stay).
* A lease that expires counts as an attempt (docs/architecture.md: it may have
  run), a released one does not.

Not modelled, because the tests never get there: expiry of idempotency keys
and finished records in real time (the TTLs are a day; the tests check only
that one is set), the 500-job promotion batch, events stream trimming, and
damaged records (counters that do not parse, a missing score, a record
deleted under a queue entry), which the scripts tolerate in ways of their own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

WAITING = "waiting"
DELAYED = "delayed"
ACTIVE = "active"
COMPLETED = "completed"
DEAD = "dead"
CANCELLED = "cancelled"

#: The live states, each with its sorted set.
LIVE_SETS = (WAITING, DELAYED, ACTIVE, DEAD)

#: The cumulative counters Queue.counts() reports (dead_total is stats "dead").
COUNTERS = (
    "added",
    "completed",
    "failed",
    "retried",
    "stalled",
    "cancelled",
    "released",
    "stale_refused",
    "orphaned",
    "throttled",
    "rejected",
    "unknown_outcome",
)

#: One event of the stream: (ev, job id) or (ev, job id, field, value).
ModelEvent = tuple[str, ...]


@dataclass(frozen=True)
class AddSpec:
    """One job to add, as the add script receives it (after Queue._encode)."""

    name: str
    payload: str
    priority: int
    delay_ms: int
    max_attempts: int
    backoff: str
    timeout_ms: int
    max_stalls: int
    idem: str | None


@dataclass
class ModelJob:
    id: str
    seq: int
    spec: AddSpec
    created: int
    idem_key: str | None  # the full Redis key name, as the hash stores it
    state: str
    attempt: int = 0
    token: int = 0
    failures: int = 0
    stalls: int = 0
    due: int | None = None  # the hash's 'due' field: when it was last delayed until
    run_at: int = 0  # delayed: when the job becomes due
    deadline: int = 0  # active: when the lease expires
    dead_at: int = 0  # dead: when it was dead-lettered
    started: int | None = None
    worker: str | None = None
    finished: int | None = None
    result: str | None = None
    error: str | None = None
    cancel: int | None = None  # when a cancel was requested while running
    expires: bool = False  # a finished record kept for keep_ms, then expired

    @property
    def score(self) -> int:
        """The waiting score: priority first, then the sequence (FIFO)."""
        return self.spec.priority * 2**32 + self.seq % 2**32

    def set_score(self) -> int:
        """The job's score in the sorted set of its state."""
        return {
            WAITING: self.score,
            DELAYED: self.run_at,
            ACTIVE: self.deadline,
            DEAD: self.dead_at,
        }[self.state]

    def hash(self) -> dict[str, str]:
        """The job hash as Redis should hold it."""
        s = self.spec
        h = {
            "v": "1",
            "name": s.name,
            "payload": s.payload,
            "priority": str(s.priority),
            "score": str(self.score),
            "state": self.state,
            "attempt": str(self.attempt),
            "token": str(self.token),
            "failures": str(self.failures),
            "stalls": str(self.stalls),
            "max_attempts": str(s.max_attempts),
            "backoff": s.backoff,
            "timeout_ms": str(s.timeout_ms),
            "max_stalls": str(s.max_stalls),
            "created": str(self.created),
            "tokens": "0",
        }
        optional = {
            "due": self.due,
            "idem": self.idem_key,
            "started": self.started,
            "worker": self.worker,
            "finished": self.finished,
            "result": self.result,
            "error": self.error,
            "cancel": self.cancel,
        }
        for name, value in optional.items():
            if value is not None:
                h[name] = str(value)
        return h


@dataclass(frozen=True)
class LeasedJob:
    """The 9 values dispatch returns per leased job, typed as Redis returns them."""

    id: bytes
    token: int
    name: bytes
    payload: bytes
    attempt: int
    max_attempts: bytes
    timeout_ms: bytes
    backoff: bytes
    created: bytes

    def flat(self) -> list[bytes | int]:
        return [
            self.id,
            self.token,
            self.name,
            self.payload,
            self.attempt,
            self.max_attempts,
            self.timeout_ms,
            self.backoff,
            self.created,
        ]


@dataclass
class Model:
    """One queue. ``keep_ms``: how long finished records are kept (0 = forever);
    ``ev_result_max``: the largest result copied into a 'completed' event;
    ``idem_prefix``: the Redis key prefix of idempotency keys."""

    keep_ms: int
    ev_result_max: int
    idem_prefix: str
    seq: int = 0
    jobs: dict[str, ModelJob] = field(default_factory=dict)
    idem: dict[str, str] = field(default_factory=dict)  # idempotency key -> job id
    stats: Counter[str] = field(default_factory=Counter)
    events: list[ModelEvent] = field(default_factory=list)
    wake: bool = False

    # ---- derived views ---------------------------------------------------------------
    def zset(self, state: str) -> list[tuple[str, int]]:
        """The sorted set of a live state: (id, score), in Redis's order
        (score, then member bytes)."""
        members = [(j.id, j.set_score()) for j in self.jobs.values() if j.state == state]
        return sorted(members, key=lambda m: (m[1], m[0].encode()))

    def ids(self, state: str) -> list[str]:
        return [i for i, _ in self.zset(state)]

    def counts(self) -> dict[str, int]:
        out = {name: len(self.zset(name)) for name in LIVE_SETS}
        out["parked"] = 0
        for name in COUNTERS:
            out[name] = self.stats[name]
        out["dead_total"] = self.stats["dead"]
        return out

    def next_due(self) -> int:
        delayed = self.zset(DELAYED)
        return delayed[0][1] if delayed else -1

    def _emit(self, *event: str | int) -> None:
        self.events.append(tuple(str(e) for e in event))

    def _wake_if_waiting(self) -> None:
        if any(j.state == WAITING for j in self.jobs.values()):
            self.wake = True

    # ---- add ---------------------------------------------------------------------------
    def add(self, now: int, specs: list[AddSpec]) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        added = 0
        for spec in specs:
            if spec.idem is not None and spec.idem in self.idem:
                out.append((self.idem[spec.idem], False))
                continue
            self.seq += 1
            job_id = str(self.seq)
            state = DELAYED if spec.delay_ms > 0 else WAITING
            idem_key = None if spec.idem is None else self.idem_prefix + spec.idem
            job = ModelJob(job_id, self.seq, spec, now, idem_key, state)
            if state == DELAYED:
                job.due = job.run_at = now + spec.delay_ms
            self.jobs[job_id] = job
            if spec.idem is not None:
                self.idem[spec.idem] = job_id
            self._emit("added", job_id, "state", state)
            added += 1
            out.append((job_id, True))
        if added:
            self.wake = True
            self.stats["added"] += added
        return out

    # ---- the worker protocol -----------------------------------------------------------
    def step(
        self,
        now: int,
        want: int,
        lease_ms: int,
        worker: str,
        outcomes: list[tuple[str, bytes, bytes, bytes, int, int]],
    ) -> tuple[list[int], int, list[LeasedJob]]:
        """Returns (codes, next_due, leased jobs)."""
        codes = [self._finish(now, *outcome[:5]) for outcome in outcomes]
        for job in self.jobs.values():
            if job.state == DELAYED and job.run_at <= now:
                job.state = WAITING
        leased: list[LeasedJob] = []
        for job_id in self.ids(WAITING)[: max(want, 0)]:
            job = self.jobs[job_id]
            job.attempt += 1
            job.token += 1
            job.state = ACTIVE
            job.started = now
            job.worker = worker
            job.deadline = now + lease_ms
            self._emit("active", job_id, "worker", worker)
            s = job.spec
            leased.append(
                LeasedJob(
                    job_id.encode(),
                    job.token,
                    s.name.encode(),
                    s.payload.encode(),
                    job.attempt,
                    str(s.max_attempts).encode(),
                    str(s.timeout_ms).encode(),
                    s.backoff.encode(),
                    str(job.created).encode(),
                )
            )
        self._wake_if_waiting()
        due = self.next_due()
        # A worker that filled every slot it asked for may have none free when
        # `due` comes: an idle worker is woken to keep the timer.
        if due > 0 and want > 0 and len(leased) >= want:
            self.wake = True
        return codes, due, leased

    def _finish(self, now: int, job_id: str, token: bytes, kind: bytes, value: bytes, retry_at: int) -> int:
        job = self.jobs.get(job_id)
        if job is None:
            return -1
        if job.state != ACTIVE or token != str(job.token).encode():
            self.stats["stale_refused"] += 1
            return 0
        text = value.decode()
        if job.cancel is not None and kind != b"c":
            # A cancel requested while the attempt ran wins over anything but success.
            if kind in (b"f", b"p"):
                job.error = text
            kind = b"x"
        if kind == b"c":
            job.state, job.finished, job.result = COMPLETED, now, text
            job.expires = self.keep_ms > 0
            self.stats["completed"] += 1
            if len(value) <= self.ev_result_max:
                self._emit("completed", job_id, "result", text)
            else:
                self._emit("completed", job_id)
            return 1
        if kind == b"r":
            job.attempt = max(job.attempt - 1, 0)
            job.state = WAITING
            self.stats["released"] += 1
            self._emit("released", job_id)
            return 4
        if kind == b"x":
            job.state, job.finished = CANCELLED, now
            job.expires = self.keep_ms > 0
            self.stats["cancelled"] += 1
            self._emit("cancelled", job_id)
            return 5
        # f: a failed attempt; p (or any other kind): a permanent failure
        return self._fail(now, job, kind != b"f", text, retry_at)

    def _fail(self, now: int, job: ModelJob, permanent: bool, error: str, retry_at: int) -> int:
        job.failures += 1
        job.error = error
        self.stats["failed"] += 1
        self._emit("failed", job.id, "error", error)
        if permanent or job.attempt >= job.spec.max_attempts:
            job.state, job.finished, job.dead_at = DEAD, now, now
            self.stats["dead"] += 1
            self._emit("dead", job.id, "error", error)
            return 3
        if retry_at <= now:
            job.state = WAITING
        else:
            job.state, job.run_at, job.due = DELAYED, retry_at, retry_at
        self.stats["retried"] += 1
        self._emit("retrying", job.id, "at", retry_at)
        return 2

    def extend(self, now: int, lease_ms: int, leases: list[tuple[str, bytes]]) -> list[int]:
        codes = []
        for job_id, token in leases:
            job = self.jobs.get(job_id)
            if job is None:
                codes.append(-1)
            elif job.state != ACTIVE or token != str(job.token).encode():
                codes.append(0)
            else:
                job.deadline = now + lease_ms
                codes.append(2 if job.cancel is not None else 1)
        return codes

    def reap(self, now: int, limit: int) -> tuple[int, int]:
        expired = [i for i, deadline in self.zset(ACTIVE) if deadline <= now][:limit]
        back = dead = cancelled = 0
        for job_id in expired:
            job = self.jobs[job_id]
            job.stalls += 1
            self._emit("stalled", job_id, "worker", job.worker or "")
            if job.cancel is not None:  # its cancellation was requested: it ends here
                job.state, job.finished = CANCELLED, now
                job.expires = self.keep_ms > 0
                self.stats["cancelled"] += 1
                self._emit("cancelled", job_id)
                cancelled += 1
            elif job.stalls > job.spec.max_stalls:
                err = (
                    f"lease expired {job.stalls} times (worker lost or hung); last worker {job.worker or '?'}"
                )
                job.state, job.finished, job.error, job.dead_at = DEAD, now, err, now
                self._emit("dead", job_id, "error", err)
                dead += 1
            else:
                job.state = WAITING
                back += 1
        if back + dead + cancelled:
            self.stats["stalled"] += back + dead + cancelled
            self.stats["dead"] += dead
            self._wake_if_waiting()
        return back, dead

    # ---- producer-side changes ---------------------------------------------------------
    def cancel(self, now: int, job_id: str) -> tuple[int, str]:
        job = self.jobs.get(job_id)
        if job is None:
            return -1, ""
        state = job.state
        if state in (WAITING, DELAYED):
            job.state, job.finished = CANCELLED, now
            job.expires = self.keep_ms > 0
            self.stats["cancelled"] += 1
            self._emit("cancelled", job_id)
            return 1, state
        if state == ACTIVE:
            job.cancel = now
            self._emit("cancel_requested", job_id)
            return 2, state
        return 0, state

    def redrive(self, job_ids: list[str]) -> list[int]:
        codes = []
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                codes.append(-1)
            elif job.state != DEAD:
                codes.append(0)
            else:
                job.state = WAITING
                job.attempt = job.failures = job.stalls = 0
                job.finished = job.cancel = None
                self._emit("redriven", job_id)
                codes.append(1)
        self._wake_if_waiting()
        return codes

    def purge(self, job_ids: list[str]) -> int:
        removed = 0
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is not None and job.state == DEAD:
                del self.jobs[job_id]
                removed += 1
        return removed
