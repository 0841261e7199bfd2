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

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.engine.clock import script_now
from sluice.engine.job import MAX_TOKENS
from sluice.engine.transport import reads, writes
from sluice.errors import BudgetError, BudgetExists, BudgetNotFound
from sluice.settings import DEFAULT_RESERVATION_HOLD

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.queue import Queue

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
_RID = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
#: Rolling windows are kept at most this long (their reservations are kept 8 days).
MAX_ROLLING_SECONDS = 7 * 86_400
#: How long a caller's reservation may stay held, at most (seconds): 8 days.
MAX_HOLD = 8 * 86_400.0
#: Budgets above one another; deeper hierarchies are refused.
MAX_DEPTH = 8
#: The budget that implements the queue's token-rate limit (no user name starts with '#').
TOKEN_RATE_BUDGET = "#tpm"  # noqa: S105 - a key name, not a secret


@dataclass(frozen=True, slots=True)
class BudgetState:
    """One budget as it stands now (its window moved on first). Times are Unix ms.

    ``used`` counts held reservations and committed usage in the current window,
    everything a handler reported included, even past the limit; ``remaining`` is
    ``limit - used`` and never below zero, ``overspent`` is ``used - limit`` when
    that is above zero (the budget then admits nothing). ``beyond_estimates``:
    tokens charged beyond the estimates of reservations, since the budget was
    made (what makes a budget overspent). ``resets_at_ms``:
    when the calendar window turns, or when the oldest charge leaves a rolling
    window (None: no window, or nothing to expire).
    """

    name: str
    limit: int
    used: int
    remaining: int
    window: str | None
    window_seconds: float | None
    parent: str | None
    accepted: int
    rejected: int
    unknown_outcomes: int
    parked: int
    resets_at_ms: int | None
    overspent: int = 0
    beyond_estimates: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    """The answer to :meth:`Budgets.reserve`."""

    id: str
    accepted: bool
    #: what the named budget has left after the call
    remaining: int
    #: the budget (this one or one above it) that could not admit the tokens
    refused_by: str | None = None
    #: this id had been reserved before; nothing was charged again
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Settlement:
    """The answer to :meth:`Budgets.commit` and :meth:`Budgets.refund`."""

    id: str
    #: held, committed, refunded, unknown, or missing (no such reservation)
    state: str
    #: False when the reservation had been settled before (the call changed nothing)
    changed: bool
    #: tokens the reservation charges now
    charged: int
    #: tokens charged beyond the estimate (already in ``charged``: usage is charged in full)
    beyond: int


def check_budget_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise BudgetError(
            f"budget name {name!r} is not usable: use 1-100 characters from A-Z a-z 0-9 _ . : -"
        )
    return name


