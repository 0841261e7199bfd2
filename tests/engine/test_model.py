"""Model-based tests: the Lua scripts against a plain-Python model of the job lifecycle,
the flow controls and the token ledger.

A hypothesis state machine applies one random sequence of operations (add,
advance or jump the clock, step with outcomes, extend, reap, cancel, redrive,
purge; set and clear the global concurrency, the request- and token-rate
limits and their longer windows (set_limits), set the pacing, pause, resume,
throttle; create budgets with and without parents and windows, top them up,
set their limits, read them; reserve, commit and refund directly) to a real
Redis, through Queue, and to tests/harness/model.py, and after every operation
compares everything: each job's hash (state, attempt, failures, stalls,
token, times, result, error, cancel request, tokens, budget, reservation id,
usage, parked budget, TTL), the four sorted sets with their scores (so the
dispatch order of waiting jobs), the sequence, idempotency keys, the
counters and counts(), the wake marker, the event stream, the control hash,
the request-rate log, every budget record (the token-rate windows' too),
rolling log, parked set and the parkedby schedule, every reservation record
(and whether it expires), and the set of keys the queue owns. Each
operation's answer is compared too (step's codes, leased jobs in order and
next_due; extend's codes; reap's totals; cancel/redrive/purge results and
errors; budget states, reservations, settlements, flow()).

Time is the model's: scripts called without ``now`` (Queue.add,
Queue.cancel, Queue.throttle) read a test clock installed with
set_test_clock in place of Redis's; step, extend, reap and the ledger calls
take ``now`` explicitly. The clock only moves forward,
in small steps (lease, rate and rolling windows are 50 ms to 2.5 s) and in
jumps to UTC day and month boundaries (so calendar windows turn).

hypothesis and pytest-asyncio do not mix, so the state machine runs its own
event loop with its own Redis client (for the session's server).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import secrets
from collections.abc import Awaitable, Iterator
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from sluice import (
    BudgetError,
    BudgetNotFound,
    ConfigurationError,
    JobNotFound,
    JobRecord,
    JobSpec,
    JobState,
    JobStateError,
    Queue,
    Reservation,
    Settlement,
)
from sluice.engine.backoff import DEFAULT_BACKOFF
from sluice.engine.budget_state import BudgetChange
from sluice.engine.clock import set_test_clock
from sluice.engine.connection import connect
from sluice.engine.keys import QueueKeys
from tests.harness.model import (
    ACTIVE,
    CANCELLED,
    DEAD,
    DELAYED,
    FINISHED_SETS,
    LIVE_SETS,
    PARKED,
    REJECTED,
    TOKEN_RATE,
    WAITING,
    AddSpec,
    LeasedJob,
    Model,
    ModelEvent,
    calendar_window,
)

T = TypeVar("T")

#: The clock starts here (ms): a realistic Unix time, so numbers render as they will in production.
#: (2023-11-14 22:13:20 UTC: the next day is 1 h 46 min away, the next month 16 days, then a new year.)
T0 = 1_700_000_000_000
#: Small, so both forms of the 'completed' event (with and without the result) happen.
EV_RESULT_MAX = 8
IDEM_KEYS = ("k1", "k2", "k3")
#: Ids callers give (the service gives its store's UUIDs): a few, so that adds meet them again.
CALLER_IDS = ("u-1", "u-2", "0192f0c4-6a1e-7b3c-8d9e-aabbccddeeff")
WORKERS = ("w1", "w2")
#: Outcome values: results are JSON, as the runner sends them (a record holding a result that is
#: not JSON does not parse), of 1, EV_RESULT_MAX, EV_RESULT_MAX + 1 and more bytes; errors are any text;
#: a throttle's value is the retry-after in ms (negative counts as 0).
RESULTS = (b"1", b'"123456"', b'"1234567"', b'"a much longer result"')
ERRORS = (b"boom", b"", b"Traceback: a long error")
RETRY_AFTERS = (b"0", b"40", b"150", b"1000", b"-20")
#: retry_at relative to now: in the past, now, and later.
RETRY_OFFSETS = (-5, 0, 1, 120, 600)
#: Tokens an attempt reports (-1: none reported), below, at and above the estimates.
USAGES = (-1, -1, -1, 0, 3, 9, 25)
LEASES_MS = (100, 250)
#: Budgets the jobs and rules name; NO_BUDGET is never created (its jobs are rejected).
BUDGETS = ("A", "B", "C")
NO_BUDGET = "Z"
#: Windows as Budgets.create takes them: none, UTC calendar, rolling (seconds).
WINDOWS: tuple[str | float | None, ...] = (None, "day", "month", 1, 2.5)
LIMITS = (0, 6, 10, 15)
#: Token estimates of jobs: a job or two fill a budget of LIMITS or a token-rate window, and
#: equal charges make a rolling window free exactly the shortfall now and then.
TOKENS = (0, 3, 5, 9)
BUDGET_TOKENS = (1, 3, 5, 9)
#: Reservation ids of direct reservations (the dispatch script's are <job id>:<token>).
RIDS = ("r1", "r2", "r3")
#: Windows (ms) and limits set_limits draws from, per kind: caps that fill within a few steps.
WINDOW_CHOICES = {
    "requests": ((50, 120, 300, 1000), (1, 2, 3, 4)),
    "tokens": ((1000, 2500, 5000), (8, 15, 25, 40)),
}


class Clock:
    """Stands in for Redis's clock in every script call without a ``now`` (set_test_clock)."""

    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock() -> Iterator[Clock]:
    c = Clock()
    set_test_clock(c)
    yield c
    set_test_clock(None)


def model_spec(spec: JobSpec) -> AddSpec:
    """What the add script receives for a JobSpec (written out here, not via Queue._encode)."""
    return AddSpec(
        name=spec.name,
        payload=json.dumps(spec.payload),
        priority=spec.priority,
        delay_ms=int(spec.delay * 1000),
        max_attempts=spec.max_attempts,
        backoff=DEFAULT_BACKOFF.to_json().decode(),
        timeout_ms=0 if spec.timeout is None else int(spec.timeout * 1000),
        max_stalls=spec.max_stalls,
        idem=spec.idempotency_key,
        tokens=spec.tokens,
        budget=spec.budget,
        on_exhausted=spec.on_exhausted,
        correlation_id=spec.correlation_id,
        trace_context=spec.trace_context,
        job_id=spec.job_id,
    )


def stored(rid: str) -> str:
    """The key name Budgets gives a caller's reservation id (apart from jobs' <id>:<token>)."""
    return "u:" + rid


def window_args(window: str | float | None) -> tuple[str, int]:
    """A Budgets.create window as the budget record stores it: (win, win_ms)."""
    if window is None:
        return "", 0
    if isinstance(window, str):
        return window, 0
    return "roll", int(window * 1000)


