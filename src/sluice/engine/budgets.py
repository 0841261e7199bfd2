"""The token ledger: budgets with limits, windows and parents, and reservations.

Every change is one Lua script (lua/budget_put.lua, reserve.lua, settle.lua),
so no interleaving of workers can admit more tokens than a limit: the check
and the charge happen in one step on every level of the hierarchy. A naive
gate (read the balance, decide, write it back) lets every worker that read
the same balance through; the lab (``sluice bench lab naive``) shows it.

Jobs added with ``budget=`` are reserved for by the dispatch script itself;
:meth:`Budgets.reserve` is for code that calls a provider outside a job.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from sluice.engine.budget_state import (
    MAX_DEPTH,
    MAX_HOLD,
    OP_ID_KEEP_MS,
    SWEEP_MAX,
    BudgetChange,
    BudgetCopy,
    BudgetState,
    HeldReservation,
    Reservation,
    Settlement,
    check_budget_name,
    check_op_id,
    check_reservation_id,
    check_tokens,
    is_rate_budget,
    settlements_of,
    state_of,
    stored_rid,
    window_args,
)
from sluice.engine.job import MAX_TOKENS
from sluice.engine.transport import reads, writes
from sluice.errors import BudgetError, BudgetExists, BudgetNotFound
from sluice.settings import DEFAULT_RESERVATION_HOLD

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.core import QueueCore


class Budgets:
    """The ledger of one queue: ``queue.budgets``.

    Budgets live in the queue's hash slot, shared by all of its workers.
    ``now`` arguments (Unix ms) exist so that tests can move time; leave
    them out otherwise.
    """

    def __init__(self, core: QueueCore) -> None:
        self._core = core
        self._keys = core.keys

    @property
    def redis(self) -> Redis:
        return self._core.redis

    @writes
    async def create(
        self,
        name: str,
        limit: int,
        *,
        window: str | float | None = None,
        parent: str | None = None,
        exist_ok: bool = False,
        now: int | None = None,
    ) -> BudgetState:
        """Create a budget of ``limit`` tokens.

        ``window``: None (the limit is for all time; top it up), "day" or
        "month" (the limit renews at each UTC calendar day or month), or a
        number of seconds (rolling: tokens charged more than that long ago no
        longer count). ``parent``: an existing budget that every reservation
        on this one must also fit (e.g. a tenant under its team).
        """
        check_budget_name(name)
        check_tokens("limit", limit)
        win, win_ms = window_args(window)
        if parent is not None:
            check_budget_name(parent)
            if parent == name:
                raise BudgetError(f"budget {name!r} cannot be its own parent")
        code = int((await self._put(name, "create", limit, win, win_ms, parent or "", now))[0])
        if code == 0 and not exist_ok:
            raise BudgetExists(name)
        if code == -2:
            raise BudgetNotFound(str(parent), f"parent budget {parent!r} does not exist; create it first")
        if code == -3:
            raise BudgetError(f"budgets may be nested at most {MAX_DEPTH} deep")
        return await self._get(name, now)

    @writes
    async def set_limit(
        self, name: str, limit: int, *, op_id: str | None = None, now: int | None = None
    ) -> BudgetChange:
        """Set the standing limit: what every window admits from now on (this one too).

        Raising it lets parked jobs try again. Absolute, so a retry is harmless;
        to change a limit by an amount without reading it first, use
        :meth:`adjust`. ``op_id``: see :meth:`adjust`.
        """
        check_budget_name(name)
        check_tokens("limit", limit)
        return await self._change(name, "limit", limit, op_id, now)

    @writes
    async def adjust(
        self, name: str, delta: int, *, op_id: str | None = None, now: int | None = None
    ) -> BudgetChange:
        """Add ``delta`` (negative to lower it) to the standing limit, atomically.

        Unlike reading the limit and setting a new one, two adjustments made at
        once both apply. ``op_id``: an id you choose for this change and send
        again with every retry of it (after a timeout or a lost connection):
        the change applies once, and a retry answers what the first call did
        (``applied=False``). Ids are remembered for 8 days; an id used for
        another operation raises ``BudgetError``. A limit may not fall below 0.
        """
        check_budget_name(name)
        if isinstance(delta, bool) or not isinstance(delta, int) or not -MAX_TOKENS <= delta <= MAX_TOKENS:
            raise BudgetError(f"delta must be an integer from {-MAX_TOKENS} to {MAX_TOKENS}, got {delta!r}")
        return await self._change(name, "adjust", delta, op_id, now)

    @writes
    async def credit(
        self, name: str, tokens: int, *, op_id: str | None = None, now: int | None = None
    ) -> BudgetChange:
        """A one-off credit: the current window admits ``tokens`` more; later ones do not.

        On a "day" or "month" budget the credit ends when the window turns; on
        a rolling one it lasts one window length from now (another credit adds
        to it and starts that length again); without a window it never ends.
        To raise what every window admits, use :meth:`adjust` or
        :meth:`set_limit`. Parked jobs try again. ``op_id``: see :meth:`adjust`.
        """
        check_budget_name(name)
        check_tokens("tokens", tokens, low=1)
        return await self._change(name, "credit", tokens, op_id, now)

    @writes
    async def top_up(
        self, name: str, tokens: int, *, op_id: str | None = None, now: int | None = None
    ) -> BudgetChange:
        """Deprecated: the name did not say whether later windows get the tokens too.
        Use :meth:`credit` (this window only, what ``top_up`` does now) or :meth:`adjust`."""
        warnings.warn(
            "Budgets.top_up is deprecated: use credit() for a one-off credit to the current window, "
            "or adjust() to raise the limit of every window",
            DeprecationWarning,
            stacklevel=2,
        )
        return await self.credit(name, tokens, op_id=op_id, now=now)

    @reads
    async def get(self, name: str, *, now: int | None = None) -> BudgetState:
        """A budget as it stands now; raises BudgetNotFound if there is none."""
        return await self._get(name, now)

    async def _get(self, name: str, now: int | None) -> BudgetState:
        (state,) = await self._states([name], now)
        if state is None:
            raise BudgetNotFound(name)
        return state

    @reads
    async def get_many(self, names: list[str], *, now: int | None = None) -> list[BudgetState | None]:
        """Many budgets as they stand now, in the order asked (None: no such budget)."""
        return await self._states(names, now)

    async def _states(self, names: list[str], now: int | None) -> list[BudgetState | None]:
        for name in names:
            if not is_rate_budget(name):  # the token-rate windows' budgets, named '#...'
                check_budget_name(name)
        raw = await self._core.run(self._core.commands.budget_read(names, now=now))
        return [state_of(name, raw[i * 14 : (i + 1) * 14]) for i, name in enumerate(names)]

    @reads
    async def copies(self, names: list[str]) -> list[BudgetCopy | None]:
        """Copies of these budgets as they stand now (None: no such budget), for keeping
        somewhere that outlives Redis; :meth:`restore` makes one again from its copy."""
        if not names:
            return []
        at = await self._core.now_ms()
        states = await self._states(names, at)
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(self._keys.budget_prefix + name, "credit_p")
            periods: list[Any] = await pipe.execute()
        out: list[BudgetCopy | None] = []
        for state, cp in zip(states, periods, strict=True):
            if state is None:
                out.append(None)
                continue
            win = {None: "", "rolling": "roll"}.get(state.window, state.window or "")
            out.append(
                BudgetCopy(
                    state.name,
                    state.limit,
                    state.used,
                    win,
                    int((state.window_seconds or 0) * 1000),
                    state.parent,
                    state.credit,
                    int(cp or 0),
                    at,
                )
            )
        return out

    @writes
    async def restore(self, copy: BudgetCopy, *, charged_since: int = 0, now: int | None = None) -> bool:
        """Make a budget again from its copy, after Redis lost it: True if made, False if
        the budget exists (a live budget is never overwritten).

        It starts with what its window had used at the copy plus
        ``charged_since`` (tokens charged after the copy was taken, as far as
        you know them): a calendar window that turned since keeps only those,
        and in a rolling window all of it counts as charged now. Restore a
        parent before its children (BudgetNotFound names a missing parent).
        """
        check_budget_name(copy.name)
        code = await self._core.run(
            self._core.commands.budget_restore(
                [
                    copy.name,
                    copy.limit,
                    copy.win,
                    copy.win_ms,
                    copy.parent or "",
                    copy.at_ms,
                    copy.used,
                    copy.credit,
                    copy.credit_p,
                    max(charged_since, 0),
                ],
                now=now,
            )
        )
        if code == -2:
            raise BudgetNotFound(copy.parent or "")
        return bool(code == 1)

    @writes
    async def reserve(
        self,
        name: str,
        tokens: int,
        reservation_id: str,
        *,
        job_id: str = "",
        hold: float = DEFAULT_RESERVATION_HOLD,
        now: int | None = None,
    ) -> Reservation:
        """Charge ``tokens`` to the budget and every budget above it, or to none.

        Atomic: it succeeds only if every level can admit the tokens. Calling
        it again with the same ``reservation_id`` charges nothing more: the
        answer is ``duplicate``, accepted unless that reservation was refunded
        or refused (a refusal is remembered as long as a hold, so a retry after
        a timeout gets the first answer). The same id on another budget raises
        ``BudgetError``.

        Commit or refund within ``hold`` seconds (default one hour). A hold
        left longer (its caller crashed) is swept (by the next reserve calls,
        the queue's workers, or :meth:`sweep`) as an unknown outcome: its
        tokens stay charged, since the caller may have called the provider,
        and each budget counts it in ``unknown_outcomes``. A rolling window
        still lets them go with the window; a later commit or refund changes
        nothing (state ``unknown``). :meth:`held` lists the holds.
        """
        check_budget_name(name)
        check_tokens("tokens", tokens)
        check_reservation_id(reservation_id)
        if isinstance(hold, bool) or not isinstance(hold, int | float) or not 1 <= hold <= MAX_HOLD:
            raise BudgetError(f"hold must be from 1 to {MAX_HOLD:g} seconds, got {hold!r}")
        call = self._core.commands.reserve(
            now=now,
            name=name,
            tokens=tokens,
            reservation=stored_rid(reservation_id),
            job_id=job_id,
            hold_ms=round(hold * 1000),
        )
        code, remaining, refusing = await self._core.run(call)
        if code == -1:
            raise BudgetNotFound(refusing.decode())
        if code == -5:
            raise BudgetError(
                f"reservation id {reservation_id!r} was reserved on budget {refusing.decode()!r}, "
                f"not {name!r}; an id names one reservation: pick a new one for this budget"
            )
        return Reservation(
            id=reservation_id,
            accepted=code in (1, 2),
            remaining=int(remaining),
            refused_by=refusing.decode() or None,
            duplicate=code in (2, 3, 4),
        )

    @writes
    async def commit(self, reservation_id: str, used_tokens: int, *, now: int | None = None) -> Settlement:
        """Charge what was actually used and give the rest of the reservation back.

        Usage above the reservation is charged in full to every level, past its
        limit if need be (the provider billed it): such a budget is ``overspent``
        and admits nothing more until its window or a top-up makes room.
        """
        check_tokens("used_tokens", used_tokens)
        return await self._settle(reservation_id, "commit", used_tokens, now)

    @writes
    async def refund(self, reservation_id: str, *, now: int | None = None) -> Settlement:
        """Give a whole reservation back (the provider was never called)."""
        return await self._settle(reservation_id, "refund", 0, now)

    @reads
    async def reservation(self, reservation_id: str) -> dict[str, str] | None:
        """A reservation's stored fields (amt, est, b, state, ...), or None.

        Looks up a caller's reservation of that id first, then a job's (the
        ``JobRecord.reservation`` or ``JobContext.reservation_id`` of an attempt).
        """
        check_reservation_id(reservation_id)
        prefix = self._keys.reservation_prefix
        for key in (prefix + stored_rid(reservation_id), prefix + reservation_id):
            raw: dict[bytes, bytes] = await self._core.redis.hgetall(key)  # type: ignore[assignment]
            if raw:
                return {k.decode(): v.decode() for k, v in raw.items()}
        return None

    @reads
    async def held(self, *, budget: str | None = None, limit: int = 1000) -> list[HeldReservation]:
        """Callers' reservations still held, the first to expire first (at most ``limit``).

        ``budget``: only those charging it (at any level). Reservations the
        dispatch script made for jobs are not here: they end with their
        attempt, or with its lease (see the active jobs).
        """
        if budget is not None:
            check_budget_name(budget)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100_000:
            raise BudgetError(f"limit must be an integer from 1 to 100000, got {limit!r}")
        out: list[HeldReservation] = []
        start = 0
        page = 500
        prefix = self._keys.reservation_prefix
        while len(out) < limit:
            ids: list[tuple[bytes, float]] = await self.redis.zrange(  # type: ignore[assignment]
                self._keys.held, start, start + page - 1, withscores=True
            )
            if not ids:
                break
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid, _ in ids:
                    pipe.hmget(prefix + rid.decode(), "state", "amt", "b", "at", "job")
                rows = await pipe.execute()
            for (rid, deadline), (state, amt, names, at, job) in zip(ids, rows, strict=True):
                if state != b"held":
                    continue  # settled or gone since it was indexed; the next sweep drops it
                levels = tuple(names.decode().split()) if names else ()
                if budget is not None and budget not in levels:
                    continue
                out.append(
                    HeldReservation(
                        id=rid.decode().removeprefix("u:"),
                        budgets=levels,
                        tokens=int(amt or 0),
                        reserved_at_ms=int(at or 0),
                        expires_at_ms=int(deadline),
                        job=job.decode() or None if job else None,
                    )
                )
                if len(out) >= limit:
                    break
            start += page
        return out

    @writes
    async def sweep(
        self, ids: list[str] | None = None, *, refund: bool = False, now: int | None = None
    ) -> list[Settlement]:
        """Settle callers' holds that nobody will settle; returns what each became.

        Without ``ids``: every hold whose time ran out, as an unknown outcome
        (the queue's workers and each reserve call do this as well, a few at a
        time). With ``ids``: those holds now, whatever their time (a caller you
        know has crashed), as unknown outcomes, or refunded with ``refund=True``
        when you know the provider was never called. An id that is not held any
        more is left as it is (its state is in the answer).
        """
        commands = self._core.commands
        out: list[Settlement] = []
        if ids is None:
            if refund:
                raise BudgetError(
                    "refund=True needs the ids of the holds to refund; expired holds are unknown outcomes"
                )
            while True:
                raw = await self._core.run(commands.sweep(now=now, how="unknown"))
                out += settlements_of(raw)
                if len(raw) < 4 * SWEEP_MAX:
                    return out
        for rid in ids:
            check_reservation_id(rid)
        how = "refund" if refund else "unknown"
        for i in range(0, len(ids), SWEEP_MAX):
            chunk = [stored_rid(rid) for rid in ids[i : i + SWEEP_MAX]]
            out += settlements_of(await self._core.run(commands.sweep(now=now, how=how, reservations=chunk)))
        return out

    async def _settle(self, rid: str, how: str, tokens: int, now: int | None) -> Settlement:
        check_reservation_id(rid)
        call = self._core.commands.settle(now=now, reservation=stored_rid(rid), how=how, tokens=tokens)
        state, changed, charged, beyond = await self._core.run(call)
        return Settlement(rid, state.decode(), bool(changed), int(charged), int(beyond))

    async def _change(
        self, name: str, op: str, tokens: int, op_id: str | None, now: int | None
    ) -> BudgetChange:
        check_op_id(op_id)
        reply = await self._put(name, op, tokens, "", 0, "", now, op_id or "")
        code, limit, credit = int(reply[0]), int(reply[1]), int(reply[2])
        if code == -1:
            raise BudgetNotFound(name)
        if code == -4:
            raise BudgetError(
                f"{op} of {tokens} on {name!r} would take what it admits past {MAX_TOKENS} "
                f"(limit {limit}, credit {credit}); nothing was changed"
            )
        if code == -5:
            raise BudgetError(
                f"adjusting {name!r} by {tokens} would take its limit ({limit}) below 0; nothing was changed"
            )
        if code == -6:
            raise BudgetError(
                f"operation id {op_id!r} was used for {reply[3].decode()} on {reply[4].decode()!r}, not "
                f"this {op} on {name!r}; an id names one operation: make a new one for each change"
            )
        return BudgetChange(name, limit, credit, applied=code == 1)

    async def _put(
        self,
        name: str,
        op: str,
        tokens: int,
        win: str,
        win_ms: int,
        parent: str,
        now: int | None,
        op_id: str = "",
    ) -> list[Any]:
        call = self._core.commands.budget_put(
            now=now,
            name=name,
            op=op,
            tokens=tokens,
            win=win,
            win_ms=win_ms,
            parent=parent,
            max_tokens=MAX_TOKENS,
            op_id=op_id,
            op_id_keep_ms=OP_ID_KEEP_MS,
        )
        reply: list[Any] = await self._core.run(call)
        return reply
