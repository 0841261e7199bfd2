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


def lua_include() -> str:
    """The Lua include ``wire``: LEASED_FIELDS, LEASED (name -> 1-based offset in a job's
    group), KIND (lowercase member name -> byte) and ADDED (name -> 1-based offset in a job's
    options)."""
    offsets = ", ".join(f"{name} = {i + 1}" for i, name in enumerate(LEASED))
    kinds = ", ".join(f"{kind.name.lower()} = '{kind.decode()}'" for kind in Kind)
    added = ", ".join(f"{name} = {i + 1}" for i, name in enumerate(ADDED))
    return (
        "-- Generated from sluice/engine/wireformat.py when the scripts load: edit it there.\n"
        f"local LEASED_FIELDS = {LEASED_FIELDS}\n"
        f"local LEASED = {{{offsets}}}\n"
        f"local KIND = {{{kinds}}}\n"
        f"local ADDED = {{{added}}}"
    )
