"""What the dashboard shows live: the queue now, its rates, and budgets with their burn rate.

One snapshot is a handful of concurrent reads (the same kind the Prometheus
scrape makes, none of them a scan over jobs): the live states' sizes and the
cumulative counters, the flow gates, the workers' heartbeats and the pressure
gauge's last reading. Rates are the counters' differences between two
snapshots of one stream, so every viewer sees rates over the interval it
watches, and nothing is kept in Redis for them.

Budgets are read by one sampler per API process (:class:`BurnTracker`), every
:data:`SAMPLE_SECONDS`, whoever watches: a snapshot hands out the sampler's
last reading, so a hundred admins watching cost what one does. The burn rate
of a budget is the rate of its ``charged`` counter, the tokens of every
settled reservation whatever its windows (engine/budgets.py): what was spent,
not the estimates held, over the last :data:`RATE_SECONDS`.
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

from sluice.errors import SluiceError, StoreUnavailable
from sluice.store.schema import BudgetRow

if TYPE_CHECKING:
    from sluice.engine.budget_state import BudgetState
    from sluice.service.context import Caller, Services

log = logging.getLogger("sluice.service")

#: Budgets shown (their names sorted), and how long the list of names is kept.
MAX_BUDGETS = 100
BUDGET_NAMES_SECONDS = 60.0
#: How often each API process reads its budgets (and samples their ``charged`` counters).
SAMPLE_SECONDS = 2.0
#: The span a burn rate is taken over, and the samples kept for it.
RATE_SECONDS = 60.0
HISTORY_SECONDS = RATE_SECONDS + 2 * SAMPLE_SECONDS
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
    """Each budget's ``charged`` counter sampled over the last HISTORY_SECONDS, in one process,
    and the last reading of the budgets with their burn rates (:meth:`sample`)."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._lock = asyncio.Lock()
        #: the budgets as the last :meth:`sample` read them (None: not read yet)
        self.latest: list[dict[str, Any]] | None = None

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

    async def sample(self, svc: Services) -> list[dict[str, Any]]:
        """Read the budgets the store knows, as they stand now, each with its burn rate; kept
        as :attr:`latest`. One reading at a time, so samples go in in order. Raises
        StoreUnavailable or RedisUnavailable."""
        async with self._lock:
            try:
                names = await budget_names(svc)
            except SluiceError:
                raise
            except Exception as exc:  # the driver's own errors: a 503, as a failed write is
                raise StoreUnavailable(f"the budgets' names could not be read: {type(exc).__name__}") from exc
            states = await svc.queue.budgets.get_many(names) if names else []
            now_ms = int(time.time() * 1000)
            out = []
            for state in states:
                if state is None:
                    continue
                self.observe(state.name, state.charged)
                out.append(_budget_out(state, self.per_minute(state.name), now_ms))
            self.forget({s.name for s in states if s is not None})
            self.latest = out
            return out

    async def run(self, svc: Services, stop: asyncio.Event) -> None:
        """Sample every SAMPLE_SECONDS until ``stop`` (a store or Redis outage skips a beat)."""
        while not stop.is_set():
            try:
                await self.sample(svc)
            except Exception:  # sampled again at the next beat
                log.debug("live: budgets could not be sampled", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_SECONDS)


def _budget_out(state: BudgetState, burn: float | None, now_ms: int) -> dict[str, Any]:
    """A budget with its burn rate and, at that rate, when it runs out: ``runs_out`` is "now",
    "yes" (at ``exhausts_at_ms``), "after_reset" (not before its calendar window turns), "no"
    (nothing burns, or a rolling window whose charges leave faster than they come) or
    "unknown" (no rate yet)."""
    out = dataclasses.asdict(state)
    out["burn_per_minute"] = burn
    exhausts: int | None = None
    runs_out = "unknown" if burn is None else "no"
    cap = state.limit + state.credit
    if state.remaining <= 0:
        exhausts, runs_out = now_ms, "now"
    elif burn is not None and burn > 0:
        if state.window == "rolling" and state.window_seconds and burn * state.window_seconds / 60 < cap:
            runs_out = "no"  # at this rate a window never holds more than the limit
        else:
            exhausts = now_ms + int(state.remaining / burn * 60_000)
            runs_out = "yes"
            if (
                state.resets_at_ms is not None
                and state.window != "rolling"
                and exhausts >= state.resets_at_ms
            ):
                exhausts, runs_out = None, "after_reset"
    out["exhausts_at_ms"] = exhausts
    out["runs_out"] = runs_out
    return out


async def snapshot(svc: Services, who: Caller, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The queue now: states, cumulative totals, rates since ``previous`` (per second; None
    for the first), flow gates and the dispatch calls each refused, pressure, workers, and
    budgets for an admin (None otherwise).
    ``_mono`` is for the next call's rates, not for sending. Raises SluiceError (or OSError)
    when Redis cannot be read."""
    q = svc.queue
    counts, flow, workers, pressure, refusals = await asyncio.gather(
        q.counts(), q.flow(), q.workers(), svc.pressure.read(), q.refusals()
    )
    totals = {k: v for k, v in counts.items() if k not in _LIVE_STATES}
    rates: dict[str, float] | None = None
    mono = time.monotonic()
    if previous is not None:
        dt = mono - previous["_mono"]
        if dt > 0:
            rates = {k: max(v - previous["totals"].get(k, v), 0) / dt for k, v in totals.items()}
    slots = sum(w.concurrency or 0 for w in workers)
    return {
        "queue": q.name,
        "at": time.time(),
        "_mono": mono,
        "states": {s: counts[s] for s in _LIVE_STATES},
        "totals": totals,
        "rates": rates,
        "flow": dataclasses.asdict(flow),
        # dispatch calls each gate turned away since the queue began
        "refusals": refusals,
        "pressure": dataclasses.asdict(pressure),
        "workers": {"count": len(workers), "slots": slots},
        # the sampler's last reading (None: not read yet), an admin's only
        "budgets": svc.burn.latest if who.admin else None,
    }
