"""A plain-Python model of one queue's job lifecycle, flow control and token ledger,
for the model-based tests.

The model keeps jobs as objects with a state and counters; which sorted set a
job sits in (waiting, delayed, active, dead, a budget's parked set) and its
score there are derived from its state, so "one job, one place" holds by
construction. It renders the whole queue as the Lua scripts should leave it in
Redis (job hashes, sorted sets with scores, counters, idempotency keys, the
wake marker, the event stream, the control hash, the request-rate window,
budgets, their rolling logs, reservations, parked sets), and answers each
operation as the scripts should answer it.

Semantics are those stated in the script headers (src/sluice/engine/lua) and
docs/architecture.md (Flow control, The token ledger):

* add: ids are sequence numbers; the waiting score is
  ``priority * 2**32 + sequence``; a delayed job waits in ``delayed`` until
  its due time, then takes its place in line by that score; an idempotency
  key that already names a job returns that job (``created`` false).
* step: outcomes are fenced by state ``active`` and token; ``c`` completes,
  ``f`` retries (at ``now + retry_in``, or at once if that is not in the future)
  while ``attempt < max_attempts``, else dead-letters; ``p`` dead-letters;
  ``r`` returns to waiting and uncounts the attempt; ``t`` (throttled) does
  the same and closes the queue until ``now + retry_after`` (never moving an
  earlier-set end back); ``x`` cancels. A job whose cancellation was
  requested ends cancelled unless it completed (a failure's error is kept).
  Each outcome settles the attempt's reservation: reported usage is
  committed; a completion without it keeps the estimate; a throttle refunds;
  anything else without a report is kept as an "unknown outcome".
  Then budgets whose parked jobs are due give them back to waiting, due
  delayed jobs are promoted, and the best waiting jobs are leased, each only
  if every gate admits it: queue-wide gates (paused, throttled, the global
  concurrency, the request-rate window) and the token-rate window stop the
  step; a job whose budget (or one above it) cannot admit its estimate is
  rejected or parked and the step goes on. A lease counts an attempt, bumps
  the token, reserves the estimate on every level under ``<id>:<token>`` and
  records a start in the request-rate log. The rate windows count over
  their length plus the headroom: each kind's paced one and up to two longer
  ones (set_limits: request caps counted on the same log, which keeps the
  longest; token caps as rolling budgets '#tok:<ms>' reserved on beside
  '#tpm'); a full request window opens when its N-th newest start leaves it;
  each rate limit's pacer (unless off, on the paced window only) lets
  a start go only when its theoretical arrival time (us) less the tolerance
  is not after now, and moves that time on by the start's cost times
  (window + headroom) / limit (a request costs 1, a token-rate start its
  estimate; 0 tokens are not paced), rounded up to the us; its refusal is
  its limit's, its wait the first ms at which it is due. Each gate that refused
  something in a step that asked for jobs adds 1 to the stats hash's
  ``refused:<gate>``, once per step (a closed queue-wide gate refuses
  nothing while nothing waits).
* next_due: the earliest of a delayed job's due time, a parked budget's retry
  time and the time a closed gate opens by itself.
* The wake marker is put back when jobs wait, by add, reap, redrive, a raised
  budget limit that freed parked jobs, and a step whose queue-wide gates are
  open (or which took nothing and was told to come back later); and in any
  case by the flow setters that may open a gate, a settle that gave tokens
  back to a budget with parked jobs, and a step that filled every slot it
  asked for while something waits on time (next_due).
* Budgets: a limit and ``used`` (the sum of the amounts of the reservations
  counted in the current window). Calendar windows are UTC days and months
  (a budget counts from zero again once ``now`` is in a later one); a
  rolling window counts the charges made less than its length ago (its log
  keeps each charge's amount). A budget record is brought up to date when
  an operation consults it (the stored ``used``/``period``/log reflect the
  last consultation). Settling charges usage above the reservation to the
  budgets only as far as every one still counting it has room (the excess
  is ``over``), while the token-rate window takes it in full; tokens given
  back to a budget with parked jobs make them due at once; a reservation
  that is not held any more is left alone. Callers' own reservations are
  kept apart from the dispatch script's (the tests pass their stored ids).
* extend renews the lease of an active job holding that token (2 if a
  cancel was requested); reap returns expired leases to waiting counting a
  stall (keeping their reservation charged as an unknown outcome),
  dead-lettering a job once ``stalls > max_stalls``, and cancelling (after
  counting the stall) one whose cancellation was requested.
* cancel cancels waiting, delayed and parked jobs at once and marks active
  ones; redrive puts dead jobs back in line with attempts, failures and
  stalls reset (and a cancel request dropped); purge deletes dead jobs
  (their idempotency keys stay).
* A lease that expires counts as an attempt (docs/architecture.md: it may have
  run), a released one does not.

Calendar windows are computed with :mod:`datetime`, independently of the
Lua's day arithmetic.

Not modelled, because the tests never get there: expiry of idempotency keys,
finished records and settled reservations in real time (the TTLs are a day or
more; the tests check only that one is set), the 500-job promotion batch, the
100-budget unpark batch, the 1000-entry log and examination caps, budget
hierarchies deeper than 8, limits past the largest allowed, events stream
trimming, and damaged records (counters or estimates that do not parse, a
missing score, a record deleted under a queue entry), which the scripts
tolerate in ways of their own.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sluice.engine.job import MAX_TOKENS

WAITING = "waiting"
DELAYED = "delayed"
PARKED = "parked"
ACTIVE = "active"
COMPLETED = "completed"
DEAD = "dead"
CANCELLED = "cancelled"
REJECTED = "rejected"
EXHAUSTED = "exhausted"

#: The live states that have a sorted set of their own.
LIVE_SETS = (WAITING, DELAYED, ACTIVE, DEAD)
#: Finished states indexed for retention (dead jobs are in the dead set).
FINISHED_SETS = (COMPLETED, CANCELLED, REJECTED, EXHAUSTED)

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
    "exhausted",
    "unknown_outcome",
    "overrun",
)

#: The budget behind the queue's token-rate limit (docs/architecture.md, "Token rate is a rolling budget").
TOKEN_RATE = "#tpm"  # noqa: S105 - a key name, not a secret
#: The budgets of the longer token windows (the caps) are this and their window in ms.
TOKEN_CAP = "#tok:"  # noqa: S105 - a key name, not a secret
#: The pacer's tolerance when none is set (ms).
PACE_TOLERANCE_MS = 20
#: The least headroom when none is set (ms).
PACE_HEADROOM_MS = 10
#: How much longer than counted the request-rate log keeps its starts, beyond one more window
#: (ms): dispatch.lua's LAG_KEEP_MS (a measured headroom that grows counts the starts it reaches
#: back to; observe.lua compares answers with the log as it was at their dispatch).
LAG_KEEP_MS = 500
#: Budgets may be nested at most this deep (a hierarchy of 8 levels).
MAX_LEVELS = 8
INF = math.inf

#: One event of the stream: (ev, job id) or (ev, job id, field, value).
ModelEvent = tuple[str, ...]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def calendar_window(win: str, now: int) -> tuple[int, int]:
    """The UTC calendar window ('day' or 'month') holding ``now`` (ms): its number
    (days since 1970-01-01, or year * 12 + month - 1) and when the next one starts (ms)."""
    t = _EPOCH + now * _MS
    if win == "day":
        start = datetime(t.year, t.month, t.day, tzinfo=UTC)
        return (start - _EPOCH).days, (start + timedelta(days=1) - _EPOCH) // _MS
    nxt = datetime(t.year + t.month // 12, t.month % 12 + 1, 1, tzinfo=UTC)
    return t.year * 12 + t.month - 1, (nxt - _EPOCH) // _MS


def pace_wait(c: Control, tat: int | None, now: int) -> int:
    """The pacer: 0 if a start is due (tat - tau <= now), else the first ms at which it is."""
    if not c.pace or (tat or 0) - c.tau_us <= now * 1000:
        return 0
    return math.ceil(((tat or 0) - c.tau_us) / 1000)


def pace_next(tat: int | None, now: int, cost: int, win_ms: int, limit: int, slow: int = 1000) -> int:
    """The pacer's next arrival time after a start of ``cost`` units (win_ms / limit ms each,
    slower by ``slow`` per mille after a 429), in whole us rounded up, computed in doubles in the
    script's order."""
    if slow < 1000:
        step = float(cost) * float(win_ms) * 1000.0 * 1000.0 / (float(limit) * float(slow))
        return max(tat or 0, now * 1000) + math.ceil(step)
    return max(tat or 0, now * 1000) + math.ceil(float(cost) * float(win_ms) * 1000.0 / float(limit))