def check_tokens(what: str, value: object, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_TOKENS:
        raise BudgetError(f"{what} must be an integer from {low} to {MAX_TOKENS}, got {value!r}")
    return value


def check_reservation_id(rid: object) -> str:
    if not isinstance(rid, str) or not _RID.match(rid):
        raise BudgetError(
            f"reservation id {rid!r} is not usable: use 1-200 characters from A-Z a-z 0-9 _ . : - "
            "(e.g. '<job id>:<attempt>')"
        )
    return rid


def _stored(rid: str) -> str:
    """Callers' reservations live apart from the dispatch script's (``<job id>:<token>``,
    always starting with a digit), so no id a caller picks can meet one of those."""
    return "u:" + rid


def _window_args(window: str | float | None) -> tuple[str, int]:
    if window is None:
        return "", 0
    if window in ("day", "month"):
        return str(window), 0
    if isinstance(window, bool) or not isinstance(window, int | float) or not math.isfinite(window):
        raise BudgetError(
            'window must be None, "day", "month" (UTC calendar) or a rolling number of seconds, '
            f"got {window!r}"
        )
    if not 1 <= window <= MAX_ROLLING_SECONDS:
        raise BudgetError(f"a rolling window must be 1 to {MAX_ROLLING_SECONDS} seconds, got {window!r}")
    return "roll", int(window * 1000)


def _state(name: str, v: list[Any]) -> BudgetState | None:
    if v[0] is None:
        return None
    limit, used = int(v[0]), int(v[1])
    win = v[2].decode() if v[2] else ""
    window = {"": None, "roll": "rolling"}.get(win, win)
    turns = int(v[10])
    return BudgetState(
        name=name,
        limit=limit,
        used=used,
        remaining=max(limit - used, 0),
        window=window,
        window_seconds=int(v[3]) / 1000 if win == "roll" else None,
        parent=v[5].decode() or None,
        accepted=int(v[6]),
        rejected=int(v[7]),
        unknown_outcomes=int(v[8]),
        parked=int(v[9]),
        resets_at_ms=turns if turns >= 0 else None,
        overspent=max(used - limit, 0),
        beyond_estimates=int(v[11]),
    )


class Budgets:
    """The ledger of one queue: ``queue.budgets``.

    Budgets live in the queue's hash slot, shared by all of its workers.
    ``now`` arguments (Unix ms) exist so that tests can move time; leave
    them out otherwise.
    """

    def __init__(self, queue: Queue) -> None:
        self._queue = queue
        self._keys = queue.keys

    @property
    def redis(self) -> Redis:
        return self._queue.redis

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
        win, win_ms = _window_args(window)
        if parent is not None:
            check_budget_name(parent)
            if parent == name:
                raise BudgetError(f"budget {name!r} cannot be its own parent")
        code, _ = await self._put(name, "create", limit, win, win_ms, parent or "", now)
        if code == 0 and not exist_ok:
            raise BudgetExists(name)
        if code == -2:
            raise BudgetNotFound(str(parent), f"parent budget {parent!r} does not exist; create it first")
        if code == -3:
            raise BudgetError(f"budgets may be nested at most {MAX_DEPTH} deep")
        return await self._get(name, now)

    @writes
    async def set_limit(self, name: str, limit: int, *, now: int | None = None) -> int:
        """Set a budget's limit; raising it lets parked jobs try again. Returns the limit."""
        check_budget_name(name)
        check_tokens("limit", limit)
        return await self._change(name, "limit", limit, now)

    @writes
    async def top_up(self, name: str, tokens: int, *, now: int | None = None) -> int:
        """Add ``tokens`` to a budget's limit (parked jobs try again); returns the new limit."""
        check_budget_name(name)
        check_tokens("tokens", tokens, low=1)
        return await self._change(name, "topup", tokens, now)

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
            if name != TOKEN_RATE_BUDGET:
                check_budget_name(name)
        raw = await self._queue.scripts.budget_read(keys=self._keys.flow, args=[script_now(now), *names])
        return [_state(name, raw[i * 12 : (i + 1) * 12]) for i, name in enumerate(names)]

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
        left longer (its caller crashed) disappears, and its tokens stay
        charged as spent: the caller may have called the provider. A rolling
        window still lets them go with the window; a later commit or refund
        answers ``missing``.
        """
        check_budget_name(name)
        check_tokens("tokens", tokens)
        check_reservation_id(reservation_id)
        if isinstance(hold, bool) or not isinstance(hold, int | float) or not 1 <= hold <= MAX_HOLD:
            raise BudgetError(f"hold must be from 1 to {MAX_HOLD:g} seconds, got {hold!r}")
        code, remaining, refusing = await self._queue.scripts.reserve(
            keys=self._keys.flow,
            args=[script_now(now), name, tokens, _stored(reservation_id), job_id, round(hold * 1000)],
        )
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
        for key in (prefix + _stored(reservation_id), prefix + reservation_id):
            raw: dict[bytes, bytes] = await self._queue.redis.hgetall(key)  # type: ignore[assignment]
            if raw:
                return {k.decode(): v.decode() for k, v in raw.items()}
        return None

    async def _settle(self, rid: str, how: str, tokens: int, now: int | None) -> Settlement:
        check_reservation_id(rid)
        at = script_now(now)
        state, changed, charged, beyond = await self._queue.scripts.settle(
            keys=[*self._keys.flow, self._keys.wake, self._keys.events],
            args=[at, _stored(rid), how, tokens, self._queue.events_maxlen],
        )
        return Settlement(rid, state.decode(), bool(changed), int(charged), int(beyond))

    async def _change(self, name: str, op: str, tokens: int, now: int | None) -> int:
        code, limit = await self._put(name, op, tokens, "", 0, "", now)
        if code == -1:
            raise BudgetNotFound(name)
        if code == -4:
            raise BudgetError(
                f"topping up {name!r} by {tokens} would take its limit past {MAX_TOKENS}; "
                "set a lower limit with set_limit"
            )
        return int(limit)

    async def _put(
        self, name: str, op: str, tokens: int, win: str, win_ms: int, parent: str, now: int | None
    ) -> tuple[int, int]:
        k = self._keys
        q = self._queue
        at = script_now(now)
        code, limit = await q.scripts.budget_put(
            keys=[*k.flow, k.waiting, k.wake, k.job_prefix, k.events],
            args=[at, name, op, tokens, win, win_ms, parent, q.events_maxlen, MAX_TOKENS],
        )
        return int(code), int(limit)
