"""Model-based tests: the Lua scripts against a plain-Python model of the job lifecycle.

A hypothesis state machine applies one random sequence of operations (add,
advance the clock, step with outcomes, extend, reap, cancel, redrive, purge)
to a real Redis, through Queue, and to tests/model.py, and after every
operation compares everything: each job's hash (state, attempt, failures,
stalls, token, times, result, error, cancel request, TTL), the four sorted
sets with their scores (so the dispatch order of waiting jobs), the sequence,
idempotency keys, the counters and counts(), the wake marker, the event
stream, and the set of keys the queue owns. Each operation's answer is
compared too (step's codes, leased jobs in order and next_due; extend's codes;
reap's totals; cancel/redrive/purge results and errors).

Time is the model's: Queue.add and Queue.cancel read sluice.engine.queue.now_ms,
which the tests replace with a controlled clock; step, extend and reap take
``now`` explicitly.

hypothesis and pytest-asyncio do not mix, so the state machine runs its own
event loop with its own Redis client (for the session's server).
"""

from __future__ import annotations

import asyncio
import json
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

import sluice.engine.queue as queue_module
from sluice import JobNotFound, JobRecord, JobSpec, JobState, JobStateError, Queue
from sluice.engine.backoff import DEFAULT_BACKOFF
from sluice.engine.connection import connect
from tests.model import (
    ACTIVE,
    CANCELLED,
    DEAD,
    DELAYED,
    LIVE_SETS,
    WAITING,
    AddSpec,
    LeasedJob,
    Model,
    ModelEvent,
)

T = TypeVar("T")

#: The clock starts here (ms): a realistic Unix time, so numbers render as they will in production.
T0 = 1_700_000_000_000
#: Small, so both forms of the 'completed' event (with and without the result) happen.
EV_RESULT_MAX = 8
IDEM_KEYS = ("k1", "k2", "k3")
WORKERS = ("w1", "w2")
#: Outcome values: results are JSON, as the runner sends them (a record holding a result that is
#: not JSON does not parse), of 1, EV_RESULT_MAX, EV_RESULT_MAX + 1 and more bytes; errors are any text.
RESULTS = (b"1", b'"123456"', b'"1234567"', b'"a much longer result"')
ERRORS = (b"boom", b"", b"Traceback: a long error")
#: retry_at relative to now: in the past, now, and later.
RETRY_OFFSETS = (-5, 0, 1, 120, 600)
LEASES_MS = (100, 250)


class Clock:
    """Stands in for sluice.engine.clock.now_ms."""

    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(queue_module, "now_ms", c)
    return c


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
    )


specs = st.builds(
    JobSpec,
    name=st.sampled_from(["a", "b"]),
    payload=st.none() | st.integers(0, 9),
    priority=st.integers(0, 2),
    delay=st.sampled_from([0.0, 0.0, 0.1, 0.25]),
    max_attempts=st.sampled_from([2, 3, 1]),
    timeout=st.sampled_from([None, 2.0]),
    idempotency_key=st.none() | st.sampled_from(IDEM_KEYS),
    max_stalls=st.integers(0, 2),
)

#: A drawn outcome: (job id, token), (kind, value), retry_at - now.
Drawn = tuple[tuple[str, bytes], tuple[bytes, bytes], int]

#: (kind, value) of one outcome.
outcome_values = st.sampled_from(
    [(kind, e) for kind in (b"f", b"r", b"p", b"x") for e in ERRORS] + [(b"c", r) for r in RESULTS]
)


# ---- comparing Redis with the model ------------------------------------------------------------------
def _s(value: bytes) -> str:
    return value.decode()


def _event(fields: dict[bytes, bytes]) -> ModelEvent:
    pairs = [(_s(k), _s(v)) for k, v in fields.items()]
    assert [k for k, _ in pairs[:2]] == ["ev", "id"], pairs
    return (pairs[0][1], pairs[1][1], *(x for pair in pairs[2:] for x in pair))


