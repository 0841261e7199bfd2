"""What the dashboard shows live: the queue now, its rates, and budgets with their burn rate.

One snapshot is a handful of concurrent reads (the same kind the Prometheus
scrape makes, none of them a scan over jobs): the live states' sizes and the
cumulative counters, the flow gates, the workers' heartbeats and the pressure
gauge's last reading. Rates are the counters' differences between two
snapshots of one stream, so every viewer sees rates over the interval it
watches, and nothing is kept in Redis for them.

Budgets are read by one sampler per API process (burn.py's ``BurnTracker``,
with :func:`budget_states` as its read), whoever watches: a snapshot hands out
the sampler's last reading, so a hundred admins watching cost what one does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
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


async def budget_states(svc: Services) -> list[BudgetState | None]:
    """The budgets the store knows for this queue (:func:`budget_names`), as Redis holds them
    now (None: a budget the store knows and Redis does not). Raises StoreUnavailable or
    RedisUnavailable."""
    try:
        names = await budget_names(svc)
    except SluiceError:
        raise
    except Exception as exc:  # the driver's own errors: a 503, as a failed write is
        raise StoreUnavailable(f"the budgets' names could not be read: {type(exc).__name__}") from exc
    return await svc.queue.budgets.get_many(names) if names else []


async def sample_budgets(svc: Services) -> list[dict[str, Any]]:
    """The process's burn tracker's reading of the budgets now (see burn.py)."""
    return await svc.burn.sample(functools.partial(budget_states, svc))


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
