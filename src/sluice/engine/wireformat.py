"""The dispatch script's wire, defined once for Python and Lua.

Two things cross it on every job: the kind of an attempt's outcome (one
byte, in the worker's call) and the values of a leased job (a flat group of
:data:`LEASED_FIELDS` values per job in the reply, flat because a reply of
nested tables costs Redis and hiredis more per job). Both are written here
only: the scripts' loader turns this module into the Lua include ``wire``
(:func:`lua_include`), and the runner reads a leased job's values by the
index constants below, never by a bare number.
"""

from __future__ import annotations

from enum import Enum


class Kind(bytes, Enum):
    """How an attempt ended, as the worker reports it (see lua/includes/finish.lua).

    Members are bytes, so they go on the wire as they are.
    """

    #: value: the result's JSON
    COMPLETED = b"c"
    #: value: the error; retried after the outcome's delay while attempts remain
    FAILED = b"f"
    #: value: the error; dead-lettered now
    PERMANENT = b"p"
    #: stopped hard past its timeout (the watchdog's): a failure, counted as an overrun
    OVERRAN = b"o"
    #: back to waiting unfinished, the attempt not counted
    RELEASED = b"r"
    #: cancelled while running, after a cancel request
    CANCELLED = b"x"
    #: refused by the provider; value: retry after (ms), for the whole queue
    THROTTLED = b"t"


#: A leased job's values in the dispatch reply, in order (see lua/includes/dispatch.lua).
LEASED = (
    "id",
    "token",
    "name",
    "payload",
    "attempt",
    "max_attempts",
    "timeout_ms",
    "backoff",
    "created",
    #: the job's token estimate, a whole number >= 0
    "tokens",
    #: '' for none, as for the four after it
    "budget",
    "correlation_id",
    #: when a delay or a retry's backoff made it runnable
    "due",
    "trace_context",
    #: as added
    "priority",
)
LEASED_FIELDS = len(LEASED)

#: What dispatch reads of a job it may lease, with one HMGET (``read_leasable`` in the
#: include; ``R.<field>`` is a field's place in its answer): the record fields of the leased
#: group and those the gates and the replay of a lost reply look at.
LEASE_READ = (
    "name",
    "payload",
    "max_attempts",
    "timeout_ms",
    "backoff",
    "created",
    "attempt",
    "token",
    "tokens",
    "budget",
    "on_ex",
    "score",
    "parked",
    "cid",
    "due",
    "trace",
    "priority",
    "state",
)

#: How the include's ``put_leased`` fills each leased value the script does not give
#: itself (id, token and attempt, which a lease makes anew): the record field it comes
#: from and how: as read (always set by add), '' when absent, or a count (a whole number
#: >= 0 even in a hand-edited record, which must not credit a budget).
LEASED_FROM = {
    "name": ("name", "read"),
    "payload": ("payload", "read"),
    "max_attempts": ("max_attempts", "read"),
    "timeout_ms": ("timeout_ms", "read"),
    "backoff": ("backoff", "read"),
    "created": ("created", "read"),
    "tokens": ("tokens", "count"),
    "budget": ("budget", "or_empty"),
    "correlation_id": ("cid", "or_empty"),
    "due": ("due", "or_empty"),
    "trace_context": ("trace", "or_empty"),
    "priority": ("priority", "or_empty"),
}
#: The leased values a lease makes, passed to ``put_leased`` in this order.
LEASED_GIVEN = ("id", "token", "attempt")

# 0-based offsets into one job's group (plain ints: the runner reads them once per job).
ID = LEASED.index("id")
TOKEN = LEASED.index("token")
NAME = LEASED.index("name")
PAYLOAD = LEASED.index("payload")
ATTEMPT = LEASED.index("attempt")
MAX_ATTEMPTS = LEASED.index("max_attempts")
TIMEOUT_MS = LEASED.index("timeout_ms")
BACKOFF = LEASED.index("backoff")
CREATED = LEASED.index("created")
TOKENS = LEASED.index("tokens")
BUDGET = LEASED.index("budget")
CORRELATION_ID = LEASED.index("correlation_id")
DUE = LEASED.index("due")
TRACE_CONTEXT = LEASED.index("trace_context")
PRIORITY = LEASED.index("priority")


#: A job's options as the add script takes them: one JSON array of strings in this order
#: (its payload travels beside it, as it is: see lua/add.lua). ``idem_key`` is the index of
#: the job's idempotency key among the script's KEYS ('0': none); '' is "none" for the
#: optional ones.
ADDED = (
    "name",
    "priority",
    "delay_ms",
    "max_attempts",
    "backoff",
    "timeout_ms",
    "max_stalls",
    "tokens",
    "budget",
    "on_exhausted",
    "correlation_id",
    "idem_key",
    "trace_context",
    "job_id",
)


def _put(field: str) -> str:
    if field in LEASED_GIVEN:
        return field
    source, how = LEASED_FROM[field]
    read = f"f[{LEASE_READ.index(source) + 1}]"
    if how == "count":
        return f"math.max(math.floor(tonumber({read}) or 0), 0)"
    return read if how == "read" else f"({read} or '')"


def lua_include() -> str:
    """The Lua include ``wire``: LEASED_FIELDS, LEASED (name -> 1-based offset in a job's
    group), KIND (lowercase member name -> byte), ADDED (name -> 1-based offset in a job's
    options), R (field -> its place in read_leasable's answer), read_leasable(job key) and
    put_leased(out, f, id, token, attempt), which appends one leased group to a reply."""
    offsets = ", ".join(f"{name} = {i + 1}" for i, name in enumerate(LEASED))
    kinds = ", ".join(f"{kind.name.lower()} = '{kind.decode()}'" for kind in Kind)
    added = ", ".join(f"{name} = {i + 1}" for i, name in enumerate(ADDED))
    read = ", ".join(f"{name} = {i + 1}" for i, name in enumerate(LEASE_READ))
    fields = ", ".join(f"'{name}'" for name in LEASE_READ)
    puts = "\n".join(f"  out[n + {i + 1}] = {_put(name)}" for i, name in enumerate(LEASED))
    return (
        "-- Generated from sluice/engine/wireformat.py when the scripts load: edit it there.\n"
        f"local LEASED_FIELDS = {LEASED_FIELDS}\n"
        f"local LEASED = {{{offsets}}}\n"
        f"local KIND = {{{kinds}}}\n"
        f"local ADDED = {{{added}}}\n"
        f"local R = {{{read}}}\n"
        f"local function read_leasable(jk) return redis.call('HMGET', jk, {fields}) end\n"
        "local function put_leased(out, f, id, token, attempt)\n"
        "  local n = #out\n"
        f"{puts}\n"
        "end"
    )