async def redis_state(queue: Queue, max_id: int) -> dict[str, Any]:
    """Everything the queue holds in Redis, in the shape of :func:`model_state`: the
    records of ids 1..max_id, and the names of all keys (so no other key goes unseen)."""
    r, k = queue.redis, queue.keys
    async with r.pipeline(transaction=False) as pipe:
        pipe.keys(k.base + "*")
        for n in range(1, max_id + 1):
            pipe.hgetall(k.job(str(n)))
            pipe.pttl(k.job(str(n)))
        for name in LIVE_SETS:
            pipe.zrange(getattr(k, name), 0, -1, withscores=True)
        pipe.get(k.seq)
        pipe.hgetall(k.stats)
        pipe.zrange(k.wake, 0, -1, withscores=True)
        pipe.xrange(k.events)
        for key in IDEM_KEYS:
            pipe.get(k.idem(key))
            pipe.pttl(k.idem(key))
        replies: list[Any] = await pipe.execute()
    rest = iter(replies)
    keys = sorted(_s(key) for key in next(rest))
    jobs, expiring = {}, {}
    for job_id in map(str, range(1, max_id + 1)):
        raw, ttl = next(rest), next(rest)
        if not raw:
            continue
        JobRecord.from_hash(job_id, raw, k.idem_prefix)  # every record parses
        jobs[job_id] = {_s(f): _s(v) for f, v in raw.items()}
        assert ttl == -1 or ttl > 0
        expiring[job_id] = ttl > 0
    out: dict[str, Any] = {"keys": keys, "jobs": jobs, "expiring": expiring}
    for name in LIVE_SETS:
        out[name] = [(_s(m), int(score)) for m, score in next(rest)]
    seq = next(rest)
    out["seq"] = int(seq) if seq is not None else 0
    out["stats"] = {_s(f): int(v) for f, v in next(rest).items()}
    out["wake"] = [(_s(m), score) for m, score in next(rest)]
    out["events"] = [_event(fields) for _, fields in next(rest)]
    idem: dict[str, str] = {}
    for key in IDEM_KEYS:
        value, ttl = next(rest), next(rest)
        if value is not None:
            assert ttl > 0, f"idempotency key {key} has no TTL"
            idem[key] = _s(value)
    out["idem"] = idem
    return out


