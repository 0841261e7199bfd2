"""The lab's worker: ``sluice worker sluice_lab.lab_worker:worker``, two processes per mode.

A job simulates one LLM call of ``tokens`` tokens taking ``latency_ms``, behind
the budget gate of the lab's mode:

* naive: the handler reads the balance, decides, and writes the balance back
  (GET, then SET). Two handlers that read the same balance both go through.
* atomic: the handler reserves with ``queue.budgets.reserve``: one Lua script
  checks and charges, so only what fits is admitted.
* admission: the job was added with ``budget=``, so the dispatch script
  reserved before the job started; a job that does not fit never starts.

The call really uses ``usage`` tokens (``tokens`` if the payload has none):
the overuse phase's calls use more than they estimated. The handler reports
it with ``ctx.record_usage`` (admission: the engine charges it to the job's
reservation) and, atomic, commits it to its own reservation. The naive gate
charges the estimate and nothing after it, as a read-then-write balance that
trusts the estimate does: usage beyond it is spent but never counted.

Race jobs meet at a Redis barrier right after reading the balance (naive) or
right before reserving (atomic), so that all of them have read before any
writes: the naive race then happens on every run, not by luck of timing.

Every attempt appends one JSON span (phase, worker, start, end, outcome,
balance, and the tokens its call used) to a list in the queue's keys; the
lab computes every figure from those spans and the job records.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

import orjson

from sluice.engine.budget_state import Reservation
from sluice.engine.connection import connect
from sluice.engine.context import JobContext
from sluice.engine.keys import QueueKeys
from sluice.engine.queue import Queue
from sluice.engine.worker import Worker
from sluice.errors import Throttled
from sluice.settings import ENV_LAB_URL

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: The Redis URL of the lab's own reads and writes (the worker's --redis too).
ENV_URL = ENV_LAB_URL

#: The lab passes --queue; this name is only the default.
worker = Worker("lab", concurrency=3, shutdown_grace=5.0, lease=10.0)

#: How long a race job waits at the barrier for the others before giving up.
BARRIER_TIMEOUT_S = 15.0

_queues: dict[tuple[int, str], Queue] = {}


def lab_key(queue: str, name: str) -> str:
    """A key of the lab's own, among the queue's keys (so dropping the queue drops it)."""
    return QueueKeys.for_queue(queue).base + "lab:" + name


def _queue(ctx: JobContext) -> Queue:
    """A Queue on the worker's own Redis connection, one per event loop."""
    key = (id(asyncio.get_running_loop()), ctx.queue)
    queue = _queues.get(key)
    if queue is None:
        queue = _queues[key] = Queue(ctx.queue, redis=connect(os.environ[ENV_URL]))
    return queue


def _ms() -> float:
    return time.time() * 1000


async def _barrier(redis: Redis, key: str, parties: int) -> None:
    """Wait until ``parties`` jobs have arrived (a counter in Redis; polled every 2 ms)."""
    await redis.incr(key)
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while int(await redis.get(key) or 0) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier {key}: fewer than {parties} jobs arrived in {BARRIER_TIMEOUT_S}s")
        await asyncio.sleep(0.002)


async def _naive_gate(
    redis: Redis, balance_key: str, cost: int, barrier: tuple[str, int] | None
) -> int | None:
    """Read, decide, write back: the race this lab exists to show. Returns the balance left, or None."""
    balance = int(await redis.get(balance_key) or 0)
    if barrier is not None:
        await _barrier(redis, *barrier)
    if balance < cost:
        return None
    await redis.set(balance_key, balance - cost)
    return balance - cost


@worker.handler
async def llm_call(ctx: JobContext) -> dict[str, Any]:
    """One simulated LLM call behind the mode's budget gate (see the module docstring)."""
    p: dict[str, Any] = ctx.payload
    queue = _queue(ctx)
    redis = queue.redis
    start = _ms()
    mode, phase, cost = p["mode"], p["phase"], int(p["tokens"])
    usage = int(p.get("usage", cost))
    barrier = (lab_key(ctx.queue, "barrier"), int(p["barrier"])) if p.get("barrier") else None
    span: dict[str, Any] = {
        "job": ctx.id,
        "phase": phase,
        "attempt": ctx.attempt,
        "worker": ctx.worker_id,
        "start": start,
        "usage": 0,  # tokens the call used: none unless it was made
    }
    rid = ctx.reservation_id
    remaining: int | None
    try:
        if mode == "naive":
            remaining = await _naive_gate(redis, lab_key(ctx.queue, f"naive:{phase}"), cost, barrier)
        elif mode == "atomic":
            if barrier is not None:
                await _barrier(redis, *barrier)
            r: Reservation = await queue.budgets.reserve(p["budget"], cost, rid, job_id=ctx.id)
            remaining = r.remaining if r.accepted else None
        else:  # admission: the dispatch script reserved before the job started
            remaining = (await queue.budgets.get(p["budget"])).remaining
        if remaining is None:
            span.update(outcome="rejected", admitted=False, remaining=None)
            return {"admitted": False}
        if p.get("throttle") and await redis.set(lab_key(ctx.queue, f"throttled:{ctx.id}"), 1, nx=True):
            # The simulated provider answers 429 to this job's first call.
            await _give_back(queue, mode, phase, cost, rid)
            span.update(outcome="throttled", admitted=False, remaining=remaining, retry_after_ms=500)
            raise Throttled(retry_after=0.5)
        await asyncio.sleep(int(p["latency_ms"]) / 1000)
        if mode == "atomic":
            await queue.budgets.commit(rid, usage)
        ctx.record_usage(usage)
        span.update(outcome="completed", admitted=True, remaining=remaining, usage=usage)
        return {"admitted": True, "remaining": remaining}
    finally:
        span["end"] = _ms()
        await redis.rpush(lab_key(ctx.queue, "spans"), orjson.dumps(span))


async def _give_back(queue: Queue, mode: str, phase: str, cost: int, rid: str) -> None:
    """The provider refused the call: what the gate charged goes back (admission: the engine does it)."""
    if mode == "naive":
        await queue.redis.incrby(lab_key(queue.name, f"naive:{phase}"), cost)
    elif mode == "atomic":
        await queue.budgets.refund(rid)
