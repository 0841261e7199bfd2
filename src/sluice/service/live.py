"""What the dashboard shows live: the queue now, its rates, and budgets with their burn rate.

One snapshot is a handful of concurrent reads (the same kind the Prometheus
scrape makes, none of them a scan over jobs): the live states' sizes and the
cumulative counters, the flow gates, the workers' heartbeats, the pressure
gauge's last reading and, for an admin, the budgets the store's ledger knows.
Rates are the counters' differences between two snapshots of one stream, so
every viewer sees rates over the interval it watches, and nothing is kept in
Redis for them.

The burn rate of a budget is the rate of its ``charged`` counter: the tokens
of every settled reservation, whatever its windows (engine/budgets.py), so it
measures what was spent, not the estimates held. Each API process samples its
budgets every :data:`SAMPLE_SECONDS` into :class:`BurnTracker` and keeps
:data:`HISTORY_SECONDS` of samples, so a dashboard opened now shows a rate at
once; the rate is taken over the last :data:`RATE_SECONDS` (a minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from sluice.errors import SluiceError
from sluice.store.schema import BudgetRow

if TYPE_CHECKING:
    from sluice.engine.budgets import BudgetState
    from sluice.service.context import Caller, Services

log = logging.getLogger("sluice.service")

#: Budgets shown (their names sorted), and how long the list of names is kept.
MAX_BUDGETS = 100
BUDGET_NAMES_SECONDS = 60.0
#: How often each API process samples its budgets' ``charged`` counters.
SAMPLE_SECONDS = 5.0
#: Samples kept per budget (seconds of history), and the span a rate is taken over.
HISTORY_SECONDS = 600.0
RATE_SECONDS = 60.0
#: A rate needs samples at least this far apart.
MIN_SPAN_SECONDS = 4.0
_LIVE_STATES = ("waiting", "delayed", "parked", "active", "dead")


async def budget_names(svc: Services) -> list[str]:
    """The budgets the store's ledger copies for this queue (sorted, at most MAX_BUDGETS),
    read from PostgreSQL at most once every BUDGET_NAMES_SECONDS."""
    cached = svc.metrics_cache.get("budgets")
    now = time.monotonic()
    if cached is not None and now - cached[0] < BUDGET_NAMES_SECONDS:
        names: list[str] = cached[1]
        return names
    async with svc.db.sessions() as session:
        rows = await session.scalars(
            select(BudgetRow.name)
            .where(BudgetRow.queue == svc.queue.name)
            .order_by(BudgetRow.name)
            .limit(MAX_BUDGETS)
        )
        names = list(rows.all())
    svc.metrics_cache["budgets"] = (now, names)
    return names


class BurnTracker:
    """Samples of each budget's ``charged`` counter over the last HISTORY_SECONDS, in one
    process; the rate between the newest sample and the oldest one within RATE_SECONDS."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, name: str, charged: int, at: float | None = None) -> None:
        """Record ``charged`` for ``name`` at monotonic time ``at`` (now by default). A
        counter that went down was restored after Redis lost it: its history starts again."""
        at = time.monotonic() if at is None else at
        samples = self._samples.setdefault(name, deque())
        if samples and charged < samples[-1][1]:
            samples.clear()
        samples.append((at, charged))
        while samples and at - samples[0][0] > HISTORY_SECONDS:
            samples.popleft()

    def per_minute(self, name: str) -> float | None:
        """Tokens charged per minute lately, or None before two samples MIN_SPAN_SECONDS apart."""
        samples = self._samples.get(name)
        if not samples:
            return None
        t1, c1 = samples[-1]
        first = next(((t, c) for t, c in samples if t1 - t <= RATE_SECONDS), None)
        if first is None or t1 - first[0] < MIN_SPAN_SECONDS:
            return None
        return (c1 - first[1]) / (t1 - first[0]) * 60.0

    def forget(self, keep: set[str]) -> None:
        for name in set(self._samples) - keep:
            del self._samples[name]

    async def run(self, svc: Services, stop: asyncio.Event) -> None:
        """Sample every SAMPLE_SECONDS until ``stop`` (a store or Redis outage skips a beat)."""
        while not stop.is_set():
            try:
                await read_budgets(svc)
            except Exception:  # sampled again at the next beat
                log.debug("live: budgets could not be sampled", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_SECONDS)


def _budget_out(state: BudgetState, burn: float | None, now_ms: int) -> dict[str, Any]:
    """A budget with its burn rate and, at that rate, when it runs out (None: not at this
    rate within its window, or no rate yet); ``runs_out`` says which."""
    out = dataclasses.asdict(state)
    out["burn_per_minute"] = burn
    exhausts: int | None = None
    runs_out = "unknown" if burn is None else "no"
    if state.remaining <= 0:
        exhausts, runs_out = now_ms, "now"
    elif burn is not None and burn > 0:
        exhausts = now_ms + int(state.remaining / burn * 60_000)
        runs_out = "yes"
        if state.resets_at_ms is not None and state.window != "rolling" and exhausts >= state.resets_at_ms:
            exhausts, runs_out = None, "after_reset"
    out["exhausts_at_ms"] = exhausts
    out["runs_out"] = runs_out
    return out


async def read_budgets(svc: Services) -> list[dict[str, Any]]:
    """The budgets the store knows, as they stand now, each with its burn rate (and fed to
    this process's tracker)."""
    names = await budget_names(svc)
    if not names:
        return []
    states = await svc.queue.budgets.get_many(names)
    now_ms = int(time.time() * 1000)
    out = []
    tracker = svc.burn
    for state in states:
        if state is None:
            continue
        tracker.observe(state.name, state.charged)
        out.append(_budget_out(state, tracker.per_minute(state.name), now_ms))
    tracker.forget({s.name for s in states if s is not None})
    return out


async def snapshot(svc: Services, who: Caller, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The queue now: states, cumulative totals, rates since ``previous`` (per second; None
    for the first), flow gates, pressure, workers, and budgets for an admin (None otherwise).
    Raises SluiceError (or OSError) when Redis cannot be read."""
    q = svc.queue
    counts, flow, workers, pressure = await asyncio.gather(
        q.counts(), q.flow(), q.workers(), svc.pressure.read()
    )
    budgets: list[dict[str, Any]] | None = None
    if who.admin:
        try:
            budgets = await read_budgets(svc)
        except (SluiceError, OSError) as exc:
            log.warning("live: budgets could not be read (%s)", exc)
            budgets = []
    now = time.time()
    totals = {k: v for k, v in counts.items() if k not in _LIVE_STATES}
    rates: dict[str, float] | None = None
    if previous is not None:
        dt = now - previous["at"]
        if dt > 0:
            rates = {k: max(v - previous["totals"].get(k, v), 0) / dt for k, v in totals.items()}
    slots = sum(w.concurrency or 0 for w in workers)
    return {
        "queue": q.name,
        "at": now,
        "states": {s: counts[s] for s in _LIVE_STATES},
        "totals": totals,
        "rates": rates,
        "flow": dataclasses.asdict(flow),
        "pressure": dataclasses.asdict(pressure),
        "workers": {"count": len(workers), "slots": slots},
        "budgets": budgets,
    }
