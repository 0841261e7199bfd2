"""Budgets' burn rates: how fast each one's ``charged`` counter grew lately, in one process.

The burn rate of a budget is the rate of its ``charged`` counter, the tokens
of every settled reservation whatever its windows (engine/budgets.py): what
was spent, not the estimates held, over the last :data:`RATE_SECONDS`. One
tracker per API process samples every :data:`SAMPLE_SECONDS`, whoever
watches, and hands out its last reading (live.py, the dashboard's stream).
It is given the read to make, so it knows nothing of the service's parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.engine.budget_state import BudgetState

log = logging.getLogger("sluice.service")

#: How often each API process reads its budgets (and samples their ``charged`` counters).
SAMPLE_SECONDS = 2.0
#: The span a burn rate is taken over, and the samples kept for it.
RATE_SECONDS = 60.0
HISTORY_SECONDS = RATE_SECONDS + 2 * SAMPLE_SECONDS
#: A rate needs samples at least this far apart.
MIN_SPAN_SECONDS = 4.0

#: Reads the budgets to sample (None: one that is gone).
ReadBudgets = Callable[[], Awaitable[Sequence["BudgetState | None"]]]


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

    async def sample(self, read: ReadBudgets) -> list[dict[str, Any]]:
        """Read the budgets (``read``), each with its burn rate; kept as :attr:`latest`. One
        reading at a time, so samples go in in order. Raises what ``read`` raises."""
        async with self._lock:
            states = await read()
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

    async def run(self, read: ReadBudgets, stop: asyncio.Event) -> None:
        """Sample every SAMPLE_SECONDS until ``stop`` (a store or Redis outage skips a beat)."""
        while not stop.is_set():
            try:
                await self.sample(read)
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