@st.composite
def _specs(draw: st.DrawFn) -> JobSpec:
    budget = draw(st.sampled_from([None, None, "A", "A", "B", "C", NO_BUDGET]))
    return JobSpec(
        name=draw(st.sampled_from(["a", "b"])),
        payload=draw(st.none() | st.integers(0, 9)),
        priority=draw(st.integers(0, 2)),
        delay=draw(st.sampled_from([0.0, 0.0, 0.0, 0.1, 0.25])),
        max_attempts=draw(st.sampled_from([2, 3, 1])),
        timeout=draw(st.sampled_from([None, 2.0])),
        idempotency_key=draw(st.none() | st.sampled_from(IDEM_KEYS)),
        max_stalls=draw(st.integers(0, 2)),
        # a job that spends from a budget carries an estimate (JobSpec refuses 0)
        tokens=draw(st.sampled_from(TOKENS if budget is None else BUDGET_TOKENS)),
        budget=budget,
        on_exhausted=draw(st.sampled_from(["reject", "wait", "wait"])),
        correlation_id=draw(st.sampled_from([None, None, "req-1f3a"])),
        trace_context=draw(
            st.sampled_from([None, None, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"])
        ),
        job_id=draw(st.sampled_from([None, None, None, *CALLER_IDS])),
    )


specs = _specs()

#: A drawn outcome: (job id, token), (kind, value), retry in (ms from now), tokens used.
Drawn = tuple[tuple[str, bytes], tuple[bytes, bytes], int, int]

#: (kind, value) of one outcome: a third of them completions, a fifth throttles.
outcome_values = st.sampled_from(
    [(b"c", r) for r in RESULTS] * 3
    + [(kind, e) for kind in (b"f", b"f", b"r", b"p", b"x") for e in ERRORS]
    + [(b"t", ms) for ms in RETRY_AFTERS] * 2
)


# ---- comparing Redis with the model ------------------------------------------------------------------
def _s(value: bytes) -> str:
    return value.decode()


def _score(value: float) -> float:
    """A sorted-set score: an integer (ms, or a waiting score), or inf."""
    return value if math.isinf(value) else int(value)


def _sorted(members: dict[str, float]) -> list[tuple[str, float]]:
    """Members with scores in Redis's order (score, then member bytes)."""
    return sorted(members.items(), key=lambda m: (m[1], m[0].encode()))


#: Reads every key of a queue in one call (KEYS ARGV[1]): per key its name, type, PTTL and
#: contents (a hash or a sorted set as a flat list, a string as a list of one, a stream as
#: XRANGE gives it). With ARGV[2] = '1' it then deletes the wake marker (KEYS[1]), as an idle
#: worker's BZPOPMIN would.
DUMP = """
local out = {}
for _, key in ipairs(redis.call('KEYS', ARGV[1])) do
  local kind = redis.call('TYPE', key)['ok']
  local value = {}
  if kind == 'hash' then value = redis.call('HGETALL', key)
  elseif kind == 'zset' then value = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  elseif kind == 'string' then value = {redis.call('GET', key)}
  elseif kind == 'stream' then value = redis.call('XRANGE', key, '-', '+') end
  out[#out + 1] = {key, kind, redis.call('PTTL', key), value}
end
if ARGV[2] == '1' then redis.call('DEL', KEYS[1]) end
return out
"""


def _pairs(flat: list[Any]) -> list[tuple[Any, Any]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def _event(entry: list[Any]) -> ModelEvent:
    pairs = [(_s(k), _s(v)) for k, v in _pairs(entry[1])]
    assert [k for k, _ in pairs[:2]] == ["ev", "id"], pairs
    return (pairs[0][1], pairs[1][1], *(x for pair in pairs[2:] for x in pair))


class Dump:
    """The keys of one queue as DUMP read them."""

    def __init__(self, raw: list[list[Any]]) -> None:
        self.keys = {_s(key): (_s(kind), ttl, value) for key, kind, ttl, value in raw}

    def value(self, key: str, kind: str) -> list[Any]:
        found = self.keys.get(key)
        if found is None:
            return []
        assert found[0] == kind, (key, found[0])
        return list(found[2])

    def hash(self, key: str) -> dict[str, str]:
        return {_s(f): _s(v) for f, v in _pairs(self.value(key, "hash"))}

    def zset(self, key: str) -> list[tuple[str, float]]:
        return [(_s(m), _score(float(score))) for m, score in _pairs(self.value(key, "zset"))]

    def named(self, prefix: str) -> dict[str, tuple[str, int, list[Any]]]:
        """name -> (type, PTTL, contents) of the keys ``prefix + name``."""
        return {key[len(prefix) :]: v for key, v in self.keys.items() if key.startswith(prefix)}


def _queue_sections(d: Dump, k: QueueKeys) -> dict[str, Any]:
    jobs, expiring = {}, {}
    for job_id, (_, ttl, _) in d.named(k.job_prefix).items():
        raw = dict(_pairs(d.value(k.job(job_id), "hash")))
        JobRecord.from_hash(job_id, raw, k.idem_prefix)  # every record parses
        jobs[job_id] = d.hash(k.job(job_id))
        assert ttl == -1 or ttl > 0
        expiring[job_id] = ttl > 0
    out: dict[str, Any] = {"jobs": jobs, "expiring": expiring}
    for name in LIVE_SETS:
        out[name] = d.zset(getattr(k, name))
    for name in FINISHED_SETS:
        out["finished:" + name] = d.zset(k.finished_prefix + name)
    epoch = d.value(k.epoch, "string") if k.epoch in d.keys else None
    assert epoch is None or len(_s(epoch[0])) == 16, epoch  # made by the first dispatch call
    seq = d.value(k.seq, "string")
    out["seq"] = int(seq[0]) if seq else 0
    out["stats"] = {f: int(v) for f, v in d.hash(k.stats).items()}
    out["wake"] = d.zset(k.wake)
    out["events"] = [_event(entry) for entry in d.value(k.events, "stream")]
    idem: dict[str, str] = {}
    for key, (kind, ttl, value) in d.named(k.idem_prefix).items():
        assert kind == "string" and ttl > 0, f"idempotency key {key} has no TTL"
        idem[key] = _s(value[0])
    out["idem"] = idem
    return out


def _flow_sections(d: Dump, k: QueueKeys) -> dict[str, Any]:
    out: dict[str, Any] = {"control": d.hash(k.control), "starts": d.zset(k.starts)}
    out["parkedby"] = d.zset(k.parkedby)
    out["budgets"] = {}
    for name, (_, ttl, _) in d.named(k.budget_prefix).items():
        assert ttl == -1, f"budget {name} expires"
        out["budgets"][name] = d.hash(k.budget_prefix + name)
    out["logs"] = {name: d.zset(k.budget_log_prefix + name) for name in d.named(k.budget_log_prefix)}
    out["parked"] = {name: d.zset(k.parked_prefix + name) for name in d.named(k.parked_prefix)}
    out["held"] = d.zset(k.held)
    out["ops"] = {}
    for op_id, (_, ttl, _) in d.named(k.budget_ops_prefix).items():
        assert ttl > 0, f"budget operation {op_id} does not expire"
        out["ops"][op_id] = d.hash(k.budget_ops_prefix + op_id)
    out["resv"], out["resv_expiring"] = {}, {}
    for rid, (_, ttl, _) in d.named(k.reservation_prefix).items():
        assert ttl == -1 or ttl > 0
        out["resv"][rid] = d.hash(k.reservation_prefix + rid)
        out["resv_expiring"][rid] = ttl > 0
    return out


async def redis_state(queue: Queue, take_wake: bool = False) -> dict[str, Any]:
    """Everything the queue holds in Redis, in the shape of :func:`model_state`, read in one
    call (so no key goes unseen). ``take_wake``: then delete the wake marker."""
    k = queue.keys
    # The wake marker as its key: on a cluster the script runs on the queue's master.
    raw = await queue.redis.register_script(DUMP)(keys=[k.wake], args=[k.base + "*", int(take_wake)])
    d = Dump(raw)
    return {"keys": sorted(d.keys)} | _queue_sections(d, k) | _flow_sections(d, k)


def model_state(model: Model, queue: Queue) -> dict[str, Any]:
    k = queue.keys
    logs = {name: b.log_members() for name, b in model.budgets.items() if b.log}
    parked = {name: model.parked_set(name) for name in model.budgets}
    parked = {name: members for name, members in parked.items() if members}
    keys = {k.job(i) for i in model.jobs} | {k.idem(i) for i in model.idem}
    keys |= {getattr(k, name) for name in LIVE_SETS if model.zset(name)}
    keys |= {k.finished_prefix + name for name in FINISHED_SETS if model.finished(name)}
    keys |= {k.budget_prefix + name for name in model.budgets}
    keys |= {k.budget_log_prefix + name for name in logs} | {k.parked_prefix + name for name in parked}
    keys |= {k.reservation_prefix + rid for rid in model.resv}
    keys |= {k.budget_ops_prefix + op_id for op_id in model.ops}
    for key, present in (
        (k.seq, model.seq > 0),
        (k.stats, any(model.stats.values())),
        (k.events, bool(model.events)),
        (k.wake, model.wake),
        (k.control, bool(model.control.hash())),
        (k.starts, bool(model.starts)),
        (k.parkedby, bool(model.parkedby)),
        (k.held, bool(model.held)),
        (k.epoch, model.stepped),  # its value is random: checked in _queue_sections
    ):
        if present:
            keys.add(key)
    out: dict[str, Any] = {
        "keys": sorted(keys),
        "jobs": {i: j.hash() for i, j in model.jobs.items()},
        "expiring": {i: j.expires for i, j in model.jobs.items()},
    }
    for name in LIVE_SETS:
        out[name] = model.zset(name)
    for name in FINISHED_SETS:
        out["finished:" + name] = model.finished(name)
    out["seq"] = model.seq
    out["stats"] = {name: n for name, n in model.stats.items() if n}
    out["wake"] = [("w", 0.0)] if model.wake else []
    out["events"] = model.events
    out["idem"] = dict(model.idem)
    out["control"] = model.control.hash()
    out["starts"] = _sorted(dict(model.starts))
    out["parkedby"] = _sorted(model.parkedby)
    out["budgets"] = {name: b.hash() for name, b in model.budgets.items()}
    out["logs"] = logs
    out["parked"] = parked
    out["held"] = _sorted({rid: float(at) for rid, at in model.held.items()})
    out["ops"] = model.ops
    out["resv"] = {rid: r.hash() for rid, r in model.resv.items()}
    out["resv_expiring"] = {rid: r.state != "held" or r.caller for rid, r in model.resv.items()}
    return out


def _diff(got: dict[str, Any], want: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {f: (got.get(f), want.get(f)) for f in got.keys() | want.keys() if got.get(f) != want.get(f)}


async def assert_same(queue: Queue, model: Model, take_wake: bool = False) -> None:
    """Redis and the model hold the same. ``take_wake``: then an idle worker takes the wake
    marker (BZPOPMIN; the scripts only ever put it), so that whether the next operation
    puts it back is seen."""
    model.check()
    real, expected = await redis_state(queue, take_wake), model_state(model, queue)
    # Section by section, so a failure names what differs.
    for section in expected:
        if section in ("jobs", "budgets", "resv") and real[section].keys() == expected[section].keys():
            for name, want in expected[section].items():
                diff = _diff(real[section][name], want)
                assert not diff, f"{section} {name}: field: (redis, model): {diff}"
        assert real[section] == expected[section], section
    assert await queue.counts() == model.counts()


def flat(jobs: list[LeasedJob]) -> list[bytes | int]:
    return [value for job in jobs for value in job.flat()]


# ---- the state machine --------------------------------------------------------------------------------
class QueueMachine(RuleBasedStateMachine):
    """One queue on a fresh key prefix per example; Redis and the model side by side."""

    loop: ClassVar[asyncio.AbstractEventLoop]
    redis: ClassVar[Redis]
    clock: ClassVar[Clock]

    def __init__(self) -> None:
        super().__init__()
        prefix = "m" + secrets.token_hex(5)
        self.queue = Queue("q", redis=self.redis, prefix=prefix, event_result_max_bytes=EV_RESULT_MAX)
        self.model = Model(
            ev_result_max=EV_RESULT_MAX,
            idem_prefix=self.queue.keys.idem_prefix,
        )
        self.clock.now = T0
        #: every lease ever handed out, (job id, token): reported late, they must be refused
        self.leases: list[tuple[str, bytes]] = []

    def run(self, aw: Awaitable[T]) -> T:
        async def wrap() -> T:
            return await aw

        return self.loop.run_until_complete(wrap())

    def teardown(self) -> None:
        async def clean() -> None:
            keys = await self.redis.keys(self.queue.keys.base + "*")
            if keys:
                await self.redis.delete(*keys)

        self.run(clean())

    # ---- drawing arguments from the current state ------------------------------------------------------
    def lease(self) -> st.SearchStrategy[tuple[str, bytes]]:
        """A current lease (most often), an earlier lease of a job that is active again under
        a newer token (what fencing is for), or any lease ever handed out."""
        current = [(i, str(j.token).encode()) for i, j in self.model.jobs.items() if j.state == ACTIVE]
        stale = [lease for lease in self.leases if lease[0] in dict(current) and lease not in current]
        options = [st.sampled_from(current)] * 2 if current else []
        if stale:
            options.append(st.sampled_from(stale))
        return st.one_of(*options, st.sampled_from(self.leases))

    def ids_in(self, state: str) -> list[str]:
        if state == PARKED:
            return sorted(i for i, j in self.model.jobs.items() if j.state == PARKED)
        return self.model.ids(state)

    def job_id(self, data: st.DataObject) -> str:
        """Mostly a job in a live state picked first (so that rare states get picked); else
        any id: one that exists (maybe finished), existed (purged) or never did."""
        states = sorted({j.state for j in self.model.jobs.values()} & {*LIVE_SETS, PARKED})
        if not states or data.draw(st.sampled_from([False, False, False, True]), label="any id?"):
            return data.draw(
                st.sampled_from(CALLER_IDS) | st.integers(1, self.model.seq + 1).map(str), label="id"
            )
        state = data.draw(st.sampled_from(states), label="state")
        return data.draw(st.sampled_from(self.ids_in(state)), label="id")

    def some_ids(self, data: st.DataObject) -> list[str]:
        """1-3 ids, dead ones first (hypothesis shrinks towards them), repeats allowed."""
        pool = self.model.ids(DEAD) + [str(i) for i in range(1, self.model.seq + 2)]
        return data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3), label="ids")

    def edges(self) -> list[int]:
        """How far away (ms) the next times are at which something changes by itself: the
        first lease deadline and due time, a parked budget's retry time, the end of a
        throttle, the request-rate window's and the rolling windows' first expiry."""
        m, now = self.model, self.clock.now
        times = [t for _, t in m.zset(ACTIVE)[:1] + m.zset(DELAYED)[:1]]
        times += [int(t) for t in m.parkedby.values() if not math.isinf(t)]
        c = m.control
        if c.throttled_until is not None:
            times.append(c.throttled_until)
        if c.rate_max is not None and m.starts:
            # when each request window's oldest start leaves it, and when a full one opens
            times += [min(m.starts.values()) + win for win, _ in m._request_windows()]
            ordered = sorted(m.starts.values())
            times += [ordered[-most] + win for win, most in m._request_windows() if most <= len(ordered)]
        # when the pacers let the next start go
        times += [math.ceil((tat - c.tau_us) / 1000) for tat in (c.tat_req, c.tat_tok) if tat is not None]
        times += [min(at for at, _ in b.log.values()) + b.win_ms for b in m.budgets.values() if b.log]
        return sorted({t - now for t in times if t >= now})

    def has_jobs(self) -> bool:
        return bool(self.model.jobs)

    def has_leases(self) -> bool:
        return bool(self.leases)

    def has_active(self) -> bool:
        return any(j.state == ACTIVE for j in self.model.jobs.values())

    def has_dead(self) -> bool:
        return any(j.state == DEAD for j in self.model.jobs.values())

    # ---- the check after every operation ----------------------------------------------------------------
    @invariant()
    def same_state(self) -> None:
        """After every operation; then an idle worker takes the wake marker, so that every
        operation's decision to put it back (or not) is seen."""
        self.run(assert_same(self.queue, self.model, take_wake=True))
        self.model.wake = False

    # ---- operations -------------------------------------------------------------------------------------
    @initialize(batch=st.lists(specs, min_size=1, max_size=5))
    def first_jobs(self, batch: list[JobSpec]) -> None:
        self.add(batch)

    @rule(batch=st.lists(specs, min_size=1, max_size=4))
    def add(self, batch: list[JobSpec]) -> None:
        expected = self.model.add(self.clock.now, [model_spec(s) for s in batch])
        if isinstance(expected, str):
            with pytest.raises(BudgetNotFound) as refused:
                self.run(self.queue.add_bulk(batch))
            assert refused.value.name == expected
            event("add: refused, a job names a budget that does not exist")
            return
        jobs = self.run(self.queue.add_bulk(batch))
        assert [(j.id, j.created) for j in jobs] == expected
        if not all(created for _, created in expected):
            event("add: an idempotency key named an existing job")

    @rule(data=st.data(), how=st.sampled_from(["ms", "ms", "edge", "edge", "calendar"]))
    def advance(self, data: st.DataObject, how: str) -> None:
        """Move the clock on by some ms, to (or just before or after) the next time something
        changes by itself (the edges), or to just before, at or after the next UTC day or
        month, or an hour on."""
        now = self.clock.now
        edges = self.edges()
        if how == "ms" or (how == "edge" and not edges):
            self.clock.now += data.draw(st.sampled_from([1, 50, 99, 100, 150, 250, 400]), label="ms")
        elif how == "edge":
            edge = data.draw(st.sampled_from(edges), label="to the edge at ms")
            self.clock.now += max(edge + data.draw(st.sampled_from([0, 0, -1, 1]), label="off by"), 0)
        else:
            day, month = calendar_window("day", now)[1], calendar_window("month", now)[1]
            targets = [day - 1, day, day + 1, month - 1, month, now + 3_600_000]
            self.clock.now = data.draw(st.sampled_from(targets), label="jump to")

    def do_step(self, want: int, lease_ms: int, worker: str, drawn: list[Drawn]) -> None:
        now = self.clock.now
        outcomes = [
            (job_id, token, kind, value, off, usage) for (job_id, token), (kind, value), off, usage in drawn
        ]
        before = len(self.model.events)
        codes, next_due, leased = self.model.step(now, want, lease_ms, worker, outcomes)
        reply = self.run(
            self.queue.protocol.step(
                now=now, want=want, lease_ms=lease_ms, worker_id=worker, outcomes=outcomes
            )
        )
        assert reply.codes == codes
        assert reply.jobs == flat(leased)
        assert reply.next_due == next_due
        self.leases += [(j.id.decode(), str(j.token).encode()) for j in leased]
        for (_, _, kind, _, _, usage), code in zip(outcomes, codes, strict=True):
            event(f"step: outcome {kind.decode()} -> {code}{'' if usage < 0 else ' with usage'}")
        event(f"step: leased {len(leased)} of {want}")
        if self.model.paced:
            event("step: a pacer refused")
        for capped in self.model.capped:
            event(f"step: a longer {capped} window was full")
        for ev in {e[0] for e in self.model.events[before:]} & {"rejected", "parked", "throttled"}:
            event(f"step: {ev}")

    @rule(
        data=st.data(),
        want=st.sampled_from([1, 2, 3, 0]),
        lease_ms=st.sampled_from(LEASES_MS),
        worker=st.sampled_from(WORKERS),
    )
    def step(self, data: st.DataObject, want: int, lease_ms: int, worker: str) -> None:
        """Report a few outcomes (current leases or stale ones, repeats allowed), lease more."""
        drawn: list[Drawn] = []
        if self.leases:
            outcome = st.tuples(
                self.lease(), outcome_values, st.sampled_from(RETRY_OFFSETS), st.sampled_from(USAGES)
            )
            size = 3 if self.has_active() else 1
            drawn = data.draw(st.lists(outcome, max_size=size), label="outcomes")
        self.do_step(want, lease_ms, worker, drawn)

    @rule(
        want=st.sampled_from([1, 2, 3]), lease_ms=st.sampled_from(LEASES_MS), worker=st.sampled_from(WORKERS)
    )
    def take(self, want: int, lease_ms: int, worker: str) -> None:
        """An idle worker asks for jobs (so that dispatch happens often enough for the gates,
        budgets and windows to fill up)."""
        self.do_step(want, lease_ms, worker, [])

    @precondition(has_active)
    @rule(
        data=st.data(),
        want=st.sampled_from([1, 2, 3, 0]),
        lease_ms=st.sampled_from(LEASES_MS),
        worker=st.sampled_from(WORKERS),
    )
    def finish_all(self, data: st.DataObject, want: int, lease_ms: int, worker: str) -> None:
        """Report an outcome for every current lease, lease more."""
        current = [(i, str(j.token).encode()) for i, j in self.model.jobs.items() if j.state == ACTIVE]
        drawn = [
            (
                lease,
                data.draw(outcome_values, label="outcome"),
                data.draw(st.sampled_from(RETRY_OFFSETS)),
                data.draw(st.sampled_from(USAGES)),
            )
            for lease in current
        ]
        self.do_step(want, lease_ms, worker, drawn)

    @precondition(has_leases)
    @rule(data=st.data(), lease_ms=st.sampled_from(LEASES_MS))
    def extend(self, data: st.DataObject, lease_ms: int) -> None:
        leases = data.draw(st.lists(self.lease(), min_size=1, max_size=3), label="leases")
        now = self.clock.now
        expected = self.model.extend(now, lease_ms, leases)
        assert self.run(self.queue.protocol.extend(now=now, lease_ms=lease_ms, leases=leases)) == expected
        for code in expected:
            event(f"extend -> {code}")

    @precondition(has_active)
    @rule(limit=st.sampled_from([1000, 1, 2]), jump=st.sampled_from(["no", "first", "last"]))
    def reap(self, limit: int, jump: str) -> None:
        if jump != "no":  # first move the clock on to the earliest or the latest lease deadline
            deadlines = [d for _, d in self.model.zset(ACTIVE)]
            self.clock.now = max(self.clock.now, deadlines[0] if jump == "first" else deadlines[-1])
        now = self.clock.now
        unknown = self.model.stats["unknown_outcome"]
        expected = self.model.reap(now, limit)
        assert self.run(self.queue.protocol.reap(now=now, limit=limit)) == expected
        event(f"reap: returned {min(expected[0], 2)}+, dead {min(expected[1], 2)}+")
        if self.model.stats["unknown_outcome"] > unknown:
            event("reap: a reservation kept as unknown")

    @precondition(has_jobs)
    @rule(data=st.data(), api=st.booleans(), ahead=st.sampled_from([False, False, True]))
    def cancel(self, data: st.DataObject, api: bool, ahead: bool) -> None:
        job_id = self.job_id(data)
        ahead = ahead and not job_id.isdigit()  # (the engine's numbers are never cancelled ahead)
        now = self.clock.now
        code, state = self.model.cancel(now, job_id, ahead)
        event(f"cancel: {state or 'missing'} -> {code}")
        if not api:  # the script itself: its code and the state it found
            core = self.queue.core
            reply = self.run(core.run(core.commands.cancel(job_id, ahead=ahead, now=now)))
            assert [reply[0], _s(reply[1])] == [code, state]
        elif code == -1:
            with pytest.raises(JobNotFound):
                self.run(self.queue.cancel(job_id))
        else:
            assert self.run(self.queue.cancel(job_id, ahead=ahead)) is (code > 0)

    @precondition(has_dead)
    @rule(data=st.data(), everything=st.booleans())
    def redrive(self, data: st.DataObject, everything: bool) -> None:
        if everything:
            ids = self.model.ids(DEAD)
            codes = self.model.redrive(ids) if ids else []
            assert self.run(self.queue.redrive()) == codes.count(1)
            event(f"redrive all: {min(len(ids), 2)}+")
            return
        ids = self.some_ids(data)
        # Queue.redrive checks every id first and refuses the whole call, changing nothing,
        # if one is missing or not dead; a repeated id is redriven once.
        jobs = self.model.jobs
        bad = next((i for i in ids if i not in jobs or jobs[i].state != DEAD), None)
        if bad is None:
            codes = self.model.redrive(ids)
            event(f"redrive ids -> {sorted(set(codes))}")
            assert self.run(self.queue.redrive(ids)) == codes.count(1)
        else:
            event("redrive ids -> refused")
            with pytest.raises(JobNotFound if bad not in jobs else JobStateError):
                self.run(self.queue.redrive(ids))

    @precondition(has_dead)
    @rule(data=st.data(), everything=st.booleans())
    def purge(self, data: st.DataObject, everything: bool) -> None:
        ids = self.model.ids(DEAD) if everything else self.some_ids(data)
        removed = self.model.purge(ids)
        assert self.run(self.queue.purge_dead(None if everything else ids)) == removed
        event(f"purge {'all' if everything else 'ids'}: removed {min(removed, 2)}+")

    # ---- flow controls ----------------------------------------------------------------------------------
    @rule(
        data=st.data(),
        gate=st.sampled_from(
            ["concurrency", "rate", "token rate", "windows", "pacing", "pause or resume", "throttle"]
        ),
    )
    def flow(self, data: st.DataObject, gate: str) -> None:
        """Set or clear one of the queue's gates (through Queue's FlowControl methods)."""
        m, q = self.model, self.queue
        event(f"flow: {gate}")
        if gate == "concurrency":
            limit = data.draw(st.sampled_from([None, 1, 2, 3]), label="limit")
            m.set_concurrency(limit)
            self.run(q.set_global_concurrency(limit))
        elif gate == "rate":
            most = data.draw(st.sampled_from([None, 1, 2, 3]), label="max starts")
            per_ms = data.draw(st.sampled_from([50, 120, 200]), label="per ms")
            self.refused_unless(m.set_rate_limit(most, per_ms), q.set_rate_limit(most, per_ms / 1000))
        elif gate == "token rate":
            tokens = data.draw(st.sampled_from([None, 8, 15, 40]), label="tokens")
            per_ms = data.draw(st.sampled_from([1000, 2500]), label="per ms")
            refund = data.draw(st.booleans(), label="refund unused")
            self.refused_unless(
                m.set_token_rate_limit(tokens, per_ms, refund),
                q.set_token_rate_limit(tokens, per_ms / 1000, refund_unused=refund),
            )
        elif gate == "windows":
            self.set_windows(data)
        elif gate == "pacing":
            tolerance = data.draw(st.sampled_from([None, 0, 20, 100]), label="tolerance ms")
            headroom = data.draw(st.sampled_from([0, 0, 30]), label="headroom ms")
            m.set_pacing(tolerance, headroom)
            self.run(q.set_pacing(tolerance_ms=tolerance, headroom_ms=headroom))
        elif gate == "throttle":
            ms = data.draw(st.sampled_from([0, 0, 50, 200]), label="ms")
            m.throttle(self.clock.now, ms)
            self.run(q.throttle(ms / 1000))
        elif m.control.paused:
            m.resume()
            self.run(q.resume())
        else:
            m.pause()
            self.run(q.pause())

    def refused_unless(self, accepted: bool, change: Awaitable[None]) -> None:
        """A change of the paced window: the model says whether the caps let it through."""
        if accepted:
            self.run(change)
        else:
            event("flow: a paced window refused (not shorter and lower than a cap)")
            with pytest.raises(ConfigurationError):
                self.run(change)

    def set_windows(self, data: st.DataObject) -> None:
        """Queue.set_limits: one to three windows of requests, of tokens, or both (an empty
        dict removes a kind's), each longer one admitting more."""
        m = self.model
        both = ("requests", "tokens")
        kinds = data.draw(st.sampled_from([both[:1], both[1:], both]), label="kinds")
        given: dict[str, dict[float, int]] = {}
        for kind in kinds:
            pers, limits = WINDOW_CHOICES[kind]
            size = data.draw(st.sampled_from([0, 1, 2, 2, 3]), label=f"{kind} windows")
            ms = sorted(data.draw(st.lists(st.sampled_from(pers), min_size=size, max_size=size, unique=True)))
            most = sorted(
                data.draw(st.lists(st.sampled_from(limits), min_size=size, max_size=size, unique=True))
            )
            given[kind] = {w / 1000: n for w, n in zip(ms, most, strict=True)}
            event(f"flow: {len(ms)} {kind} windows")
        refund = "tokens" in given and data.draw(st.booleans(), label="refund unused")
        if "requests" in given:
            m.set_request_windows([(round(w * 1000), n) for w, n in given["requests"].items()])
        if "tokens" in given:
            m.set_token_windows([(round(w * 1000), n) for w, n in given["tokens"].items()], refund)
        self.run(self.queue.set_limits(**given, refund_unused=refund))

    @precondition(lambda self: self.model.control.paused)
    @rule()
    def resume(self) -> None:
        """(Also in flow: this makes pauses short enough for the rest to happen.)"""
        self.model.resume()
        self.run(self.queue.resume())

    # ---- the ledger -------------------------------------------------------------------------------------
    def budget_name(self) -> st.SearchStrategy[str]:
        """Mostly a budget that exists; sometimes one that does not."""
        names = sorted(name for name in self.model.budgets if not name.startswith("#"))
        missing = st.sampled_from([*BUDGETS, NO_BUDGET])
        return st.one_of(st.sampled_from(names), st.sampled_from(names), missing) if names else missing

    def create_budget(
        self, name: str, limit: int, window: str | float | None, parent: str | None, exist_ok: bool
    ) -> None:
        now = self.clock.now
        code = self.model.budget_create(now, name, limit, *window_args(window), parent)
        event(f"budget: create -> {code}")
        b = self.queue.budgets
        create = b.create(name, limit, window=window, parent=parent, exist_ok=exist_ok, now=now)
        if code == 1 or (code == 0 and exist_ok):
            state = self.run(create)
            assert dataclasses.asdict(state) == self.model.budget_read(now, name)
        else:
            with pytest.raises(BudgetError):
                self.run(create)

    @initialize(
        levels=st.lists(
            st.tuples(st.sampled_from(LIMITS), st.sampled_from(WINDOWS), st.booleans()),
            min_size=1,
            max_size=len(BUDGETS),
        )
    )
    def first_budgets(self, levels: list[tuple[int, str | float | None, bool]]) -> None:
        """Every example starts with budget A, most with B and C too, often nested (C under B under A)."""
        for i, (limit, window, nested) in enumerate(levels):
            self.create_budget(BUDGETS[i], limit, window, BUDGETS[i - 1] if i and nested else None, False)

    @initialize(
        tokens=st.sampled_from([None, None, 8, 15]),
        starts=st.sampled_from([None, None, 1, 2]),
        concurrency=st.sampled_from([None, None, None, 2]),
        pacing=st.sampled_from([None, None, (None, 0), (100, 30)]),
        caps=st.sampled_from([False, False, True]),
    )
    def first_gates(
        self,
        tokens: int | None,
        starts: int | None,
        concurrency: int | None,
        pacing: tuple[int | None, int] | None,
        caps: bool,
    ) -> None:
        """Half the examples start with a token-rate limit, half with a request-rate limit
        (the window: 120 ms), a third of those with a longer window beside it (set_limits); a
        quarter with a global concurrency; half with the default pacing, a quarter without a
        pacer, a quarter with a wide tolerance and headroom."""
        m, q = self.model, self.queue
        if pacing is not None:
            m.set_pacing(*pacing)
            self.run(q.set_pacing(tolerance_ms=pacing[0], headroom_ms=pacing[1]))
        if tokens is not None:
            m.set_token_windows([(1000, tokens), *([(2500, tokens + 7)] if caps else [])], False)
            self.run(q.set_limits(tokens={1: tokens, **({2.5: tokens + 7} if caps else {})}))
        if starts is not None:
            m.set_request_windows([(120, starts), *([(300, starts + 1)] if caps else [])])
            self.run(q.set_limits(requests={0.12: starts, **({0.3: starts + 1} if caps else {})}))
        if concurrency is not None:
            m.set_concurrency(concurrency)
            self.run(q.set_global_concurrency(concurrency))

    @rule(data=st.data(), op=st.sampled_from(["create", "credit", "adjust", "set limit"]))
    def budget(self, data: st.DataObject, op: str) -> None:
        """Create a budget (maybe under a parent, maybe one that exists, or under one that
        does not), credit its window, adjust or set its limit (what the window admits rising
        gives back its parked jobs), maybe under an operation id that may have been used."""
        if op == "create":
            name = data.draw(st.sampled_from(BUDGETS), label="name")
            parent = data.draw(st.sampled_from([None, *(b for b in BUDGETS if b != name), NO_BUDGET]))
            limit = data.draw(st.sampled_from(LIMITS), label="limit")
            window = data.draw(st.sampled_from(WINDOWS), label="window")
            self.create_budget(name, limit, window, parent, data.draw(st.booleans(), label="exist_ok"))
            return
        name = data.draw(self.budget_name(), label="name")
        choices = {"credit": [1, 5, 12], "adjust": [-30, -5, 1, 7], "set limit": [*LIMITS, 30]}[op]
        tokens = data.draw(st.sampled_from(choices), label="tokens")
        op_id = data.draw(st.sampled_from(["", "", "op-1", "op-2"]), label="op id")
        now = self.clock.now
        before = len(self.model.events)
        script_op = {"credit": "credit", "adjust": "adjust", "set limit": "limit"}[op]
        code, limit, credit, _, _ = self.model.budget_change(now, name, script_op, tokens, op_id)
        b = self.queue.budgets
        call = {"credit": b.credit, "adjust": b.adjust, "set limit": b.set_limit}[op]
        change = call(name, tokens, op_id=op_id or None, now=now)
        if code < 0:
            with pytest.raises(BudgetError):
                self.run(change)
        else:
            assert self.run(change) == BudgetChange(name, limit, credit, applied=code == 1)
        event(f"budget: {op} -> {code}{' (parked jobs back)' if len(self.model.events) > before else ''}")

    @rule(
        data=st.data(),
        op=st.sampled_from(["reserve", "commit", "refund", "settle an attempt's", "sweep", "read"]),
    )
    def ledger(self, data: st.DataObject, op: str) -> None:
        """Reserve, commit or refund directly (Budgets keeps callers' reservations apart from
        the dispatch script's, under u:<id>); settle a job's reservation with the settle
        script; read flow() and budgets (reading brings their windows up to date)."""
        attempts = sorted(r for r in self.model.resv if r[0].isdigit())
        if op == "settle an attempt's" and attempts:
            self.settle_attempt(data, attempts)
        elif op in ("commit", "refund"):
            self.settle(data, op)
        elif op == "reserve":
            self.reserve(data)
        elif op == "sweep":
            self.sweep(data)
        else:
            self.read(data)

    def reserve(self, data: st.DataObject) -> None:
        now = self.clock.now
        rid = data.draw(st.sampled_from(RIDS), label="reservation")
        name = data.draw(self.budget_name(), label="budget")
        tokens = data.draw(st.sampled_from([0, 2, 5, 15]), label="tokens")
        job_id = data.draw(st.sampled_from(["", "7"]), label="job id")
        hold = data.draw(st.sampled_from([1, 3600]), label="hold (s)")
        code, remaining, other = self.model.reserve(now, name, tokens, stored(rid), job_id, hold * 1000)
        event(f"ledger: reserve -> {code}")
        reserve = self.queue.budgets.reserve(name, tokens, rid, job_id=job_id, hold=hold, now=now)
        if code in (-1, -5):
            with pytest.raises(BudgetError):
                self.run(reserve)
        else:
            expected = Reservation(rid, code in (1, 2), remaining, other or None, code in (2, 3, 4))
            assert self.run(reserve) == expected

    def settle(self, data: st.DataObject, how: str) -> None:
        now = self.clock.now
        rid = data.draw(st.sampled_from(RIDS), label="reservation")
        used = data.draw(st.sampled_from([0, 3, 9, 25]), label="used") if how == "commit" else 0
        state, changed, charged, over = self.model.settle_script(now, stored(rid), how, used)
        event(f"ledger: {how} -> {state}{' (changed)' if changed else ''}")
        b = self.queue.budgets
        got = self.run(b.commit(rid, used, now=now) if how == "commit" else b.refund(rid, now=now))
        assert got == Settlement(rid, state, changed, charged, over)

    def sweep(self, data: st.DataObject) -> None:
        """Budgets.sweep: the holds whose time ran out, or named ones (held or not) settled
        as unknown outcomes or refunded."""
        now = self.clock.now
        named = data.draw(st.booleans(), label="named")
        rids = (
            data.draw(st.lists(st.sampled_from(RIDS), min_size=1, max_size=3, unique=True), label="ids")
            if named
            else []
        )
        refund = named and data.draw(st.booleans(), label="refund")
        want = self.model.sweep_script(now, "refund" if refund else "unknown", [stored(r) for r in rids])
        event(f"ledger: sweep{' named' if named else ''} -> {len(want)}")
        got = self.run(self.queue.budgets.sweep(rids if named else None, refund=refund, now=now))
        assert got == [
            Settlement(rid.removeprefix("u:"), state, changed, amt, 0) for rid, state, changed, amt in want
        ]

    def settle_attempt(self, data: st.DataObject, attempts: list[str]) -> None:
        """The settle script on a job's reservation (as a handler's own bookkeeping might):
        the job's outcome then finds it settled."""
        rid = data.draw(st.sampled_from(attempts), label="rid")
        how = data.draw(st.sampled_from(["commit", "refund", "unknown"]), label="how")
        used = data.draw(st.sampled_from([-1, 0, 3, 9, 25]), label="used") if how == "commit" else -1
        now = self.clock.now
        state, changed, charged, over = self.model.settle_script(now, rid, how, used)
        event(f"ledger: settle an attempt's: {how} -> {state}{' (changed)' if changed else ''}")
        core = self.queue.core
        reply = self.run(core.run(core.commands.settle(now=now, reservation=rid, how=how, tokens=used)))
        assert [_s(reply[0]), *reply[1:]] == [state, int(changed), charged, over]

    def read(self, data: st.DataObject) -> None:
        """Queue.flow() and budgets as they stand (reading brings their windows up to date)."""
        now = self.clock.now
        assert dataclasses.asdict(self.run(self.queue.flow(now=now))) == self.model.flow(now)
        names = data.draw(st.lists(self.budget_name(), max_size=3), label="budgets")
        states = self.run(self.queue.budgets.get_many(names, now=now))
        got = [None if s is None else dataclasses.asdict(s) for s in states]
        assert got == [self.model.budget_read(now, name) for name in names]


@pytest.fixture
def machine_loop(redis_url: str, clock: Clock) -> Iterator[None]:
    """The machine's own event loop and client, for this test's Redis server."""
    loop = asyncio.new_event_loop()
    QueueMachine.loop = loop
    QueueMachine.redis = connect(redis_url)
    QueueMachine.clock = clock
    try:
        yield
    finally:
        loop.run_until_complete(QueueMachine.redis.aclose())
        loop.close()


# Passing takes about 20 s per Redis server (120 examples of up to 40 operations, each
# followed by the full comparison); a failure is shrunk for up to 5 minutes (hypothesis's
# limit) before it is reported, which the default pytest timeout would cut short.
@pytest.mark.timeout(600)
def test_scripts_match_model(machine_loop: None) -> None:
    run_state_machine_as_test(
        QueueMachine,
        settings=settings(
            max_examples=120,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


#: Jobs that only the flow gates decide on: no budget, token estimates from TOKENS.
plain_specs = st.builds(
    JobSpec,
    name=st.just("a"),
    priority=st.integers(0, 1),
    max_attempts=st.sampled_from([2, 3]),
    tokens=st.sampled_from(TOKENS),
)


class WindowsMachine(QueueMachine):
    """The same machine with every example starting with two or three windows of each kind,
    the longer ones tight enough to fill within a few steps, and more jobs without budgets:
    the windows beyond the paced one (set_limits) decide often."""

    @initialize(batch=st.lists(plain_specs, min_size=4, max_size=8))
    def first_jobs(self, batch: list[JobSpec]) -> None:
        self.add(batch)

    @initialize(
        requests=st.lists(st.sampled_from([(50, 1), (120, 2), (400, 3), (1000, 4)]), min_size=2, max_size=3),
        tokens=st.lists(st.sampled_from([(1000, 12), (2500, 18), (5000, 25)]), min_size=2, max_size=3),
        pacing=st.sampled_from([None, (None, 0), (100, 30)]),
    )
    def first_gates(
        self,
        requests: list[tuple[int, int]],
        tokens: list[tuple[int, int]],
        pacing: tuple[int | None, int] | None,
    ) -> None:
        m, q = self.model, self.queue
        if pacing is not None:
            m.set_pacing(*pacing)
            self.run(q.set_pacing(tolerance_ms=pacing[0], headroom_ms=pacing[1]))
        given = {
            kind: dict(sorted(set(windows))) for kind, windows in (("requests", requests), ("tokens", tokens))
        }
        m.set_request_windows(sorted(given["requests"].items()))
        m.set_token_windows(sorted(given["tokens"].items()), False)
        self.run(
            q.set_limits(
                requests={ms / 1000: n for ms, n in given["requests"].items()},
                tokens={ms / 1000: n for ms, n in given["tokens"].items()},
            )
        )

    @rule(batch=st.lists(plain_specs, min_size=2, max_size=5))
    def add_plain(self, batch: list[JobSpec]) -> None:
        self.add(batch)

    @rule(
        data=st.data(),
        ms=st.sampled_from([0, 20, 60, 130, 400]),
        rounds=st.integers(2, 6),
        worker=st.sampled_from(WORKERS),
    )
    def work_a_while(self, data: st.DataObject, ms: int, rounds: int, worker: str) -> None:
        """A worker that completes what it runs and takes more, a few times ``ms`` apart."""
        for _ in range(rounds):
            self.clock.now += ms
            current = [(i, str(j.token).encode()) for i, j in self.model.jobs.items() if j.state == ACTIVE]
            usages = data.draw(
                st.lists(st.sampled_from(USAGES), min_size=len(current), max_size=len(current))
            )
            drawn = [(lease, (b"c", b"1"), 0, usage) for lease, usage in zip(current, usages, strict=True)]
            self.do_step(2, 250, worker, drawn)


@pytest.mark.timeout(600)
def test_windows_match_model(machine_loop: None) -> None:
    """The caps of set_limits, full and emptying, against the model (about 10 s per Redis server)."""
    run_state_machine_as_test(
        WindowsMachine,
        settings=settings(
            max_examples=50,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# ---- focused examples -----------------------------------------------------------------------------------
@pytest.fixture
def q(queue: Queue, clock: Clock) -> Queue:
    """The conftest queue; its add and cancel read the test's clock."""
    return queue


async def test_model_reference_sequence(q: Queue, clock: Clock) -> None:
    """A fixed sequence touching every operation, checked against the model step by step."""
    m = Model(ev_result_max=q.event_result_max_bytes, idem_prefix=q.keys.idem_prefix)

    async def add(spec: JobSpec) -> str:
        answer = m.add(clock.now, [model_spec(spec)])
        assert not isinstance(answer, str), (
            f"the reference sequence adds to budget {answer}, which is missing"
        )
        (expected,) = answer
        job = await q.add_bulk([spec])
        assert (job[0].id, job[0].created) == expected
        await assert_same(q, m)
        return job[0].id

    a = await add(JobSpec("a", 1, priority=1, max_attempts=2))
    b = await add(JobSpec("a", 2, priority=0, delay=0.1, idempotency_key="k1"))
    assert await add(JobSpec("a", 3, idempotency_key="k1")) == b
    c = await add(JobSpec("a", 4, priority=1, max_stalls=0))

    async def step(now: int, want: int, outcomes: list[tuple[str, bytes, bytes, bytes, int, int]]) -> None:
        codes, next_due, leased = m.step(now, want, 100, "w", outcomes)
        reply = await q.protocol.step(now=now, want=want, lease_ms=100, worker_id="w", outcomes=outcomes)
        assert (reply.codes, reply.next_due, reply.jobs) == (codes, next_due, flat(leased))
        await assert_same(q, m)

    def state(job_id: str) -> tuple[str, int, int, int, int]:
        j = m.jobs[job_id]
        return j.state, j.attempt, j.token, j.failures, j.stalls

    now = clock.now
    d = await add(JobSpec("a", 5, priority=2))
    await step(now, 1, [])  # a (priority 1, first in line; b is not due)
    await step(now + 100, 2, [(a, b"1", b"f", b"e", 50, -1)])  # a retries later; b is due: b, c
    assert [state(i)[0] for i in (a, b, c, d)] == [DELAYED, ACTIVE, ACTIVE, WAITING]
    assert await q.cancel(b) is True  # running: a cancel request
    m.cancel(clock.now, b)
    leases = [(b, b"1"), (c, b"1"), (a, b"1")]
    assert await q.protocol.extend(now=now + 120, lease_ms=100, leases=leases) == m.extend(
        now + 120, 100, leases
    )
    assert m.extend(now + 120, 100, leases) == [2, 1, 0]
    # Both leases expire: b (cancel requested) is cancelled, c dead (max_stalls 0).
    assert await q.protocol.reap(now=now + 300) == m.reap(now + 300, 1000) == (0, 1)
    await assert_same(q, m)
    assert [state(i) for i in (b, c)] == [(CANCELLED, 1, 1, 0, 1), (DEAD, 1, 1, 0, 1)]
    await step(now + 300, 3, [(b, b"1", b"x", b"", 0, -1)])  # stale: refused; a due again: a, d
    assert [state(i) for i in (a, d)] == [(ACTIVE, 2, 2, 1, 0), (ACTIVE, 1, 1, 0, 0)]
    assert await q.cancel(d) is True
    m.cancel(clock.now, d)
    await step(now + 305, 0, [(d, b"1", b"f", b"e", 0, -1)])  # a failure, but cancelled
    assert state(d) == (CANCELLED, 1, 1, 0, 0) and m.jobs[d].error == "e"
    await step(now + 310, 0, [(a, b"2", b"f", b"e", 0, -1)])  # attempts spent: dead
    assert state(a) == (DEAD, 2, 2, 2, 0)
    assert await q.redrive() == m.redrive(m.ids(DEAD)).count(1) == 2  # c, then a
    await assert_same(q, m)
    await step(now + 320, 3, [])  # a and c, in line by priority and sequence
    assert [state(i) for i in (a, c)] == [(ACTIVE, 1, 3, 0, 0), (ACTIVE, 1, 2, 0, 0)]
    await step(now + 325, 0, [(a, b"3", b"f", b"e", 0, -1)])  # a retry due now: straight to waiting
    assert state(a) == (WAITING, 1, 3, 1, 0) and m.jobs[a].due == now + 150  # (from the first retry)
    await step(now + 326, 1, [])
    # Results of exactly the event limit and one byte more: only the first travels in the event.
    limit = q.event_result_max_bytes
    fits, too_big = b'"' + b"x" * (limit - 2) + b'"', b'"' + b"x" * (limit - 1) + b'"'
    await step(now + 330, 0, [(a, b"4", b"c", fits, 0, -1), (c, b"2", b"c", too_big, 0, -1)])
    assert m.events[-2:] == [("completed", a, "result", fits.decode()), ("completed", c)]
    assert (await q.counts())["completed"] == 2


async def test_gates_and_ledger_reference_sequence(q: Queue, clock: Clock) -> None:
    """A fixed sequence through the edges the machine seldom lines up, checked against the
    model step by step (wake marker included): tokens given back by a settle outside dispatch;
    a repeated id of a refunded reservation; a commit of exactly the estimate (nothing given
    back); a rolling window that frees exactly the shortfall, and a charge leaving it at the
    very millisecond; parkedby keeping the earliest retry time ('LT'); an unchanged limit
    leaving parked jobs alone; refunds handing parked jobs back in the same call; a throttle
    that a shorter one does not shorten, closed until its last millisecond; the token-rate
    window blocking the line and taking overuse in full; the request-rate window; a
    reservation settled after its calendar window turned. The logs alone: no pacer."""
    m = Model(ev_result_max=q.event_result_max_bytes, idem_prefix=q.keys.idem_prefix)
    b = q.budgets
    m.set_pacing(None, 0)
    await q.set_pacing(tolerance_ms=None, headroom_ms=0)

    async def check() -> None:
        await assert_same(q, m, take_wake=True)
        m.wake = False

    async def add(spec: JobSpec) -> str:
        answer = m.add(clock.now, [model_spec(spec)])
        assert not isinstance(answer, str), (
            f"the reference sequence adds to budget {answer}, which is missing"
        )
        (expected,) = answer
        job = await q.add_bulk([spec])
        assert (job[0].id, job[0].created) == expected
        await check()
        return job[0].id

    async def step(want: int, outcomes: list[tuple[str, bytes, bytes, bytes, int, int]]) -> int:
        now = clock.now
        codes, next_due, leased = m.step(now, want, 5000, "w", outcomes)
        reply = await q.protocol.step(now=now, want=want, lease_ms=5000, worker_id="w", outcomes=outcomes)
        assert (reply.codes, reply.next_due, reply.jobs) == (codes, next_due, flat(leased))
        await check()
        return next_due

    async def create(name: str, limit: int, window: str | float | None) -> None:
        assert m.budget_create(clock.now, name, limit, *window_args(window), None) == 1
        state = await b.create(name, limit, window=window, now=clock.now)
        assert dataclasses.asdict(state) == m.budget_read(clock.now, name)
        await check()

    async def reserve(name: str, tokens: int, rid: str) -> tuple[int, int, str]:
        code, remaining, other = m.reserve(clock.now, name, tokens, stored(rid), "")
        expected = Reservation(rid, code in (1, 2), remaining, other or None, code in (2, 3))
        assert await b.reserve(name, tokens, rid, now=clock.now) == expected
        await check()
        return code, remaining, other

    async def settle(rid: str, used: int | None) -> bool:
        """Refund (``used`` None) or commit; whether a worker is woken."""
        how, now = ("refund", 0) if used is None else ("commit", used), clock.now
        expected = Settlement(rid, *m.settle_script(clock.now, stored(rid), *how))
        got = await (b.refund(rid, now=now) if used is None else b.commit(rid, used, now=now))
        assert got == expected
        woke = m.wake
        await check()
        return woke

    t0 = clock.now
    # D (4 tokens, no window) is spent by a reservation of the caller's own: j0 parks for good,
    # until the caller refunds it (which wakes a worker); the next step takes j0. The refunded
    # id, reserved again, is a duplicate that is not accepted.
    await create("D", 4, None)
    assert await reserve("D", 4, "r1") == (1, 0, "")
    j0 = await add(JobSpec("a", tokens=2, budget="D", on_exhausted="wait"))
    await step(1, [])
    assert m.jobs[j0].state == PARKED and m.parkedby == {"D": math.inf}
    assert await settle("r1", None)  # D got tokens back: j0 is due, and a worker is woken
    assert m.parkedby == {"D": t0}
    await step(1, [])
    assert m.jobs[j0].state == ACTIVE
    assert await reserve("D", 4, "r1") == (3, 2, "")
    # j9 parks on D; j0's commit of exactly its estimate gives nothing back: j9 stays parked.
    j9 = await add(JobSpec("a", tokens=3, budget="D", on_exhausted="wait"))
    await step(1, [])
    await step(0, [(j0, b"1", b"c", b"1", 0, 2)])
    assert m.jobs[j9].state == PARKED
    # A: 6 tokens in a rolling second.
    await create("A", 6, 1)
    j1 = await add(JobSpec("a", tokens=3, budget="A"))
    await step(1, [])
    clock.now = t0 + 100
    j2 = await add(JobSpec("a", tokens=3, budget="A"))
    await step(1, [])
    # A is full (3 at t0, 3 at t0 + 100). j3 needs 3: exactly the first charge, which leaves at
    # t0 + 1000; j4 needs more than the limit: never by time, but A keeps the earlier retry.
    clock.now = t0 + 200
    j3 = await add(JobSpec("a", tokens=3, budget="A", on_exhausted="wait"))
    j4 = await add(JobSpec("a", tokens=9, budget="A", on_exhausted="wait"))
    assert await step(2, []) == t0 + 1000
    assert m.parkedby["A"] == t0 + 1000
    # j1 completes having used nothing: A gets its 3 tokens back, and its parked jobs are tried
    # again in the same call: j3 fits now, j4 parks again (for good).
    clock.now = t0 + 300
    await step(2, [(j1, b"1", b"c", b"1", 0, 0)])
    assert (m.jobs[j3].state, m.jobs[j4].state, m.parkedby["A"]) == (ACTIVE, PARKED, math.inf)
    # The same limit again is not a raised one: j4 stays parked.
    assert m.budget_change(t0 + 300, "A", "limit", 6)[:3] == (1, 6, 0)
    assert await b.set_limit("A", 6, now=t0 + 300) == BudgetChange("A", 6, 0)
    await check()
    # Two throttled attempts are refunded (A has room again, but j4's 9 tokens never fit its 6:
    # j4 stays parked), and the queue waits until the later end: the second, shorter throttle
    # does not shorten it.
    clock.now = t0 + 310
    assert await step(0, [(j2, b"1", b"t", b"150", 0, -1), (j3, b"1", b"t", b"40", 0, -1)]) == t0 + 460
    assert m.jobs[j4].state == PARKED and m.resv[f"{j2}:1"].state == "refunded"
    clock.now = t0 + 459
    assert await step(1, []) == t0 + 460  # still throttled
    # The token-rate window (7 tokens a second): j2 and j3 (3 each) fit, big's estimate never
    # can (rejected), then j5 (5) must wait for the window to free: it blocks the line.
    clock.now = t0 + 460
    m.set_token_rate_limit(7, 1000)
    await q.set_token_rate_limit(7, 1.0)
    big = await add(JobSpec("a", tokens=8))
    j5 = await add(JobSpec("a", tokens=5))
    assert await step(3, []) == t0 + 1460
    assert [m.jobs[i].state for i in (j2, j3, j4, big, j5)] == [ACTIVE, ACTIVE, PARKED, REJECTED, WAITING]
    # j2 used 6, above its reservation of 3: A and the token-rate window are charged all
    # of it, A past its limit (an 'overspent' event says so), 3 of it beyond the estimate.
    clock.now = t0 + 470
    await step(1, [(j2, b"2", b"c", b"1", 0, 6)])
    assert m.resv[f"{j2}:2"].beyond == 3 and m.budgets[TOKEN_RATE].used == 9
    assert m.budgets["A"].counters["beyond"] == 3
    # The request-rate window: one start per 120 ms.
    m.set_rate_limit(1, 120)
    await q.set_rate_limit(1, 0.12)
    j6 = await add(JobSpec("a"))
    j7 = await add(JobSpec("a"))
    # At t0 + 1000 exactly, the charge made at t0 leaves A's window.
    clock.now = t0 + 1000
    assert dataclasses.asdict(await b.get("A", now=clock.now)) == m.budget_read(clock.now, "A")
    assert f"{j1}:1" not in m.budgets["A"].log
    await check()
    clock.now = t0 + 1470  # the token-rate window has freed
    assert await step(3, []) == t0 + 1590
    clock.now = t0 + 1590
    assert await step(3, []) == t0 + 1710
    assert [m.jobs[i].state for i in (j5, j6, j7)] == [ACTIVE, ACTIVE, WAITING]
    # A negative retry-after throttles until now: the queue stays open.
    await step(0, [(j6, b"1", b"t", b"-20", 0, -1)])
    assert m.control.throttled_until == t0 + 1590 and m.events[-1][-1] == "0"
    # E (10 a UTC day): r2 is reserved today and committed, above its estimate, tomorrow: the
    # new day's window is not charged for it. (The day turns at midnight, not a ms before.)
    await create("E", 10, "day")
    await reserve("E", 2, "r2")
    clock.now = calendar_window("day", t0)[1] - 1
    assert dataclasses.asdict(await b.get("E", now=clock.now)) == m.budget_read(clock.now, "E")
    await check()
    clock.now += 1
    await reserve("E", 1, "r3")
    assert not await settle("r2", 5)
    assert m.budgets["E"].used == 1


async def test_fencing_refuses_stale_token_after_reap(q: Queue, clock: Clock) -> None:
    job = await q.add("a")
    first = await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w1")
    assert first.jobs[:2] == [job.id.encode(), 1]
    assert await q.protocol.reap(now=T0 + 100) == (1, 0)  # a deadline equal to now has expired
    second = await q.protocol.step(now=T0 + 100, want=1, lease_ms=100, worker_id="w2")
    assert second.jobs[:2] == [job.id.encode(), 2]
    late = (job.id, b"1", b"c", b"1", 0, -1)
    assert (
        await q.protocol.step(now=T0 + 101, want=0, lease_ms=100, worker_id="w1", outcomes=[late])
    ).codes == [0]
    assert await q.protocol.extend(now=T0 + 101, lease_ms=100, leases=[(job.id, b"1")]) == [0]
    rec = await q.get_job(job.id)
    assert rec is not None and rec.state == JobState.ACTIVE and rec.worker == "w2"
    fresh = (job.id, b"2", b"c", b"1", 0, -1)
    assert (
        await q.protocol.step(now=T0 + 102, want=0, lease_ms=100, worker_id="w2", outcomes=[fresh])
    ).codes == [1]
    counts = await q.counts()
    assert (counts["stale_refused"], counts["completed"], counts["stalled"]) == (1, 1, 1)


async def test_retry_and_promotion_keep_place_in_line(q: Queue, clock: Clock) -> None:
    """A job back from a retry, a release, a stall or a delay runs before later jobs of its priority."""
    first = await q.add("a", delay=0.05)
    second = await q.add("a")
    third = await q.add("a", priority=1)
    fourth = await q.add("a")
    # Not yet due: second, fourth (priority 0), then third.
    r = await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w")
    assert r.jobs[0] == second.id.encode() and r.next_due == T0 + 50
    fail = (second.id, b"1", b"f", b"e", 55, -1)  # due at T0 + 60
    r = await q.protocol.step(now=T0 + 5, want=0, lease_ms=100, worker_id="w", outcomes=[fail])
    assert r.codes == [2] and r.next_due == T0 + 50
    assert await q.ids(JobState.WAITING) == [fourth.id, third.id]
    assert await q.ids(JobState.DELAYED) == [first.id, second.id]
    r = await q.protocol.step(now=T0 + 60, want=0, lease_ms=100, worker_id="w")
    assert r.next_due == -1
    assert await q.ids(JobState.WAITING) == [first.id, second.id, fourth.id, third.id]


async def test_release_uncounts_the_attempt_but_a_stall_counts_it(q: Queue, clock: Clock) -> None:
    job = await q.add("a", max_attempts=2, max_stalls=5)
    await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w")
    release = (job.id, b"1", b"r", b"", 0, -1)
    r = await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w", outcomes=[release])
    assert r.codes == [4] and r.jobs[4] == 1  # leased again as attempt 1
    assert await q.protocol.reap(now=T0 + 100) == (1, 0)
    r = await q.protocol.step(now=T0 + 100, want=1, lease_ms=100, worker_id="w")
    assert r.jobs[4] == 2  # the stalled lease was attempt 1
    # One failure, max_attempts 2: dead, since the stalled lease was a try.
    fail = (job.id, b"3", b"f", b"e", 900, -1)
    r = await q.protocol.step(now=T0 + 100, want=0, lease_ms=100, worker_id="w", outcomes=[fail])
    assert r.codes == [3]
    rec = await q.get_job(job.id)
    assert rec is not None and (rec.attempt, rec.failures, rec.stalls) == (2, 1, 1)


async def test_reap_takes_earliest_deadlines_first(q: Queue, clock: Clock) -> None:
    jobs = [await q.add("a") for _ in range(3)]
    await q.protocol.step(now=T0, want=1, lease_ms=300, worker_id="w")
    await q.protocol.step(now=T0, want=2, lease_ms=100, worker_id="w")
    assert await q.protocol.reap(now=T0 + 1000, limit=2) == (2, 0)
    # jobs 2 and 3 (deadline T0+100) went first; job 1 (T0+300) is still active
    assert await q.ids(JobState.ACTIVE) == [jobs[0].id]
    assert await q.ids(JobState.WAITING) == [jobs[1].id, jobs[2].id]


async def test_cancel_request_reaches_the_next_lease_renewal(q: Queue, clock: Clock) -> None:
    job = await q.add("a")
    await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w")
    assert await q.cancel(job.id) is True
    assert await q.protocol.extend(now=T0 + 10, lease_ms=100, leases=[(job.id, b"1")]) == [2]
    stop = (job.id, b"1", b"x", b"cancelled by request", 0, -1)
    r = await q.protocol.step(now=T0 + 20, want=1, lease_ms=100, worker_id="w", outcomes=[stop])
    assert r.codes == [5] and r.jobs == []
    assert await q.cancel(job.id) is False
    rec = await q.get_job(job.id)
    assert rec is not None and rec.state == JobState.CANCELLED and rec.finished_ms == T0 + 20
    counts = await q.counts()
    assert (counts["cancelled"], counts["active"], counts["waiting"]) == (1, 0, 0)


async def test_redrive_resets_counts_but_keeps_the_token(q: Queue, clock: Clock) -> None:
    job = await q.add("a", max_attempts=1)
    await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w")
    fail = (job.id, b"1", b"f", b"e", 50, -1)
    assert (await q.protocol.step(now=T0, want=0, lease_ms=100, worker_id="w", outcomes=[fail])).codes == [3]
    dead = await q.get_job(job.id)
    assert dead is not None and (dead.attempt, dead.failures, dead.finished_ms) == (1, 1, T0)
    assert await q.redrive([job.id]) == 1
    rec = await q.get_job(job.id)
    assert rec is not None and rec.state == JobState.WAITING  # a fresh start
    assert (rec.attempt, rec.failures, rec.stalls, rec.finished_ms) == (0, 0, 0, None)
    with pytest.raises(JobStateError):
        await q.redrive([job.id])
    r = await q.protocol.step(now=T0 + 1, want=1, lease_ms=100, worker_id="w")
    assert r.jobs[1] == 2 and r.jobs[4] == 1  # token 2 (fences the first lease), attempt 1
    # The first lease's late answer is refused even though the job is active again.
    assert (
        await q.protocol.step(now=T0 + 2, want=0, lease_ms=100, worker_id="w", outcomes=[fail])
    ).codes == [0]


async def test_idempotency_key_within_one_bulk_and_after_purge(q: Queue, clock: Clock) -> None:
    a, b = await q.add_bulk([JobSpec("a", 1, idempotency_key="k1"), JobSpec("a", 2, idempotency_key="k1")])
    assert (a.id, a.created, b.id, b.created) == ("1", True, "1", False)
    await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w")
    await q.protocol.step(
        now=T0, want=0, lease_ms=100, worker_id="w", outcomes=[(a.id, b"1", b"p", b"e", 0, -1)]
    )
    assert await q.purge_dead() == 1
    assert await q.get_job(a.id) is None
    # The key outlives the purged job: the add is still answered with the old id.
    again = await q.add("a", 3, idempotency_key="k1")
    assert (again.id, again.created) == (a.id, False)
    assert (await q.counts())["added"] == 1


@pytest.mark.parametrize("ends_by", ["stall", "retry", "release", "dead"])
async def test_a_requested_cancel_is_not_lost_when_the_attempt_ends_first(
    q: Queue, clock: Clock, ends_by: str
) -> None:
    """cancel() on a running job returns True and asks its worker to stop it at the lease's
    next renewal. If that attempt ends first - its worker dies and the lease is reaped, the
    handler fails (with attempts left or not), or it is released at shutdown - the job ends
    cancelled: it must not go back in line and run again (found by this file before
    6ac8867, when such a job was leased again and could complete)."""
    job = await q.add("a", max_attempts=3)
    await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w1")
    assert await q.cancel(job.id) is True  # running: its worker is asked to stop it
    if ends_by == "stall":  # the worker died before its next renewal
        assert await q.protocol.reap(now=T0 + 100) == (0, 0)
    else:  # the handler failed (or was released) before its next renewal
        kind = {"retry": b"f", "release": b"r", "dead": b"p"}[ends_by]
        ended = (job.id, b"1", kind, b"e", 0, -1)
        reply = await q.protocol.step(now=T0 + 10, want=0, lease_ms=100, worker_id="w1", outcomes=[ended])
        assert reply.codes == [5]
    # The job must not be handed out again: it was cancelled.
    again = await q.protocol.step(now=T0 + 200, want=1, lease_ms=100, worker_id="w2")
    assert again.jobs == []
    rec = await q.get_job(job.id)
    assert rec is not None and rec.state == JobState.CANCELLED
    # A failure's error is kept; a stall is counted; the attempt stays counted.
    assert (rec.error, rec.stalls, rec.attempt) == (
        "e" if ends_by in ("retry", "dead") else None,
        1 if ends_by == "stall" else 0,
        1,
    )
    counts = await q.counts()
    assert (counts["cancelled"], counts["failed"], counts["waiting"], counts["dead"]) == (1, 0, 0, 0)


async def test_a_completion_wins_over_a_requested_cancel(q: Queue, clock: Clock) -> None:
    job = await q.add("a")
    await q.protocol.step(now=T0, want=1, lease_ms=100, worker_id="w1")
    assert await q.cancel(job.id) is True
    done = (job.id, b"1", b"c", b"1", 0, -1)
    assert (
        await q.protocol.step(now=T0 + 1, want=0, lease_ms=100, worker_id="w1", outcomes=[done])
    ).codes == [1]
    assert await job.result(timeout=5) == 1