def model_state(model: Model, queue: Queue) -> dict[str, Any]:
    k = queue.keys
    keys = {k.job(i) for i in model.jobs} | {k.idem(i) for i in model.idem}
    keys |= {getattr(k, name) for name in LIVE_SETS if model.zset(name)}
    for key, present in (
        (k.seq, model.seq > 0),
        (k.stats, any(model.stats.values())),
        (k.events, bool(model.events)),
        (k.wake, model.wake),
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
    out["seq"] = model.seq
    out["stats"] = {name: n for name, n in model.stats.items() if n}
    out["wake"] = [("w", 0.0)] if model.wake else []
    out["events"] = model.events
    out["idem"] = dict(model.idem)
    return out


async def assert_same(queue: Queue, model: Model) -> None:
    real, expected = await redis_state(queue, model.seq), model_state(model, queue)
    # Section by section, so a failure names what differs.
    for section in expected:
        if section == "jobs" and real["jobs"].keys() == expected["jobs"].keys():
            for job_id, want in expected["jobs"].items():
                got = real["jobs"][job_id]
                diff = {
                    f: (got.get(f), want.get(f))
                    for f in got.keys() | want.keys()
                    if got.get(f) != want.get(f)
                }
                assert not diff, f"job {job_id}: field: (redis, model): {diff}"
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
            keep_ms=self.queue.keep_finished_ms,
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

    def job_id(self, data: st.DataObject) -> str:
        """Mostly a job in a live state picked first (so that rare states get picked); else
        any id: one that exists (maybe finished), existed (purged) or never did."""
        states = sorted({j.state for j in self.model.jobs.values()} & set(LIVE_SETS))
        if not states or data.draw(st.sampled_from([False, False, False, True]), label="any id?"):
            return str(data.draw(st.integers(1, self.model.seq + 1), label="id"))
        state = data.draw(st.sampled_from(states), label="state")
        return data.draw(st.sampled_from(self.model.ids(state)), label="id")

    def some_ids(self, data: st.DataObject) -> list[str]:
        """1-3 ids, dead ones first (hypothesis shrinks towards them), repeats allowed."""
        pool = self.model.ids(DEAD) + [str(i) for i in range(1, self.model.seq + 2)]
        return data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3), label="ids")

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
        self.run(assert_same(self.queue, self.model))

    # ---- operations -------------------------------------------------------------------------------------
    @initialize(batch=st.lists(specs, min_size=1, max_size=4))
    def first_jobs(self, batch: list[JobSpec]) -> None:
        self.add(batch)

    @rule(batch=st.lists(specs, min_size=1, max_size=3))
    def add(self, batch: list[JobSpec]) -> None:
        expected = self.model.add(self.clock.now, [model_spec(s) for s in batch])
        jobs = self.run(self.queue.add_bulk(batch))
        assert [(j.id, j.created) for j in jobs] == expected
        if not all(created for _, created in expected):
            event("add: an idempotency key named an existing job")

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Move the clock on by some ms, or to the next lease deadline or due time (the edges)."""
        targets = [t for _, t in self.model.zset(ACTIVE)[:1] + self.model.zset(DELAYED)[:1]]
        steps = st.sampled_from([1, 50, 99, 100, 150, 250, 400])
        if targets:
            steps |= st.sampled_from([max(t - self.clock.now, 0) for t in targets])
        self.clock.now += data.draw(steps, label="ms")

    def do_step(self, want: int, lease_ms: int, worker: str, drawn: list[Drawn]) -> None:
        now = self.clock.now
        outcomes = [
            (job_id, token, kind, value, now + off, -1) for (job_id, token), (kind, value), off in drawn
        ]
        codes, next_due, leased = self.model.step(now, want, lease_ms, worker, outcomes)
        reply = self.run(
            self.queue.step(now=now, want=want, lease_ms=lease_ms, worker_id=worker, outcomes=outcomes)
        )
        assert reply.codes == codes
        assert reply.jobs == flat(leased)
        assert reply.next_due == next_due
        self.leases += [(j.id.decode(), str(j.token).encode()) for j in leased]
        for (_, _, kind, _, _, _), code in zip(outcomes, codes, strict=True):
            event(f"step: outcome {kind.decode()} -> {code}")
        event(f"step: leased {len(leased)} of {want}")

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
            outcome = st.tuples(self.lease(), outcome_values, st.sampled_from(RETRY_OFFSETS))
            size = 3 if self.has_active() else 1
            drawn = data.draw(st.lists(outcome, max_size=size), label="outcomes")
        self.do_step(want, lease_ms, worker, drawn)

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
            (lease, data.draw(outcome_values, label="outcome"), data.draw(st.sampled_from(RETRY_OFFSETS)))
            for lease in current
        ]
        self.do_step(want, lease_ms, worker, drawn)

    @rule()
    def worker_wakes(self) -> None:
        """An idle worker takes the wake marker (BZPOPMIN, here ZPOPMIN), so that whether
        the next operation puts it back is seen."""
        popped = self.run(self.redis.zpopmin(self.queue.keys.wake))
        assert bool(popped) == self.model.wake
        self.model.wake = False

    @precondition(has_leases)
    @rule(data=st.data(), lease_ms=st.sampled_from(LEASES_MS))
    def extend(self, data: st.DataObject, lease_ms: int) -> None:
        leases = data.draw(st.lists(self.lease(), min_size=1, max_size=3), label="leases")
        now = self.clock.now
        expected = self.model.extend(now, lease_ms, leases)
        assert self.run(self.queue.extend(now=now, lease_ms=lease_ms, leases=leases)) == expected
        for code in expected:
            event(f"extend -> {code}")

    @precondition(has_active)
    @rule(limit=st.sampled_from([1000, 1, 2]), jump=st.sampled_from(["no", "first", "last"]))
    def reap(self, limit: int, jump: str) -> None:
        if jump != "no":  # first move the clock on to the earliest or the latest lease deadline
            deadlines = [d for _, d in self.model.zset(ACTIVE)]
            self.clock.now = max(self.clock.now, deadlines[0] if jump == "first" else deadlines[-1])
        now = self.clock.now
        expected = self.model.reap(now, limit)
        assert self.run(self.queue.reap(now=now, limit=limit)) == expected
        event(f"reap: returned {min(expected[0], 2)}+, dead {min(expected[1], 2)}+")

    @precondition(has_jobs)
    @rule(data=st.data(), api=st.booleans())
    def cancel(self, data: st.DataObject, api: bool) -> None:
        job_id = self.job_id(data)
        now = self.clock.now
        code, state = self.model.cancel(now, job_id)
        event(f"cancel: {state or 'missing'} -> {code}")
        if not api:  # the script itself: its code and the state it found
            k, q = self.queue.keys, self.queue
            reply = self.run(
                q.scripts.cancel(
                    keys=[k.job(job_id), k.waiting, k.delayed, k.events, k.stats],
                    args=[now, job_id, q.events_maxlen, q.keep_finished_ms],
                )
            )
            assert [reply[0], _s(reply[1])] == [code, state]
        elif code == -1:
            with pytest.raises(JobNotFound):
                self.run(self.queue.cancel(job_id))
        else:
            assert self.run(self.queue.cancel(job_id)) is (code > 0)

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
        codes = self.model.redrive(ids)
        event(f"redrive ids -> {sorted(set(codes))}")
        bad = [c for c in codes if c != 1]
        if not bad:
            assert self.run(self.queue.redrive(ids)) == len(ids)
        else:
            # Queue.redrive raises for the first id that was not dead, after the
            # script has redriven every dead one in the chunk.
            with pytest.raises(JobNotFound if bad[0] == -1 else JobStateError):
                self.run(self.queue.redrive(ids))

    @precondition(has_dead)
    @rule(data=st.data(), everything=st.booleans())
    def purge(self, data: st.DataObject, everything: bool) -> None:
        ids = self.model.ids(DEAD) if everything else self.some_ids(data)
        removed = self.model.purge(ids)
        assert self.run(self.queue.purge_dead(None if everything else ids)) == removed
        event(f"purge {'all' if everything else 'ids'}: removed {min(removed, 2)}+")


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


# Passing takes seconds; a failure is shrunk for up to 5 minutes (hypothesis's limit) before
# it is reported, which the default pytest timeout would cut short.
@pytest.mark.timeout(600)
def test_scripts_match_model(machine_loop: None) -> None:
    run_state_machine_as_test(
        QueueMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=30,
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
    m = Model(
        keep_ms=q.keep_finished_ms, ev_result_max=q.event_result_max_bytes, idem_prefix=q.keys.idem_prefix
    )

    async def add(spec: JobSpec) -> str:
        (expected,) = m.add(clock.now, [model_spec(spec)])
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
        reply = await q.step(now=now, want=want, lease_ms=100, worker_id="w", outcomes=outcomes)
        assert (reply.codes, reply.next_due, reply.jobs) == (codes, next_due, flat(leased))
        await assert_same(q, m)

    def state(job_id: str) -> tuple[str, int, int, int, int]:
        j = m.jobs[job_id]
        return j.state, j.attempt, j.token, j.failures, j.stalls

    now = clock.now
    d = await add(JobSpec("a", 5, priority=2))
    await step(now, 1, [])  # a (priority 1, first in line; b is not due)
    await step(now + 100, 2, [(a, b"1", b"f", b"e", now + 150, -1)])  # a retries later; b is due: b, c
    assert [state(i)[0] for i in (a, b, c, d)] == [DELAYED, ACTIVE, ACTIVE, WAITING]
    assert await q.cancel(b) is True  # running: a cancel request
    m.cancel(clock.now, b)
    leases = [(b, b"1"), (c, b"1"), (a, b"1")]
    assert await q.extend(now=now + 120, lease_ms=100, leases=leases) == m.extend(now + 120, 100, leases)
    assert m.extend(now + 120, 100, leases) == [2, 1, 0]
    # Both leases expire: b (cancel requested) is cancelled, c dead (max_stalls 0).
    assert await q.reap(now=now + 300) == m.reap(now + 300, 1000) == (0, 1)
    await assert_same(q, m)
    assert [state(i) for i in (b, c)] == [(CANCELLED, 1, 1, 0, 1), (DEAD, 1, 1, 0, 1)]
    await step(now + 300, 3, [(b, b"1", b"x", b"", 0, -1)])  # stale: refused; a due again: a, d
    assert [state(i) for i in (a, d)] == [(ACTIVE, 2, 2, 1, 0), (ACTIVE, 1, 1, 0, 0)]
    assert await q.cancel(d) is True
    m.cancel(clock.now, d)
    await step(now + 305, 0, [(d, b"1", b"f", b"e", now + 305, -1)])  # a failure, but cancelled
    assert state(d) == (CANCELLED, 1, 1, 0, 0) and m.jobs[d].error == "e"
    await step(now + 310, 0, [(a, b"2", b"f", b"e", 0, -1)])  # attempts spent: dead
    assert state(a) == (DEAD, 2, 2, 2, 0)
    assert await q.redrive() == m.redrive(m.ids(DEAD)).count(1) == 2  # c, then a
    await assert_same(q, m)
    await step(now + 320, 3, [])  # a and c, in line by priority and sequence
    assert [state(i) for i in (a, c)] == [(ACTIVE, 1, 3, 0, 0), (ACTIVE, 1, 2, 0, 0)]
    await step(now + 325, 0, [(a, b"3", b"f", b"e", now + 325, -1)])  # a retry due now: straight to waiting
    assert state(a) == (WAITING, 1, 3, 1, 0) and m.jobs[a].due == now + 150  # (from the first retry)
    await step(now + 326, 1, [])
    # Results of exactly the event limit and one byte more: only the first travels in the event.
    limit = q.event_result_max_bytes
    fits, too_big = b'"' + b"x" * (limit - 2) + b'"', b'"' + b"x" * (limit - 1) + b'"'
    await step(now + 330, 0, [(a, b"4", b"c", fits, 0, -1), (c, b"2", b"c", too_big, 0, -1)])
    assert m.events[-2:] == [("completed", a, "result", fits.decode()), ("completed", c)]
    assert (await q.counts())["completed"] == 2


async def test_fencing_refuses_stale_token_after_reap(q: Queue, clock: Clock) -> None:
    job = await q.add("a")
    first = await q.step(now=T0, want=1, lease_ms=100, worker_id="w1")
    assert first.jobs[:2] == [job.id.encode(), 1]
    assert await q.reap(now=T0 + 100) == (1, 0)  # a deadline equal to now has expired
    second = await q.step(now=T0 + 100, want=1, lease_ms=100, worker_id="w2")
    assert second.jobs[:2] == [job.id.encode(), 2]
    late = (job.id, b"1", b"c", b"1", 0, -1)
    assert (await q.step(now=T0 + 101, want=0, lease_ms=100, worker_id="w1", outcomes=[late])).codes == [0]
    assert await q.extend(now=T0 + 101, lease_ms=100, leases=[(job.id, b"1")]) == [0]
    rec = await q.get_job(job.id)
    assert rec is not None and rec.state == JobState.ACTIVE and rec.worker == "w2"
    fresh = (job.id, b"2", b"c", b"1", 0, -1)
    assert (await q.step(now=T0 + 102, want=0, lease_ms=100, worker_id="w2", outcomes=[fresh])).codes == [1]
    counts = await q.counts()
    assert (counts["stale_refused"], counts["completed"], counts["stalled"]) == (1, 1, 1)


async def test_retry_and_promotion_keep_place_in_line(q: Queue, clock: Clock) -> None:
    """A job back from a retry, a release, a stall or a delay runs before later jobs of its priority."""
    first = await q.add("a", delay=0.05)
    second = await q.add("a")
    third = await q.add("a", priority=1)
    fourth = await q.add("a")
    # Not yet due: second, fourth (priority 0), then third.
    r = await q.step(now=T0, want=1, lease_ms=100, worker_id="w")
    assert r.jobs[0] == second.id.encode() and r.next_due == T0 + 50
    fail = (second.id, b"1", b"f", b"e", T0 + 60, -1)
    r = await q.step(now=T0 + 5, want=0, lease_ms=100, worker_id="w", outcomes=[fail])
    assert r.codes == [2] and r.next_due == T0 + 50
    assert await q.ids(JobState.WAITING) == [fourth.id, third.id]
    assert await q.ids(JobState.DELAYED) == [first.id, second.id]
    r = await q.step(now=T0 + 60, want=0, lease_ms=100, worker_id="w")
    assert r.next_due == -1
    assert await q.ids(JobState.WAITING) == [first.id, second.id, fourth.id, third.id]


async def test_release_uncounts_the_attempt_but_a_stall_counts_it(q: Queue, clock: Clock) -> None:
    job = await q.add("a", max_attempts=2, max_stalls=5)
    await q.step(now=T0, want=1, lease_ms=100, worker_id="w")
    release = (job.id, b"1", b"r", b"", 0, -1)
    r = await q.step(now=T0, want=1, lease_ms=100, worker_id="w", outcomes=[release])
    assert r.codes == [4] and r.jobs[4] == 1  # leased again as attempt 1
    assert await q.reap(now=T0 + 100) == (1, 0)
    r = await q.step(now=T0 + 100, want=1, lease_ms=100, worker_id="w")
    assert r.jobs[4] == 2  # the stalled lease was attempt 1
    # One failure, max_attempts 2: dead, since the stalled lease was a try.
    fail = (job.id, b"3", b"f", b"e", T0 + 1000, -1)
    r = await q.step(now=T0 + 100, want=0, lease_ms=100, worker_id="w", outcomes=[fail])
    assert r.codes == [3]
    rec = await q.get_job(job.id)
    assert rec is not None and (rec.attempt, rec.failures, rec.stalls) == (2, 1, 1)


async def test_reap_takes_earliest_deadlines_first(q: Queue, clock: Clock) -> None:
    jobs = [await q.add("a") for _ in range(3)]
    await q.step(now=T0, want=1, lease_ms=300, worker_id="w")
    await q.step(now=T0, want=2, lease_ms=100, worker_id="w")
    assert await q.reap(now=T0 + 1000, limit=2) == (2, 0)
    # jobs 2 and 3 (deadline T0+100) went first; job 1 (T0+300) is still active
    assert await q.ids(JobState.ACTIVE) == [jobs[0].id]
    assert await q.ids(JobState.WAITING) == [jobs[1].id, jobs[2].id]


async def test_cancel_request_reaches_the_next_lease_renewal(q: Queue, clock: Clock) -> None:
    job = await q.add("a")
    await q.step(now=T0, want=1, lease_ms=100, worker_id="w")
    assert await q.cancel(job.id) is True
    assert await q.extend(now=T0 + 10, lease_ms=100, leases=[(job.id, b"1")]) == [2]
    stop = (job.id, b"1", b"x", b"cancelled by request", 0, -1)
    r = await q.step(now=T0 + 20, want=1, lease_ms=100, worker_id="w", outcomes=[stop])
    assert r.codes == [5] and r.jobs == []
    assert await q.cancel(job.id) is False
    rec = await q.get_job(job.id)
    assert rec is not None and rec.state == JobState.CANCELLED and rec.finished_ms == T0 + 20
    counts = await q.counts()
    assert (counts["cancelled"], counts["active"], counts["waiting"]) == (1, 0, 0)


async def test_redrive_resets_counts_but_keeps_the_token(q: Queue, clock: Clock) -> None:
    job = await q.add("a", max_attempts=1)
    await q.step(now=T0, want=1, lease_ms=100, worker_id="w")
    fail = (job.id, b"1", b"f", b"e", T0 + 50, -1)
    assert (await q.step(now=T0, want=0, lease_ms=100, worker_id="w", outcomes=[fail])).codes == [3]
    dead = await q.get_job(job.id)
    assert dead is not None and (dead.attempt, dead.failures, dead.finished_ms) == (1, 1, T0)
    assert await q.redrive([job.id]) == 1
    rec = await q.get_job(job.id)
    assert rec is not None and rec.state == JobState.WAITING  # a fresh start
    assert (rec.attempt, rec.failures, rec.stalls, rec.finished_ms) == (0, 0, 0, None)
    with pytest.raises(JobStateError):
        await q.redrive([job.id])
    r = await q.step(now=T0 + 1, want=1, lease_ms=100, worker_id="w")
    assert r.jobs[1] == 2 and r.jobs[4] == 1  # token 2 (fences the first lease), attempt 1
    # The first lease's late answer is refused even though the job is active again.
    assert (await q.step(now=T0 + 2, want=0, lease_ms=100, worker_id="w", outcomes=[fail])).codes == [0]


async def test_idempotency_key_within_one_bulk_and_after_purge(q: Queue, clock: Clock) -> None:
    a, b = await q.add_bulk([JobSpec("a", 1, idempotency_key="k1"), JobSpec("a", 2, idempotency_key="k1")])
    assert (a.id, a.created, b.id, b.created) == ("1", True, "1", False)
    await q.step(now=T0, want=1, lease_ms=100, worker_id="w")
    await q.step(now=T0, want=0, lease_ms=100, worker_id="w", outcomes=[(a.id, b"1", b"p", b"e", 0, -1)])
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
    await q.step(now=T0, want=1, lease_ms=100, worker_id="w1")
    assert await q.cancel(job.id) is True  # running: its worker is asked to stop it
    if ends_by == "stall":  # the worker died before its next renewal
        assert await q.reap(now=T0 + 100) == (0, 0)
    else:  # the handler failed (or was released) before its next renewal
        kind = {"retry": b"f", "release": b"r", "dead": b"p"}[ends_by]
        ended = (job.id, b"1", kind, b"e", 0, -1)
        reply = await q.step(now=T0 + 10, want=0, lease_ms=100, worker_id="w1", outcomes=[ended])
        assert reply.codes == [5]
    # The job must not be handed out again: it was cancelled.
    again = await q.step(now=T0 + 200, want=1, lease_ms=100, worker_id="w2")
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
    await q.step(now=T0, want=1, lease_ms=100, worker_id="w1")
    assert await q.cancel(job.id) is True
    done = (job.id, b"1", b"c", b"1", 0, -1)
    assert (await q.step(now=T0 + 1, want=0, lease_ms=100, worker_id="w1", outcomes=[done])).codes == [1]
    assert await job.result(timeout=5) == 1