#: After a 429: a first one after a quiet spell is only remembered; each further one within the
#: recovery takes the pacers' factor to 950 per mille of what it is, down to 500, at most once
#: per 250 ms; it climbs back over 2 of the longest window (at least 1 s).
SLOW_STEP, SLOW_FLOOR, SLOW_RECOVER, SLOW_QUIET_MS = 950, 500, 2, 250


def slow_now(c: Control, now: int) -> int:
    """The pacers' factor now (per mille), as dispatch.lua's slow_now."""
    if c.slow_pm is None or c.slow_at is None:
        return 1000
    recover = SLOW_RECOVER * max(c.rate_ms or 0, c.tpm_ms or 0, 1000)
    if now - c.slow_at >= recover:
        return 1000
    return math.floor(c.slow_pm + (1000 - c.slow_pm) * max(now - c.slow_at, 0) / recover)


def seconds_text(ms: int) -> str:
    """A window in seconds as the scripts print it (Lua's %.14g): 60, 2.5, 0.12."""
    return f"{ms / 1000:.14g}"


def _window(kind: str, limit: int, ms: int, count: int, *, paced: bool) -> dict[str, Any]:
    """One of FlowState.windows, as dataclasses.asdict renders it."""
    return {"kind": kind, "limit": limit, "per_seconds": ms / 1000, "in_window": count, "paced": paced}


def lua_number(text: str) -> int:
    """An integer outcome value as the scripts read it (anything else counts as 0)."""
    try:
        return int(text)
    except ValueError:
        return 0


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
    tokens: int = 0
    budget: str | None = None
    on_exhausted: str = "reject"
    correlation_id: str | None = None
    trace_context: str | None = None
    job_id: str | None = None


#: What a job cancelled ahead of its add holds (cancel.lua): no payload's, no backoff's fields.
TOMBSTONE = AddSpec("", "null", 0, 0, 1, "", 0, 0, None)


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
    expires: bool = False  # a finished record: kept for its kind's retention age, then expired
    usage: int | None = None  # tokens the last attempt that reported any used
    rid: str | None = None  # the reservation of the last attempt that reserved
    parked: str | None = None  # parked: the budget it waits for
    #: per attempt that reserved (the last 20): [reservation, estimate, usage, charged, outcome]
    spend: list[list[str | int]] | None = None
    spent: int = 0  # what the attempts' reservations charged in all

    @property
    def score(self) -> int:
        """The waiting score: priority first, then the sequence (FIFO)."""
        return self.spec.priority * 2**32 + self.seq % 2**32

    def set_score(self) -> int:
        """The job's score in the sorted set of its state."""
        return {
            WAITING: self.score,
            PARKED: self.score,
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
            "tokens": str(s.tokens),
        }
        if s.budget is not None:
            h["budget"] = s.budget
            h["on_ex"] = s.on_exhausted
        if s.correlation_id is not None:
            h["cid"] = s.correlation_id
        if s.trace_context is not None:
            h["trace"] = s.trace_context
        if s is TOMBSTONE:
            del h["payload"], h["score"], h["backoff"]
        optional = {
            "due": self.due,
            "idem": self.idem_key,
            "started": self.started,
            "worker": self.worker,
            "finished": self.finished,
            "result": self.result,
            "error": self.error,
            "cancel": self.cancel,
            "usage": self.usage,
            "rid": self.rid,
            "parked": self.parked,
            "spend": None if self.spend is None else json.dumps(self.spend, separators=(",", ":")),
            "spent": self.spent if self.spend is not None else None,
        }
        for name, value in optional.items():
            if value is not None:
                h[name] = str(value)
        return h


@dataclass(frozen=True)
class LeasedJob:
    """The 15 values dispatch returns per leased job, typed as Redis returns them."""

    id: bytes
    token: int
    name: bytes
    payload: bytes
    attempt: int
    max_attempts: bytes
    timeout_ms: bytes
    backoff: bytes
    created: bytes
    tokens: int
    budget: bytes
    correlation_id: bytes
    due: bytes
    trace_context: bytes
    priority: bytes

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
            self.tokens,
            self.budget,
            self.correlation_id,
            self.due,
            self.trace_context,
            self.priority,
        ]


@dataclass
class ModelBudget:
    """One budget as its record stands (as of the last time it was consulted).
    ``win``: '' (none), 'day', 'month' or 'roll'. The token-rate budget has no
    period, created, parent or counter fields until something sets them."""

    name: str
    limit: int
    win: str
    win_ms: int
    parent: str | None = None
    created: int | None = None
    period: int | None = None
    used: int = 0
    counters: dict[str, int] = field(default_factory=dict)  # accepted, rejected, unknown, beyond, charged
    #: rolling: reservation id -> (time reserved, the amount it charges to the window)
    log: dict[str, tuple[int, int]] = field(default_factory=dict)
    credit: int | None = None  # the stored one-off credit (None: the field was never written)
    credit_p: int | None = None  # the window it belongs to: period, end time (rolling), or 0
    live: int = 0  # the credit that counts now (as of the last consultation)

    @property
    def admits(self) -> int:
        """What the current window admits: the standing limit and a live credit."""
        return self.limit + self.live

    def log_members(self) -> list[tuple[str, int]]:
        """The rolling log as Redis holds it: '<amount> <reservation id>' -> time reserved."""
        members = [(f"{amount} {rid}", at) for rid, (at, amount) in self.log.items()]
        return sorted(members, key=lambda m: (m[1], m[0].encode()))

    @property
    def calendar(self) -> bool:
        return self.win in ("day", "month")

    def count(self, counter: str) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + 1

    def hash(self) -> dict[str, str]:
        h = {"limit": str(self.limit), "used": str(self.used), "win": self.win, "win_ms": str(self.win_ms)}
        for name, value in (
            ("parent", self.parent),
            ("created", self.created),
            ("period", self.period),
            ("credit", self.credit),
            ("credit_p", self.credit_p),
        ):
            if value is not None:
                h[name] = str(value)
        h.update((name, str(n)) for name, n in self.counters.items())
        return h


def _refuses(b: ModelBudget, tokens: int) -> bool:
    """A level refuses what does not fit, and anything at all once full (or past its limit)."""
    return b.used + tokens > b.admits or b.used >= b.admits


