"""What the token ledger answers and takes: budget states, reservations, settlements, and
the checks of names, ids and amounts (budgets.py does the work, in Lua)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from sluice.engine.job import MAX_TOKENS
from sluice.errors import BudgetError

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
#: The budgets of the token-rate limit's longer windows (engine/windows.py) are named this
#: plus their window in ms.
TOKEN_CAP_PREFIX = "#tok:"  # noqa: S105 - a key name, not a secret
#: Holds settled per sweep script call (sweep.lua: SWEEP_MAX).
SWEEP_MAX = 100
#: How long a budget operation id is remembered (ms): 8 days, like a settled reservation.
OP_ID_KEEP_MS = 8 * 86_400_000


@dataclass(frozen=True, slots=True)
class BudgetState:
    """One budget as it stands now (its window moved on first). Times are Unix ms.

    ``limit`` is the standing limit of every window; ``credit`` a one-off credit
    the current window admits on top of it (:meth:`Budgets.credit`).
    ``used`` counts held reservations and committed usage in the current window,
    everything a handler reported included, even past the limit; ``remaining`` is
    ``limit + credit - used`` and never below zero, ``overspent`` is
    ``used - (limit + credit)`` when that is above zero (the budget then admits
    nothing). ``beyond_estimates``:
    tokens charged beyond the estimates of reservations, since the budget was
    made (what makes a budget overspent). ``resets_at_ms``:
    when the calendar window turns, or when the oldest charge leaves a rolling
    window (None: no window, or nothing to expire). ``charged``: the tokens of
    every settled reservation (committed, or an unknown outcome) since the budget
    was made, whatever its windows: the money spent, never the held estimates;
    its rate over time is the burn rate (it restarts at 0 when a budget is
    restored after Redis lost it).
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
    credit: int = 0
    charged: int = 0


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


@dataclass(frozen=True, slots=True)
class BudgetChange:
    """The answer to :meth:`Budgets.set_limit`, :meth:`Budgets.adjust` and :meth:`Budgets.credit`."""

    budget: str
    #: the standing limit after the operation
    limit: int
    #: the current window's one-off credit after the operation
    credit: int
    #: False when this operation id had been applied before: nothing changed now, and the
    #: figures are those the first call left
    applied: bool = True


@dataclass(frozen=True, slots=True)
class BudgetCopy:
    """What it takes to make a budget again after Redis lost it (:meth:`Budgets.copies`,
    :meth:`Budgets.restore`): its definition, its credit, and what its window had used
    at ``at_ms`` (Redis's clock)."""

    name: str
    limit: int
    used: int
    #: '' (none), 'day', 'month' or 'roll'
    win: str
    win_ms: int
    parent: str | None
    credit: int
    #: the window the credit belongs to, as the budget stores it
    credit_p: int
    at_ms: int


@dataclass(frozen=True, slots=True)
class HeldReservation:
    """A caller's reservation that is still held (see :meth:`Budgets.held`). Times are Unix ms."""

    id: str
    #: the budgets it charges, its own first
    budgets: tuple[str, ...]
    tokens: int
    reserved_at_ms: int
    #: when its hold ends; after that a sweep settles it as an unknown outcome
    expires_at_ms: int
    #: the job id the caller gave, or None
    job: str | None


def is_rate_budget(name: str) -> bool:
    """Whether ``name`` is one of the budgets behind the token-rate windows."""
    return name == TOKEN_RATE_BUDGET or (
        name.startswith(TOKEN_CAP_PREFIX) and name[len(TOKEN_CAP_PREFIX) :].isdigit()
    )


def token_cap_budget(window_ms: int) -> str:
    """The name of the budget behind the token-rate window of ``window_ms`` beyond the paced one."""
    return f"{TOKEN_CAP_PREFIX}{window_ms}"


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


def check_op_id(op_id: object) -> str | None:
    if op_id is None:
        return None
    if not isinstance(op_id, str) or not _RID.match(op_id):
        raise BudgetError(
            f"operation id {op_id!r} is not usable: use 1-200 characters from A-Z a-z 0-9 _ . : - "
            "(e.g. a UUID made once per change and sent again with every retry of it)"
        )
    return op_id


def stored_rid(rid: str) -> str:
    """Callers' reservations live apart from the dispatch script's (``<job id>:<token>``,
    always starting with a digit), so no id a caller picks can meet one of those."""
    return "u:" + rid


def window_args(window: str | float | None) -> tuple[str, int]:
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


def settlements_of(raw: list[Any]) -> list[Settlement]:
    return [
        Settlement(
            raw[i].decode().removeprefix("u:"), raw[i + 1].decode(), bool(raw[i + 2]), int(raw[i + 3]), 0
        )
        for i in range(0, len(raw), 4)
    ]


def state_of(name: str, v: list[Any]) -> BudgetState | None:
    if v[0] is None:
        return None
    limit, used = int(v[0]), int(v[1])
    win = v[2].decode() if v[2] else ""
    window = {"": None, "roll": "rolling"}.get(win, win)
    turns = int(v[10])
    credit = int(v[12])
    return BudgetState(
        name=name,
        limit=limit,
        used=used,
        remaining=max(limit + credit - used, 0),
        window=window,
        window_seconds=int(v[3]) / 1000 if win == "roll" else None,
        parent=v[5].decode() or None,
        accepted=int(v[6]),
        rejected=int(v[7]),
        unknown_outcomes=int(v[8]),
        parked=int(v[9]),
        resets_at_ms=turns if turns >= 0 else None,
        overspent=max(used - limit - credit, 0),
        beyond_estimates=int(v[11]),
        credit=credit,
        charged=int(v[13]),
    )
