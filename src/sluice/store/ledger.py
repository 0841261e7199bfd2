"""The ledger's copy in the store, and budgets rebuilt from it when Redis loses them.

A budget is money: a Redis that restarts without its data must not forget
what was spent and admit it again. The store keeps, per budget the service
knows (made through the API, or named by a job it accepted, and their
parents), a copy of its definition and of what its window had used, taken
every ``interval`` seconds (:meth:`Budgets.copies`). When a known budget is
missing from Redis, it is made again (:meth:`Budgets.restore`) with the used
figure of its last copy plus the estimate of every attempt the store saw
start since: those attempts reserved their estimates after the copy was
taken. Estimates, not usage: a rebuilt budget never holds less than was
spent, at the price of holding a little more until its window moves on.

What is not in the store is lost with Redis: reservations made with
``Budgets.reserve`` outside jobs after the last copy (one interval at most),
and attempts whose events the transition sink had not read yet.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import select, text, update
from sqlalchemy.dialects.postgresql import insert

from sluice.engine.budget_state import BudgetCopy
from sluice.store.schema import BudgetRow

if TYPE_CHECKING:
    from sluice.engine.queue import Queue
    from sluice.store.database import Database

log = logging.getLogger("sluice.store.ledger")

#: Budgets read per script call.
_CHUNK = 100

#: Estimates of attempts that started after ``since`` (ms), per budget the job named.
_SINCE = text(
    """
    SELECT j.budget, COALESCE(SUM(j.tokens), 0) AS tokens
    FROM job_attempts a JOIN jobs j ON j.id = a.job_id
    WHERE j.queue = :queue AND j.budget IS NOT NULL AND a.started_at > :since
    GROUP BY j.budget
    """
)


class BudgetLedger:
    """Copies a queue's budgets into the store, and makes missing ones again from there."""

    def __init__(self, queue: Queue, db: Database, *, interval: float = 5.0) -> None:
        self.queue = queue
        self.db = db
        self.interval = interval
        self._known: set[str] = set()

    async def remember(self, name: str) -> None:
        """Add a budget to those the store copies (once per process: later calls are free)."""
        if name in self._known:
            return
        async with self.db.sessions() as session, session.begin():
            await session.execute(
                insert(BudgetRow).values(queue=self.queue.name, name=name).on_conflict_do_nothing()
            )
        self._known.add(name)

    async def _rows(self) -> dict[str, BudgetRow]:
        async with self.db.sessions() as session:
            rows = (await session.scalars(select(BudgetRow).where(BudgetRow.queue == self.queue.name))).all()
        return {r.name: r for r in rows}

    async def snapshot(self) -> int:
        """Copy every known budget that Redis holds (and the parents they name); returns
        how many were copied. A budget Redis does not hold keeps its last copy."""
        rows = await self._rows()
        todo = sorted(rows)
        seen: set[str] = set()
        copied = 0
        while todo:
            chunk, todo = todo[:_CHUNK], todo[_CHUNK:]
            seen.update(chunk)
            copies = [c for c in await self.queue.budgets.copies(chunk) if c is not None]
            if copies:
                await self._save(copies)
                copied += len(copies)
            todo += sorted({c.parent for c in copies if c.parent and c.parent not in seen} - set(todo))
        return copied

    async def _save(self, copies: list[BudgetCopy]) -> None:
        values = [
            {
                "queue": self.queue.name,
                "name": c.name,
                "limit": c.limit,
                "used": c.used,
                "win": c.win,
                "win_ms": c.win_ms,
                "parent": c.parent,
                "credit": c.credit,
                "credit_p": c.credit_p,
                "snapshot_ms": c.at_ms,
            }
            for c in copies
        ]
        stmt = insert(BudgetRow).values(values)
        stmt = stmt.on_conflict_do_update(
            index_elements=[BudgetRow.queue, BudgetRow.name],
            set_={k: stmt.excluded[k] for k in values[0] if k not in ("queue", "name")},
        )
        async with self.db.sessions() as session, session.begin():
            await session.execute(stmt)

    async def restore_missing(self) -> list[str]:
        """Make again every copied budget that Redis lacks, parents first; returns their names."""
        rows = {n: r for n, r in (await self._rows()).items() if r.snapshot_ms > 0}
        if not rows:
            return []
        names = sorted(rows)
        missing: list[str] = []
        for i in range(0, len(names), _CHUNK):
            chunk = names[i : i + _CHUNK]
            missing += [
                n for n, c in zip(chunk, await self.queue.budgets.copies(chunk), strict=True) if c is None
            ]
        if not missing:
            return []
        since_ms = min(rows[n].snapshot_ms for n in missing)
        async with self.db.sessions() as session:
            found = (
                await session.execute(
                    _SINCE,
                    {"queue": self.queue.name, "since": datetime.fromtimestamp(since_ms / 1000, UTC)},
                )
            ).all()
        charged = dict.fromkeys(missing, 0)
        for budget, tokens in found:
            # A job's attempt reserved on its budget and on every budget above it.
            cur: str | None = budget
            for _ in range(8):
                if cur is None:
                    break
                if cur in charged:
                    charged[cur] += int(tokens)
                cur = rows[cur].parent if cur in rows else None
        restored: list[str] = []
        for name in sorted(missing, key=lambda n: _depth(n, rows)):
            r = rows[name]
            copy = BudgetCopy(
                name, r.limit, r.used, r.win, r.win_ms, r.parent, r.credit, r.credit_p, r.snapshot_ms
            )
            if await self.queue.budgets.restore(copy, charged_since=charged[name]):
                restored.append(name)
        if restored:
            async with self.db.sessions() as session, session.begin():
                await session.execute(
                    update(BudgetRow)
                    .where(BudgetRow.queue == self.queue.name, BudgetRow.name.in_(restored))
                    .values(restored_at=datetime.now(UTC))
                )
            log.warning(
                "ledger: %d budget(s) were missing from Redis and were rebuilt from the store: %s",
                len(restored),
                ", ".join(f"{n} (used {rows[n].used} + {charged[n]} since)" for n in restored),
                extra={"budgets": restored},
            )
        return restored

    async def run(self, stop: asyncio.Event) -> None:
        """Restore what is missing, then copy, every ``interval`` seconds until stopped."""
        while not stop.is_set():
            try:
                await self.restore_missing()
                await self.snapshot()
            except asyncio.CancelledError:
                raise
            except Exception:  # an outage of either server: the next round tries again
                log.exception("ledger: a round failed; the next one tries again")
            try:
                async with asyncio.timeout(self.interval):
                    await stop.wait()
            except TimeoutError:
                pass


def _depth(name: str, rows: dict[str, BudgetRow]) -> int:
    depth, cur = 0, rows[name].parent
    while cur is not None and cur in rows and depth < 8:
        depth, cur = depth + 1, rows[cur].parent
    return depth