@dataclass
class ModelReservation:
    rid: str
    amt: int  # charged now, on every level that still counts it
    est: int
    names: list[str]  # the levels charged, the budget's own first
    periods: list[int]  # per level: the calendar window it was charged in (else 0)
    at: int
    job: str
    state: str = "held"
    beyond: int | None = None  # tokens used beyond the estimate (charged)
    by: str | None = None  # refused: the budget that refused it
    settled: int | None = None
    caller: bool = False  # made by budgets.reserve: its hold expires (the dispatch script's does not)

    def hash(self) -> dict[str, str]:
        h = {
            "amt": str(self.amt),
            "est": str(self.est),
            "b": " ".join(self.names),
            "p": " ".join(map(str, self.periods)),
            "state": self.state,
            "at": str(self.at),
            "job": self.job,
        }
        if self.beyond is not None:
            h["beyond"] = str(self.beyond)
        if self.by is not None:
            h["by"] = self.by
        if self.settled is not None:
            h["settled"] = str(self.settled)
        return h


@dataclass
class Control:
    """The queue's flow controls (the control hash)."""

    paused: bool = False
    throttled_until: int | None = None
    concurrency: int | None = None
    rate_max: int | None = None
    rate_ms: int | None = None
    tpm: bool = False
    tpm_ms: int | None = None  # the token-rate limit's nominal window (its budget's is this + headroom)
    tolerance: str | None = None  # the pacer's tolerance as set (ms, or 'off'); None: the default
    headroom_ms: int | None = None
    tat_req: int | None = None  # the pacers' theoretical arrival times (us)
    tat_tok: int | None = None
    slow_pm: int | None = None  # the pacers' factor after a 429 (per mille), and when it was set
    tpm_refund: bool = False  # the token-rate windows give back usage below the estimate
    slow_at: int | None = None
    #: the request windows beyond the paced one, (ms, limit), shortest first
    rate_caps: list[tuple[int, int]] = field(default_factory=list)
    #: the token windows beyond the paced one (ms), shortest first: budgets TOKEN_CAP + ms
    tok_caps: list[int] = field(default_factory=list)

    @property
    def headroom(self) -> int:
        return PACE_HEADROOM_MS if self.headroom_ms is None else self.headroom_ms

    @property
    def pace(self) -> bool:
        return self.tolerance != "off"

    @property
    def tau_us(self) -> int:
        return (
            int(self.tolerance if self.tolerance is not None else PACE_TOLERANCE_MS) * 1000
            if self.pace
            else 0
        )

    def hash(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.paused:
            h["paused"] = "1"
        if self.tpm:
            h["tpm"] = "1"
        if self.tpm_refund:
            h["tpm_refund"] = "1"
        if self.rate_caps:
            h["rate_caps"] = " ".join(f"{ms}:{n}" for ms, n in self.rate_caps)
        if self.tok_caps:
            h["tok_caps"] = " ".join(map(str, self.tok_caps))
        for name, value in (
            ("throttled_until", self.throttled_until),
            ("concurrency", self.concurrency),
            ("rate_max", self.rate_max),
            ("rate_ms", self.rate_ms),
            ("tpm_ms", self.tpm_ms),
            ("tolerance_ms", self.tolerance),
            ("headroom_ms", self.headroom_ms),
            ("tat_req", self.tat_req),
            ("tat_tok", self.tat_tok),
            ("slow_pm", self.slow_pm),
            ("slow_at", self.slow_at),
        ):
            if value is not None:
                h[name] = str(value)
        return h


@dataclass
class Model:
    """One queue, with the default retention (every finished record expires, after a day or
    more: the model's time never gets there, and no count limit is reached);
    ``ev_result_max``: the largest result copied into a 'completed' event;
    ``idem_prefix``: the Redis key prefix of idempotency keys."""

    ev_result_max: int
    idem_prefix: str
    seq: int = 0
    jobs: dict[str, ModelJob] = field(default_factory=dict)
    idem: dict[str, str] = field(default_factory=dict)  # idempotency key -> job id
    stats: Counter[str] = field(default_factory=Counter)
    events: list[ModelEvent] = field(default_factory=list)
    wake: bool = False
    control: Control = field(default_factory=Control)
    starts: dict[str, int] = field(default_factory=dict)  # request-rate log: <id>:<token> -> start
    slow: int = 1000  # the pacers' factor this call (per mille)
    budgets: dict[str, ModelBudget] = field(default_factory=dict)
    resv: dict[str, ModelReservation] = field(default_factory=dict)
    #: reservations deleted with their purged job: gone from Redis, still charged
    forgotten: dict[str, ModelReservation] = field(default_factory=dict)
    parkedby: dict[str, float] = field(default_factory=dict)  # budget -> when to retry its parked jobs
    held: dict[str, int] = field(default_factory=dict)  # callers' held reservations -> hold's end
    ops: dict[str, dict[str, str]] = field(default_factory=dict)  # budget operation id -> its record
    _retry_cache: dict[str, float] = field(default_factory=dict)  # budget -> retry time, per step
    _refused: set[str] = field(default_factory=set)  # gates that refused during this step
    paced: bool = False  # a pacer refused during the last step (for the tests' statistics)
    #: the kinds (requests, tokens) of which a window beyond the paced one was full during the
    #: last step (the same)
    capped: set[str] = field(default_factory=set)
    stepped: bool = False  # a dispatch call made the queue's epoch

    # ---- derived views ---------------------------------------------------------------
    def zset(self, state: str) -> list[tuple[str, int]]:
        """The sorted set of a live state: (id, score), in Redis's order
        (score, then member bytes)."""
        members = [(j.id, j.set_score()) for j in self.jobs.values() if j.state == state]
        return sorted(members, key=lambda m: (m[1], m[0].encode()))

    def finished(self, state: str) -> list[tuple[str, int]]:
        """The retention index of a finished state (completed, cancelled, rejected): (id, when
        it finished), in Redis's order."""
        members = [(j.id, j.finished or 0) for j in self.jobs.values() if j.state == state]
        return sorted(members, key=lambda m: (m[1], m[0].encode()))

    def ids(self, state: str) -> list[str]:
        return [i for i, _ in self.zset(state)]

    def parked_set(self, budget: str) -> list[tuple[str, int]]:
        """The jobs parked on one budget, by waiting score."""
        members = [(j.id, j.score) for j in self.jobs.values() if j.state == PARKED and j.parked == budget]
        return sorted(members, key=lambda m: (m[1], m[0].encode()))

    def counts(self) -> dict[str, int]:
        out = {name: len(self.zset(name)) for name in LIVE_SETS}
        out["parked"] = sum(j.state == PARKED for j in self.jobs.values())
        for name in COUNTERS:
            out[name] = self.stats[name]
        out["dead_total"] = self.stats["dead"]
        return out

    def check(self) -> None:
        """The model's own bookkeeping: every stored 'used' is the sum of the amounts of the
        reservations the budget counts, and every parked job's budget says when to retry."""
        everything = self.resv | self.forgotten
        for b in self.budgets.values():
            if b.win == "roll":  # the log holds what the window counts
                counted = [amount for _, amount in b.log.values()]
                for rid, (_, amount) in b.log.items():  # the reservation's amount, but for overuse
                    assert amount == everything[rid].amt or b.name.startswith("#"), (b.name, rid)
            else:
                counted = [
                    r.amt
                    for r in everything.values()
                    for i in self._levels_of(r, b)
                    if self._counted(b, r, i)
                ]
            assert b.used == sum(counted), (b.name, b.used, counted)
        for j in self.jobs.values():
            assert j.state != PARKED or (j.parked in self.parkedby), j.id

    def _levels_of(self, r: ModelReservation, b: ModelBudget) -> list[int]:
        return [i for i, name in enumerate(r.names) if name == b.name]

    def _emit(self, *event: str | int) -> None:
        self.events.append(tuple(str(e) for e in event))

    def _wake_if_waiting(self) -> None:
        if any(j.state == WAITING for j in self.jobs.values()):
            self.wake = True

    def _end(self, job: ModelJob, state: str, now: int) -> None:
        """A terminal state, whose record expires with its kind's retention age."""
        job.state, job.finished = state, now
        job.expires = True

    # ---- add ---------------------------------------------------------------------------
    def add(self, now: int, specs: list[AddSpec]) -> list[tuple[str, bool]] | str:
        """(id, created) per job; or, when a job names a budget that does not exist, that
        budget's name (the first such job's), and nothing is added."""
        for spec in specs:
            if spec.budget is not None and spec.budget not in self.budgets:
                return spec.budget
        out: list[tuple[str, bool]] = []
        added = 0
        for spec in specs:
            if spec.idem is not None and spec.idem in self.idem:
                out.append((self.idem[spec.idem], False))
                continue
            if spec.job_id is not None and spec.job_id in self.jobs:
                out.append((spec.job_id, False))
                continue
            self.seq += 1
            job_id = spec.job_id or str(self.seq)
            state = DELAYED if spec.delay_ms > 0 else WAITING
            idem_key = None if spec.idem is None else self.idem_prefix + spec.idem
            job = ModelJob(job_id, self.seq, spec, now, idem_key, state)
            if state == DELAYED:
                job.due = job.run_at = now + spec.delay_ms
            self.jobs[job_id] = job
            if spec.idem is not None:
                self.idem[spec.idem] = job_id
            if idem_key is None:
                self._emit("added", job_id, "state", state)
            else:
                self._emit("added", job_id, "state", state, "idem", idem_key)
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
        self.stepped = True
        codes = [self._finish(now, *outcome) for outcome in outcomes]
        self._retry_cache = {}
        self._load_gates(now)
        for name, at in sorted(self.parkedby.items(), key=lambda e: (e[1], e[0])):
            if at <= now:
                self._unpark(name, now)
        for job in self.jobs.values():
            if job.state == DELAYED and job.run_at <= now:
                job.state = WAITING
        self._refused = set()
        self.paced, self.capped = False, set()
        leased, wait = self._take(now, want, lease_ms, worker)
        if want > 0:  # each gate that refused counts once per call, however many jobs it refused
            for gate in self._refused:
                self.stats["refused:" + gate] += 1
        # Workers are woken only while the queue is open, or by a caller that took
        # nothing and was told when to come back (it hands the wake-up on).
        if wait == 0 or (want <= 0 and wait > 0):
            self._wake_if_waiting()
        due = self._next_due(wait)
        # A caller that filled every slot it asked for may have none left when `due` comes:
        # an idle worker is woken to keep the timer.
        if due > 0 and want > 0 and len(leased) >= want:
            self.wake = True
        return codes, due, leased

    def _request_windows(self) -> list[tuple[int, int]]:
        """The request windows as (W + h, limit): the paced one, then the caps."""
        c = self.control
        return [(ms + c.headroom, n) for ms, n in [(c.rate_ms or 0, c.rate_max or 0), *c.rate_caps]]

    def _token_windows(self) -> list[ModelBudget]:
        """The token windows' budgets: the paced one ('#tpm'), then the caps."""
        caps = [self.budgets[TOKEN_CAP + str(ms)] for ms in self.control.tok_caps]
        return [self.budgets[TOKEN_RATE], *caps]

    def _load_gates(self, now: int) -> None:
        c = self.control
        self.slow = slow_now(c, now)
        if c.rate_max is not None:  # the request-rate log keeps the starts of the longest window + headroom,
            # and of the paced one's twice (observe.lua compares answers with it), and LAG_KEEP_MS more
            paced = (c.rate_ms or 0) + c.headroom
            keep = max(paced + (c.rate_ms or 0), *(win for win, _ in self._request_windows()))
            self.starts = {m: at for m, at in self.starts.items() if at > now - keep - LAG_KEEP_MS}
        if c.tpm:
            for b in self._token_windows():
                self._consult(b.name, now)

    def _queue_wait(self, now: int) -> int:
        """0 if the queue-wide gates are open; else when they open (ms), or -1: on an event."""
        c = self.control
        if c.paused:
            self._refused.add("paused")
            return -1
        if c.throttled_until is not None and c.throttled_until > now:
            self._refused.add("throttled")
            return c.throttled_until
        if c.concurrency is not None and len(self.zset(ACTIVE)) >= c.concurrency:
            self._refused.add("concurrency")
            return -1
        if c.rate_max is not None:
            wait = pace_wait(c, c.tat_req, now)
            self.paced = self.paced or wait != 0
            for i, (win, most) in enumerate(self._request_windows()):
                # a full window opens when its N-th newest start leaves it
                if sum(at > now - win for at in self.starts.values()) >= most:
                    wait = max(wait, sorted(self.starts.values())[-most] + win)
                    if i > 0:
                        self.capped.add("requests")
            if wait != 0:
                self._refused.add("rate")
                return wait
        return 0

    def _take(self, now: int, want: int, lease_ms: int, worker: str) -> tuple[list[LeasedJob], int]:
        leased: list[LeasedJob] = []
        wait = self._queue_wait(now)
        if want <= 0 or wait != 0:
            if wait != 0 and not self.ids(WAITING):
                self._refused = set()  # a closed gate refuses nothing while nothing waits
            return leased, wait
        while len(leased) < want and (line := self.ids(WAITING)):
            wait = self._queue_wait(now)
            if wait != 0:
                return leased, wait
            job = self.jobs[line[0]]
            verdict = self._admit(now, job)
            if isinstance(verdict, int):  # the token-rate window is full: the step stops
                return leased, verdict
            if verdict is not None:
                leased.append(self._lease(now, job, verdict, lease_ms, worker))
        return leased, 0

    def _admit(self, now: int, job: ModelJob) -> list[ModelBudget] | int | None:
        """The levels to reserve on; or when the token-rate window frees enough (the queue
        waits); or None: the job was rejected or parked."""
        tokens = job.spec.tokens
        windows = self._token_windows() if self.control.tpm else []
        for b in windows:
            if tokens > b.limit:
                self._refused.add("token_rate")
                per = "" if b.name == TOKEN_RATE else f" per {seconds_text(int(b.name[len(TOKEN_CAP) :]))} s"
                self._reject(
                    now,
                    job,
                    f"token estimate {tokens} exceeds the queue token-rate limit of {b.limit}{per}; "
                    "split the job or raise the limit",
                )
                return None
        if windows:
            wait = pace_wait(self.control, self.control.tat_tok, now) if tokens > 0 else 0
            self.paced = self.paced or wait != 0
            for b in windows:
                if b.used + tokens > b.limit:
                    if b.name != TOKEN_RATE:
                        self.capped.add("tokens")
                    free_at = self._free_at(b, tokens)
                    assert free_at is not None, "a rolling window holds what it counts"
                    wait = max(wait, free_at)
            if wait != 0:
                self._refused.add("token_rate")
                return wait
        levels: list[ModelBudget] = []
        if job.spec.budget is not None:
            levels, missing = self._chain(job.spec.budget, now)
            if missing is not None:
                self._refused.add("budget")
                self._reject(now, job, f"no budget named {missing}; create it before adding jobs that use it")
                return None
            refusing = next((b for b in levels if _refuses(b, tokens)), None)
            if refusing is not None:
                self._refused.add("budget")
                self._refuse(now, job, refusing)
                return None
        return levels + windows

    def _refuse(self, now: int, job: ModelJob, b: ModelBudget) -> None:
        """A budget level cannot admit the job's estimate: park it, or reject it."""
        tokens = job.spec.tokens
        if job.spec.on_exhausted == "wait":
            # One event per wait: a job parked on this budget before (not leased since)
            # goes back quietly.
            if job.parked != b.name:
                self._emit("parked", job.id, "budget", b.name)
            job.state, job.parked = PARKED, b.name
            at = self._cached_retry_at(b, tokens, now)
            self.parkedby[b.name] = min(self.parkedby.get(b.name, INF), at)
            return
        left = max(b.admits - b.used, 0)
        self._reject(now, job, f"budget {b.name} cannot admit {tokens} tokens ({left} of {b.admits} left)")
        b.count("rejected")

    def _reject(self, now: int, job: ModelJob, reason: str) -> None:
        """Refused: 'rejected' if it never spent, 'exhausted' if earlier attempts did."""
        job.error = reason
        if job.spent > 0:
            self._end(job, EXHAUSTED, now)
            self.stats["exhausted"] += 1
            self._emit("exhausted", job.id, "reason", reason, "spent", job.spent)
            return
        self._end(job, REJECTED, now)
        self.stats["rejected"] += 1
        self._emit("rejected", job.id, "reason", reason)

    def _lease(
        self, now: int, job: ModelJob, levels: list[ModelBudget], lease_ms: int, worker: str
    ) -> LeasedJob:
        job.attempt += 1
        job.token += 1
        job.state, job.parked = ACTIVE, None
        job.started = now
        job.worker = worker
        job.deadline = now + lease_ms
        attempt_id = f"{job.id}:{job.token}"
        if levels:
            self._charge(attempt_id, job.id, levels, job.spec.tokens, now)
            job.rid = attempt_id
        c = self.control
        if c.rate_max is not None:
            self.starts[attempt_id] = now
            if c.pace:
                c.tat_req = pace_next(c.tat_req, now, 1, (c.rate_ms or 0) + c.headroom, c.rate_max, self.slow)
        if c.tpm and c.pace:
            tpm = self.budgets[TOKEN_RATE]
            c.tat_tok = pace_next(c.tat_tok, now, job.spec.tokens, tpm.win_ms, tpm.admits, self.slow)
        self._emit("active", job.id, "worker", worker, "attempt", job.attempt, "token", job.token)
        s = job.spec
        return LeasedJob(
            job.id.encode(),
            job.token,
            s.name.encode(),
            s.payload.encode(),
            job.attempt,
            str(s.max_attempts).encode(),
            str(s.timeout_ms).encode(),
            s.backoff.encode(),
            str(job.created).encode(),
            s.tokens,
            (s.budget or "").encode(),
            (s.correlation_id or "").encode(),
            b"" if job.due is None else str(job.due).encode(),
            (s.trace_context or "").encode(),
            str(s.priority).encode(),
        )

    def _next_due(self, wait: int) -> int:
        times: list[float] = [j.run_at for j in self.jobs.values() if j.state == DELAYED]
        times += [at for at in self.parkedby.values() if at != INF]
        if wait > 0:
            times.append(wait)
        return int(min(times)) if times else -1

    def _cached_retry_at(self, b: ModelBudget, need: int, now: int) -> float:
        """_retry_at, computed once per budget per step (for the first need asked)."""
        if b.name not in self._retry_cache:
            self._retry_cache[b.name] = self._retry_at(b, need, now)
        return self._retry_cache[b.name]

    def _unpark(self, name: str, now: int) -> int:
        """The jobs parked on budget ``name`` that the room of it and every level above it
        admits go back to waiting, best first (the rest stay); the budget's retry time
        becomes when the first that did not fit may, or it leaves the schedule once
        nothing is parked on it. Returns the number moved."""
        levels, missing = self._chain(name, now)
        room = None if missing is not None else min(b.admits - b.used for b in levels)
        moved, taken, blocked = 0, 0, None
        for job_id, _ in self.parked_set(name):
            job = self.jobs[job_id]
            need = job.spec.tokens
            if room is None or need <= room:
                if room is not None:
                    room, taken = room - need, taken + need
                job.state = WAITING  # job.parked stays: the budget it last waited for
                moved += 1
            elif blocked is None:
                blocked = need
        if not self.parked_set(name):
            self.parkedby.pop(name, None)
        else:
            assert blocked is not None, "the model never reaches the 100-job bound"
            # The first that did not fit needs its tokens on top of those moved back.
            need = taken + blocked
            refusing = next(b for b in levels if _refuses(b, need))
            self.parkedby[name] = self._cached_retry_at(refusing, need, now)
        if moved:
            self._emit("unparked", "", "budget", name)
        return moved

    def _finish(
        self, now: int, job_id: str, token: bytes, kind: bytes, value: bytes, retry_in: int, usage: int
    ) -> int:
        retry_at = now + retry_in
        job = self.jobs.get(job_id)
        if job is None:
            return -1
        if job.state != ACTIVE or token != str(job.token).encode():
            self.stats["stale_refused"] += 1
            return 0
        self._settle_attempt(now, job, kind, usage)
        text = value.decode()
        if job.cancel is not None and kind != b"c":
            # A cancel requested while the attempt ran wins over anything but success.
            if kind in (b"f", b"p"):
                job.error = text
            kind = b"x"
        if kind == b"c":
            return self._complete(now, job, text)
        if kind in (b"r", b"t"):  # back in line, the attempt not counted
            job.attempt = max(job.attempt - 1, 0)
            job.state = WAITING
            return self._throttled(now, job, lua_number(text)) if kind == b"t" else self._released(job)
        if kind == b"x":
            self._end(job, CANCELLED, now)
            self.stats["cancelled"] += 1
            self._emit("cancelled", job_id)
            return 5
        # f: a failed attempt; p (or any other kind): a permanent failure
        return self._fail(now, job, kind != b"f", text, retry_at)

    def _complete(self, now: int, job: ModelJob, result: str) -> int:
        self._end(job, COMPLETED, now)
        job.result = result
        self.stats["completed"] += 1
        if len(result.encode()) <= self.ev_result_max:
            self._emit("completed", job.id, "result", result)
        else:
            self._emit("completed", job.id)
        return 1

    def _record_spend(self, job: ModelJob, rid: str, outcome: str, usage: int) -> None:
        """The job record's spend list gets the attempt's reservation (the last 20 kept)."""
        r = self.resv.get(rid)
        est, amt = (r.est, r.amt) if r is not None else (0, 0)
        entry: list[str | int] = [rid, est, usage, amt, outcome]
        job.spend = [*(job.spend or []), entry][-20:]
        job.spent += amt

    def _settle_attempt(self, now: int, job: ModelJob, kind: bytes, usage: int) -> None:
        if usage >= 0:
            job.usage = usage
        if job.rid != f"{job.id}:{job.token}":  # this attempt reserved nothing
            return
        # What was reported is charged whatever the outcome (the provider billed it).
        if usage < 0 and kind == b"t":  # the provider refused the call
            how = "refund"
        elif kind == b"c" or usage >= 0:
            how = "commit"
        else:  # the provider may have been called
            how = "unknown"
        _, changed, _ = self.settle(now, job.rid, how, usage, job_id=job.id)
        if changed and how == "unknown":
            self.stats["unknown_outcome"] += 1
        outcomes = {b"c": "completed", b"f": "failed", b"p": "failed", b"o": "timed out", b"r": "released"}
        outcomes |= {b"x": "cancelled", b"t": "throttled"}
        self._record_spend(job, job.rid, outcomes.get(kind, kind.decode()), usage)

    def _released(self, job: ModelJob) -> int:
        self.stats["released"] += 1
        self._emit("released", job.id)
        return 4

    def _throttled(self, now: int, job: ModelJob, retry_after: int) -> int:
        retry_after = max(retry_after, 0)
        until = now + retry_after
        c = self.control
        if until > (c.throttled_until or 0):
            c.throttled_until = until
        recover = SLOW_RECOVER * max(c.rate_ms or 0, c.tpm_ms or 0, 1000)
        if c.slow_at is None or not (0 <= now - c.slow_at < recover):
            c.slow_pm, c.slow_at = 1000, now  # a first 429 after a quiet spell: only remembered
        elif now - c.slow_at >= SLOW_QUIET_MS:
            c.slow_pm = max(SLOW_FLOOR, math.floor(slow_now(c, now) * SLOW_STEP / 1000))
            c.slow_at = now
        self.stats["throttled"] += 1
        self._emit("throttled", job.id, "retry_after_ms", retry_after)
        return 6

    def _fail(self, now: int, job: ModelJob, permanent: bool, error: str, retry_at: int) -> int:
        job.failures += 1
        job.error = error
        self.stats["failed"] += 1
        self._emit("failed", job.id, "error", error)
        if permanent or job.attempt >= job.spec.max_attempts:
            job.state, job.finished, job.dead_at, job.expires = DEAD, now, now, True
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
            # The worker was lost: the provider may have been called.
            if job.rid == f"{job.id}:{job.token}":
                if self.settle(now, job.rid, "unknown", -1)[1]:
                    self.stats["unknown_outcome"] += 1
                self._record_spend(job, job.rid, "lease lost", -1)
            job.stalls += 1
            self._emit("stalled", job_id, "worker", job.worker or "")
            if job.cancel is not None:  # its cancellation was requested: it ends here
                self._end(job, CANCELLED, now)
                self.stats["cancelled"] += 1
                self._emit("cancelled", job_id)
                cancelled += 1
            elif job.stalls > job.spec.max_stalls:
                err = (
                    f"lease expired {job.stalls} times (worker lost or hung); last worker {job.worker or '?'}"
                )
                job.state, job.finished, job.error, job.dead_at, job.expires = DEAD, now, err, now, True
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
    def cancel(self, now: int, job_id: str, ahead: bool = False) -> tuple[int, str]:
        job = self.jobs.get(job_id)
        if job is None and ahead:
            job = self.jobs[job_id] = ModelJob(job_id, 0, TOMBSTONE, now, None, CANCELLED)
            self._end(job, CANCELLED, now)
            self.stats["cancelled"] += 1
            self._emit("cancelled", job_id)
            return 1, ""
        if job is None:
            return -1, ""
        state = job.state
        if state in (WAITING, DELAYED, PARKED):
            self._end(job, CANCELLED, now)
            job.parked = None
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
                job.state, job.expires = WAITING, False
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
                # its last reservation goes with it (its idempotency key stays, to its TTL)
                if job.rid is not None and job.rid in self.resv:
                    self.forgotten[job.rid] = self.resv.pop(job.rid)
                removed += 1
        return removed

    # ---- flow controls (Queue's FlowControl methods) -----------------------------------
    def set_concurrency(self, limit: int | None) -> None:
        self.control.concurrency = limit
        self.wake = True

    def set_rate_limit(self, max_starts: int | None, per_ms: int) -> bool:
        """Queue.set_rate_limit: the paced request window (None removes every request window).
        False: refused, nothing changed: it must stay shorter and lower than each cap."""
        c = self.control
        if max_starts is None:
            return self.set_request_windows([])
        if any(ms <= per_ms or n <= max_starts for ms, n in c.rate_caps):
            return False
        return self.set_request_windows([(per_ms, max_starts), *c.rate_caps])

    def set_request_windows(self, windows: list[tuple[int, int]]) -> bool:
        """Queue.set_limits(requests=...): the windows as (ms, limit), shortest first (none
        removes them all). The starts log stays as it is."""
        c = self.control
        c.tat_req = None  # a new limit starts its pacer afresh
        if windows:
            (c.rate_ms, c.rate_max), c.rate_caps = windows[0], list(windows[1:])
        else:
            c.rate_ms, c.rate_max, c.rate_caps = None, None, []
        self.wake = True
        return True

    def set_token_rate_limit(self, tokens: int | None, per_ms: int, refund_unused: bool = False) -> bool:
        """Queue.set_token_rate_limit: the paced token window (None removes every token window).
        False: refused, nothing changed: it must stay shorter and lower than each cap."""
        c = self.control
        if tokens is None:
            return self.set_token_windows([], False)
        caps = [(ms, self.budgets[TOKEN_CAP + str(ms)].limit) for ms in c.tok_caps]
        if any(ms <= per_ms or n <= tokens for ms, n in caps):
            return False
        return self.set_token_windows([(per_ms, tokens), *caps], refund_unused)

    def set_token_windows(self, windows: list[tuple[int, int]], refund_unused: bool) -> bool:
        """Queue.set_limits(tokens=...): the windows as (ms, limit), shortest first (none
        removes them all). A window's budget keeps what it counts when its limit changes;
        the token-rate budget ('#tpm', the first) also when its window changes and while the
        limit is off; a cap that goes is deleted with its log."""
        c = self.control
        kept = {ms for ms, _ in windows[1:]}
        for ms in c.tok_caps:
            if ms not in kept:
                del self.budgets[TOKEN_CAP + str(ms)]
        self.wake = True
        c.tat_tok = None
        c.tpm_refund = bool(windows) and refund_unused
        if not windows:
            c.tpm, c.tpm_ms, c.tok_caps = False, None, []
            return True
        for i, (ms, limit) in enumerate(windows):
            name = TOKEN_RATE if i == 0 else TOKEN_CAP + str(ms)
            b = self.budgets.get(name)
            if b is None:
                self.budgets[name] = ModelBudget(name, limit, "roll", ms + c.headroom)
            else:
                b.limit, b.win, b.win_ms = limit, "roll", ms + c.headroom
        c.tpm, c.tpm_ms, c.tok_caps = True, windows[0][0], [ms for ms, _ in windows[1:]]
        return True

    def set_pacing(self, tolerance_ms: int | None, headroom_ms: int) -> None:
        """Queue.set_pacing: both pacers start afresh; the token-rate windows count over their
        nominal length plus the new headroom."""
        c = self.control
        c.tolerance = "off" if tolerance_ms is None else str(tolerance_ms)
        c.headroom_ms = headroom_ms
        c.tat_req = c.tat_tok = None
        if c.tpm:
            assert c.tpm_ms is not None
            self.budgets[TOKEN_RATE].win_ms = c.tpm_ms + headroom_ms
            for ms in c.tok_caps:
                self.budgets[TOKEN_CAP + str(ms)].win_ms = ms + headroom_ms
        self.wake = True

    def pause(self) -> None:
        self.control.paused = True

    def resume(self) -> None:
        self.control.paused = False
        self.wake = True

    def throttle(self, now: int, ms: int) -> None:
        """Queue.throttle: for ``ms`` from now (overriding any other end); 0 lifts it."""
        if ms == 0:
            self.control.throttled_until = None
            self.wake = True
        else:
            self.control.throttled_until = now + ms

    def flow(self, now: int) -> dict[str, Any]:
        """Queue.flow(now=...): consults the token-rate budget."""
        c = self.control
        tpm = self.budget_read(now, TOKEN_RATE) if c.tpm else None
        until = c.throttled_until or 0
        windows: list[dict[str, Any]] = []
        if c.rate_max is not None:
            for i, (ms, n) in enumerate([(c.rate_ms or 0, c.rate_max), *c.rate_caps]):
                count = sum(at > now - ms - c.headroom for at in self.starts.values())
                windows.append(_window("requests", n, ms, count, paced=i == 0))
        if tpm is not None:
            windows.append(_window("tokens", tpm["limit"], c.tpm_ms or 0, tpm["used"], paced=True))
            for ms in c.tok_caps:
                cap = self.budget_read(now, TOKEN_CAP + str(ms))
                assert cap is not None
                windows.append(_window("tokens", cap["limit"], ms, cap["used"], paced=False))
        return {
            "paused": c.paused,
            "throttled_until_ms": until if until > now else None,
            "concurrency": c.concurrency,
            "active": len(self.zset(ACTIVE)),
            "rate_max": c.rate_max,
            "rate_per_seconds": c.rate_ms / 1000 if c.rate_ms else None,
            "starts_in_window": (
                sum(at > now - c.rate_ms - c.headroom for at in self.starts.values()) if c.rate_ms else 0
            ),
            "token_limit": tpm["limit"] if tpm else None,
            "token_per_seconds": (c.tpm_ms or 0) / 1000 if tpm else None,
            "tokens_in_window": tpm["used"] if tpm else 0,
            "pace_tolerance_ms": None if not c.pace else c.tau_us // 1000,
            "headroom_ms": c.headroom,
            "measured_headroom_ms": 0,  # no worker of the model reports its delays
            "pace_factor_pm": slow_now(c, now),
            "follows_provider": True,  # (the model's workers report no provider's figures)
            "unseen_requests": 0,
            "windows": tuple(windows),
        }

    # ---- the ledger ----------------------------------------------------------------------
    def _consult(self, name: str, now: int) -> ModelBudget | None:
        """A budget brought up to date with ``now``: a later calendar window counts from
        zero; reservations older than a rolling window leave it."""
        b = self.budgets.get(name)
        if b is None:
            return None
        if b.calendar:
            number, _ = calendar_window(b.win, now)
            if number > (b.period or 0):  # only forward: a clock a little behind must not restart it
                b.period, b.used = number, 0
        elif b.win == "roll":
            for rid in [rid for rid, (at, _) in b.log.items() if at + b.win_ms <= now]:
                b.used -= b.log.pop(rid)[1]
        # A credit counts in its own window: for ever without one, its calendar window,
        # or until its end time (rolling).
        cp = b.credit_p or 0
        live = b.win == "" or (b.win == "roll" and now < cp) or (b.calendar and cp == b.period)
        b.live = (b.credit or 0) if (b.credit or 0) > 0 and live else 0
        return b

    def _chain(self, name: str, now: int) -> tuple[list[ModelBudget], str | None]:
        """A budget and those above it, its own first; and the first name that does not exist."""
        levels: list[ModelBudget] = []
        cur: str | None = name
        while cur is not None:
            b = self._consult(cur, now)
            if b is None:
                return levels, cur
            levels.append(b)
            cur = b.parent
        return levels, None

    def _counted(self, b: ModelBudget, r: ModelReservation, level: int) -> bool:
        """Whether reservation ``r`` (charged on ``b`` as its level ``level``) still counts in b."""
        if b.calendar:
            return r.periods[level] == b.period
        if b.win == "roll":
            return r.rid in b.log
        return True

    def _free_at(self, b: ModelBudget, need: int) -> int | None:
        """When a rolling budget will have ``need`` tokens free: the first time its reservations
        leaving the window free enough. None: never, by expiry alone."""
        short = need - (b.admits - b.used)
        assert short > 0
        freed = 0
        for at, amount in sorted(b.log.values()):
            freed += amount
            if freed >= short:
                return at + b.win_ms
        return None

    def _retry_at(self, b: ModelBudget, need: int, now: int) -> float:
        """When a budget that cannot admit ``need`` tokens may: the next calendar window, or
        when the rolling window frees enough; never (inf) for more than the limit, or
        without a window (only a raised limit helps)."""
        if need > b.admits:
            return INF
        if b.calendar:
            return calendar_window(b.win, now)[1]
        if b.win == "roll":
            at = self._free_at(b, need)
            return INF if at is None else at
        return INF

    def _charge(self, rid: str, job_id: str, levels: list[ModelBudget], amount: int, now: int) -> None:
        for b in levels:
            b.used += amount
            b.count("accepted")
            if b.win == "roll":
                b.log[rid] = (now, amount)
        periods = [b.period or 0 for b in levels]
        self.resv[rid] = ModelReservation(rid, amount, amount, [b.name for b in levels], periods, now, job_id)

    def _settle_level(self, now: int, b: ModelBudget, r: ModelReservation, d: int, job_id: str) -> bool:
        """One level of settle(): moves its count by ``d``; whether tokens went back to a budget
        with parked jobs."""
        rid = r.rid
        freed = False
        was = b.used
        b.used = max(b.used + d, 0)
        if b.win == "roll":
            b.log[rid] = (b.log[rid][0], r.amt + d)
        if d > 0 and not b.name.startswith("#"):
            b.counters["beyond"] = b.counters.get("beyond", 0) + d
            if was <= b.admits < b.used:
                self._emit(
                    "overspent",
                    job_id,
                    "budget",
                    b.name,
                    "used",
                    b.used,
                    "limit",
                    b.admits,
                    "reservation",
                    rid.removeprefix("u:"),  # a caller's, by the id it chose
                )
        if d < 0 and b.name in self.parkedby:
            self.parkedby[b.name] = now
            freed = True
        return freed

    def settle(self, now: int, rid: str, how: str, actual: int, job_id: str = "") -> tuple[str, bool, bool]:
        """Commit (``actual`` tokens; a negative one keeps the amount), refund or keep as
        unknown a held reservation. What was used is charged in full to every level, past
        its limit if need be; each level that goes past its limit gets an 'overspent'
        event (``job_id``: the job whose attempt it was). Tokens given back to a budget
        with parked jobs make those due for another try now. Returns its state, whether
        this call settled it, and whether it gave tokens back to a budget with parked
        jobs."""
        r = self.resv.get(rid)
        if r is None:
            return "missing", False, False
        if r.state != "held":
            return r.state, False, False
        target = 0 if how == "refund" else actual if how == "commit" and actual >= 0 else r.amt
        present = [(i, b) for i, name in enumerate(r.names) if (b := self._consult(name, now)) is not None]
        levels = [b for i, b in present if self._counted(b, r, i)]
        d = target - r.amt
        freed = False
        # The token-rate windows ('#...') keep what the provider's limiter counted (see ledger.lua).
        tpm_keeps = how == "commit" and d < 0 and not self.control.tpm_refund
        for b in levels:
            if not (tpm_keeps and b.name.startswith("#")):
                freed = self._settle_level(now, b, r, d, job_id) or freed
        if d > 0:
            r.beyond = d
        r.amt = target
        # Counted on every budget the reservation named, even one whose window moved on: the
        # budget counters are cumulative.
        for _, b in present:
            if how == "unknown":
                b.count("unknown")
            if how != "refund" and target > 0:
                b.counters["charged"] = b.counters.get("charged", 0) + target
        r.state = {"commit": "committed", "refund": "refunded", "unknown": "unknown"}[how]
        r.settled = now
        return r.state, True, freed

    def settle_script(self, now: int, rid: str, how: str, actual: int) -> tuple[str, bool, int, int]:
        """settle.lua: settles (waking a worker if parked jobs got tokens back) and answers
        the state, whether it changed, the tokens charged now and the usage beyond room."""
        state, changed, freed = self.settle(now, rid, how, actual)
        self.held.pop(rid, None)
        if freed:
            self.wake = True
        r = self.resv.get(rid)
        charged, beyond = (0, 0) if r is None else (r.amt, r.beyond or 0)
        return state, changed, charged, beyond

    def budget_create(
        self, now: int, name: str, limit: int, win: str, win_ms: int, parent: str | None
    ) -> int:
        """budget_put 'create': 1 created; 0 exists (left alone); -2 no such parent; -3 too deep."""
        if name in self.budgets:
            return 0
        if parent is not None:
            chain, missing = self._chain(parent, now)
            if missing is not None:
                return -2
            if len(chain) >= MAX_LEVELS:
                return -3
        period = calendar_window(win, now)[0] if win in ("day", "month") else 0
        counters = {"accepted": 0, "rejected": 0, "unknown": 0}
        self.budgets[name] = ModelBudget(name, limit, win, win_ms, parent, now, period, 0, counters)
        return 1

    def budget_change(
        self, now: int, name: str, op: str, tokens: int, op_id: str = ""
    ) -> tuple[int, int, int, str, str]:
        """budget_put 'limit', 'adjust' or 'credit': (code, limit, credit, and for -6 the op
        and budget an id was used for). 1 done; 2 the op id was applied before (what it
        left); -1 no such budget; -4 past the largest limit; -5 a limit below 0; -6 the id
        names another operation. What the window admits rising gives the budget's parked
        jobs back to waiting at once."""
        if op_id:
            prior = self.ops.get(op_id)
            if prior is not None:
                if (prior["op"], prior["budget"], int(prior["tokens"])) != (op, name, tokens):
                    return -6, 0, 0, prior["op"], prior["budget"]
                return 2, int(prior["limit"]), int(prior["credit"]), "", ""
        b = self._consult(name, now)
        if b is None:
            return -1, 0, 0, "", ""
        base, credit = b.limit, b.live
        if op == "limit":
            base = tokens
        elif op == "adjust":
            base += tokens
        else:
            credit += tokens
        if base < 0:
            return -5, b.limit, b.live, "", ""
        if base > MAX_TOKENS or base + credit > MAX_TOKENS:
            return -4, b.limit, b.live, "", ""
        before = b.admits
        b.limit, b.credit, b.live = base, credit, credit
        if op == "credit":
            b.credit_p = b.period if b.calendar else now + b.win_ms if b.win == "roll" else 0
        if op_id:
            self.ops[op_id] = {
                "op": op,
                "budget": name,
                "tokens": str(tokens),
                "limit": str(base),
                "credit": str(credit),
                "at": str(now),
            }
        # A raised limit makes the parked jobs due: the next step moves back what fits.
        if b.admits > before and name in self.parkedby:
            self.parkedby[name] = now
            self.wake = True
        return 1, base, credit, "", ""

    def budget_read(self, now: int, name: str) -> dict[str, Any] | None:
        """A budget as Budgets.get reports it (BudgetState's fields), consulting it."""
        b = self._consult(name, now)
        if b is None:
            return None
        if b.calendar:
            resets: int | None = calendar_window(b.win, now)[1]
        elif b.win == "roll" and b.log:
            resets = min(at for at, _ in b.log.values()) + b.win_ms
        else:
            resets = None
        return {
            "name": name,
            "limit": b.limit,
            "used": b.used,
            "remaining": max(b.admits - b.used, 0),
            "window": {"": None, "roll": "rolling"}.get(b.win, b.win),
            "window_seconds": b.win_ms / 1000 if b.win == "roll" else None,
            "parent": b.parent,
            "accepted": b.counters.get("accepted", 0),
            "rejected": b.counters.get("rejected", 0),
            "unknown_outcomes": b.counters.get("unknown", 0),
            "parked": len(self.parked_set(name)),
            "resets_at_ms": resets,
            "overspent": max(b.used - b.admits, 0),
            "beyond_estimates": b.counters.get("beyond", 0),
            "credit": b.live,
            "charged": b.counters.get("charged", 0),
        }

    def sweep_expired(self, now: int, limit: int) -> list[tuple[str, str, bool, int]]:
        """Callers' holds that ended by ``now`` (at most ``limit``, the first to end first),
        settled as unknown outcomes: (id, state, whether this settled it, tokens charged)."""
        due = sorted(self.held.items(), key=lambda item: (item[1], item[0].encode()))
        out = []
        for rid, deadline in due[:limit]:
            if deadline > now:
                break
            state, changed, _ = self.settle(now, rid, "unknown", -1)
            del self.held[rid]
            r = self.resv.get(rid)
            out.append((rid, state, changed, r.amt if r is not None else 0))
        return out

    def sweep_script(self, now: int, how: str, rids: list[str]) -> list[tuple[str, str, bool, int]]:
        """sweep.lua: the expired holds (no ids), or the named ones settled ``how``."""
        if not rids:
            return self.sweep_expired(now, 100)
        out = []
        for rid in rids[:100]:
            state, changed, freed = self.settle(now, rid, how, -1)
            self.held.pop(rid, None)
            self.wake = self.wake or freed
            r = self.resv.get(rid)
            out.append((rid, state, changed, r.amt if r is not None else 0))
        return out

    def reserve(
        self, now: int, name: str, tokens: int, rid: str, job_id: str, hold_ms: int = 3_600_000
    ) -> tuple[int, int, str]:
        """reserve.lua: (code, remaining, refusing or missing budget). 1 reserved; 0 refused;
        2 a duplicate id that still charges, 3 a duplicate id that was refunded, 4 one that
        was refused; -1 no such budget; -5 the id was reserved on another budget. Up to ten
        holds that ended are swept first."""
        self.sweep_expired(now, 10)
        chain, missing = self._chain(name, now)
        if missing is not None:
            return -1, 0, missing
        own = chain[0]
        prior = self.resv.get(rid)
        if prior is not None:
            if prior.names[0] != name:
                return -5, 0, prior.names[0]
            code = {"refunded": 3, "refused": 4}.get(prior.state, 2)
            return code, max(own.admits - own.used, 0), prior.by or ""
        refusing = next((b for b in chain if _refuses(b, tokens)), None)
        if refusing is not None:
            refusing.count("rejected")
            # remembered, so that asking again is answered the same
            names, periods = [b.name for b in chain], [b.period or 0 for b in chain]
            self.resv[rid] = ModelReservation(rid, 0, tokens, names, periods, now, job_id, state="refused")
            self.resv[rid].by, self.resv[rid].caller = refusing.name, True
            return 0, max(own.admits - own.used, 0), refusing.name
        self._charge(rid, job_id, chain, tokens, now)
        self.resv[rid].caller = True
        self.held[rid] = now + hold_ms
        return 1, own.admits - own.used, ""
