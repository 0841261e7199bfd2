"""Jobs: what a producer asks for (JobSpec), and what Redis holds (JobRecord)."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass
from typing import Any

import orjson

from sluice.engine.backoff import DEFAULT_BACKOFF, Backoff
from sluice.engine.codec import JSONValue, decode
from sluice.engine.keys import check_caller_id
from sluice.errors import CorruptJobError, InvalidJobError
from sluice.settings import DEFAULT_MAX_STALLS

#: Priorities run from 0 (first) to MAX_PRIORITY; the waiting score packs the
#: priority above a 32-bit sequence number, and both must fit a double exactly.
MAX_PRIORITY = 2**20 - 1
MAX_ATTEMPTS = 1000
MAX_NAME_LENGTH = 200
MAX_IDEMPOTENCY_KEY_LENGTH = 400
#: Token counts stay below 10**12: Lua holds numbers as doubles and writes
#: them with 14 significant digits, so larger ones would come back as 1e+15.
MAX_TOKENS = 10**12
ON_EXHAUSTED = ("reject", "wait")
_BUDGET_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
#: A correlation id: printable ASCII without spaces, so it is safe on a log line as is.
_CORRELATION_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
#: A W3C ``traceparent``: version-traceid-parentid-flags in lowercase hex; a later version may
#: append fields after a dash. Longer than this is not a trace context.
MAX_TRACE_CONTEXT_LENGTH = 256
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-[\x21-\x7e]*)?")


def valid_trace_context(value: object) -> str | None:
    """``value`` if it is a W3C traceparent that may be carried, else None.

    A job's trace context only joins its spans to a trace: one that is too long, not in
    the W3C format (version ff, an all-zero trace or parent id, an extra field on version
    00) is dropped, never a reason to refuse or fail a job.
    """
    if not isinstance(value, str) or len(value) > MAX_TRACE_CONTEXT_LENGTH:
        return None
    found = _TRACEPARENT.fullmatch(value)
    if found is None:
        return None
    version, trace_id, parent_id, extra = found.groups()
    if version == "ff" or (version == "00" and extra) or not int(trace_id, 16) or not int(parent_id, 16):
        return None
    return value


class JobState(enum.StrEnum):
    """Where a job is in its lifecycle (see docs/architecture.md for the diagram)."""

    WAITING = "waiting"
    DELAYED = "delayed"
    #: waiting for its budget to have room again (a top-up or a new window)
    PARKED = "parked"
    ACTIVE = "active"
    COMPLETED = "completed"
    DEAD = "dead"
    CANCELLED = "cancelled"
    #: its budget could not admit it and its policy was on_exhausted="reject"; it never spent
    REJECTED = "rejected"
    #: it spent tokens in earlier attempts (which failed, were throttled or lost), then its
    #: budget refused to run it again (on_exhausted="reject"); ``JobRecord.spent`` says how many
    EXHAUSTED = "exhausted"

    @property
    def finished(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {JobState.COMPLETED, JobState.DEAD, JobState.CANCELLED, JobState.REJECTED, JobState.EXHAUSTED}
)


def _seconds(what: str, value: object, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidJobError(f"{what} must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidJobError(f"{what} must be {bound} seconds, got {value!r}")
    return float(value)


def _int(what: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidJobError(f"{what} must be an integer from {low} to {high}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job to add; validated on construction, before anything is written.

    ``priority``: 0 runs first; FIFO among equal priorities.
    ``delay``: seconds before the job may run.
    ``max_attempts``: tries before the job is dead-lettered (1 = no retry).
    ``timeout``: seconds a single attempt may run (None: the worker's default).
    ``idempotency_key``: adding the same key again (within the queue's
    idempotency TTL) returns the first job instead of adding another.
    ``max_stalls``: how often the job's lease may expire (its worker died)
    before it is dead-lettered rather than run again (default 5: see settings.py).
    ``tokens``: the job's token estimate (prompt + max output tokens), reserved
    from the queue's token-rate limit and from ``budget`` when it is dispatched,
    and corrected with the usage the handler reports.
    ``budget``: the ledger budget the job spends from (and every budget above it).
    ``on_exhausted``: when the budget cannot admit the estimate, "reject" ends
    the job as rejected (not a failure); "wait" parks it until a top-up or a
    new window.
    ``correlation_id``: an id of the request that made the job (the service
    passes its ``X-Request-ID``), given to every attempt as
    ``JobContext.correlation_id`` and put on the worker's log lines about it,
    so that one id follows the work from the HTTP request to the handler.
    ``job_id``: the job's id, given by the caller (the service gives its store's id), so that
    one id names the job everywhere; None: the queue's next sequence number. Adding a job
    whose id the queue still holds returns that job, ``created=False``, as an idempotency
    key would (for as long as the record is kept: see retention).
    ``trace_context``: the W3C ``traceparent`` of the span that added the job
    (``sluice.tracing`` sets it when tracing is on), carried through Redis to
    every attempt as ``JobContext.trace_context``; one that is malformed or
    too long is dropped (set to None), never an error.
    """

    name: str
    payload: JSONValue = None
    priority: int = 0
    delay: float = 0.0
    max_attempts: int = 3
    backoff: Backoff = DEFAULT_BACKOFF
    timeout: float | None = None
    idempotency_key: str | None = None
    max_stalls: int = DEFAULT_MAX_STALLS
    tokens: int = 0
    budget: str | None = None
    on_exhausted: str = "reject"
    correlation_id: str | None = None
    trace_context: str | None = None
    job_id: str | None = None

    def __post_init__(self) -> None:
        given: object = self.name
        if isinstance(given, JobSpec):  # Queue.add(spec): a natural mistake, named as such
            raise InvalidJobError(
                "Queue.add takes a job's name and payload; add a JobSpec with add_bulk([spec])"
            )
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_NAME_LENGTH:
            raise InvalidJobError(
                f"job name must be a non-empty string of at most {MAX_NAME_LENGTH} characters, "
                f"got {self.name!r}"
            )
        _int("priority", self.priority, 0, MAX_PRIORITY)
        _seconds("delay", self.delay, allow_zero=True)
        _int("max_attempts", self.max_attempts, 1, MAX_ATTEMPTS)
        _int("max_stalls", self.max_stalls, 0, MAX_ATTEMPTS)
        if not isinstance(self.backoff, Backoff):
            raise InvalidJobError(f"backoff must be a sluice.Backoff, got {self.backoff!r}")
        if self.timeout is not None:
            _seconds("timeout", self.timeout, allow_zero=False)
        key = self.idempotency_key
        if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_LENGTH):
            raise InvalidJobError(
                "idempotency_key must be a non-empty string of at most "
                f"{MAX_IDEMPOTENCY_KEY_LENGTH} characters, got {key!r}"
            )
        _int("tokens", self.tokens, 0, MAX_TOKENS)
        budget = self.budget
        if budget is not None and (not isinstance(budget, str) or not _BUDGET_NAME.match(budget)):
            raise InvalidJobError(
                f"budget {self.budget!r} is not a budget name: use 1-100 characters from A-Z a-z 0-9 _ . : -"
            )
        if budget is not None and self.tokens < 1:
            # Admission compares the estimate with the room left: without one, a job would
            # be admitted by a full budget and spend whatever it spends.
            raise InvalidJobError(
                f"a job that spends from budget {budget!r} needs tokens=, its token estimate "
                "(prompt tokens + max output tokens), of at least 1"
            )
        if self.on_exhausted not in ON_EXHAUSTED:
            raise InvalidJobError(f'on_exhausted must be "reject" or "wait", got {self.on_exhausted!r}')
        cid = self.correlation_id
        if cid is not None and (not isinstance(cid, str) or not _CORRELATION_ID.match(cid)):
            raise InvalidJobError(
                f"correlation_id must be 1-128 printable ASCII characters without spaces, got {cid!r}"
            )
        if self.trace_context is not None:
            object.__setattr__(self, "trace_context", valid_trace_context(self.trace_context))
        if self.job_id is not None:
            check_caller_id(self.job_id)


@dataclass(frozen=True, slots=True)
class AttemptSpend:
    """What one attempt's token reservation charged, as the job record lists it."""

    #: the reservation id (``Budgets.reservation`` reads it while it is kept)
    reservation: str
    #: tokens reserved at dispatch (the job's estimate)
    estimate: int
    #: tokens the handler reported (None: it did not report)
    reported: int | None
    #: tokens charged in the end: the report, the estimate kept, or 0 if refunded
    charged: int
    #: how the attempt ended: completed, failed, timed out, released, cancelled, throttled,
    #: or lease lost (its worker died)
    outcome: str


def _spend_list(job_id: str, raw: bytes | None) -> tuple[AttemptSpend, ...]:
    if raw is None:
        return ()
    try:
        items = orjson.loads(raw)
        return tuple(
            AttemptSpend(str(r), int(e), None if int(u) < 0 else int(u), int(c), str(o))
            for r, e, u, c, o in items
        )
    except (ValueError, TypeError) as exc:
        raise CorruptJobError(job_id, f"field 'spend' is not a list of attempts ({exc})") from None


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job as stored in Redis, parsed and checked. Times are Unix milliseconds."""

    id: str
    name: str
    state: JobState
    payload: JSONValue
    priority: int
    attempt: int
    max_attempts: int
    failures: int
    stalls: int
    max_stalls: int
    timeout: float | None
    backoff: Backoff
    created_ms: int
    due_ms: int | None
    started_ms: int | None
    finished_ms: int | None
    worker: str | None
    result: JSONValue
    error: str | None
    idempotency_key: str | None
    cancel_requested: bool
    tokens: int = 0
    budget: str | None = None
    on_exhausted: str = "reject"
    #: tokens the last attempt reported using (None: not reported)
    usage: int | None = None
    #: the last attempt's reservation id (see Budgets.reservation)
    reservation: str | None = None
    #: the budget a parked job waits for
    parked_on: str | None = None
    #: tokens its attempts' reservations charged in all (money spent on it)
    spent: int = 0
    #: what each attempt's reservation charged, oldest first (the last 20 attempts)
    attempts_spend: tuple[AttemptSpend, ...] = ()
    #: the id of the request that made the job (JobSpec.correlation_id)
    correlation_id: str | None = None
    #: the W3C traceparent of the span that added the job (JobSpec.trace_context), if valid
    trace_context: str | None = None

    @classmethod
    def from_hash(cls, job_id: str, raw: dict[bytes, bytes], idem_prefix: str = "") -> JobRecord:
        """Parse a job hash; raises CorruptJobError naming the bad field."""
        h = {k.decode(): v for k, v in raw.items()}

        def text(name: str) -> str:
            if name not in h:
                raise CorruptJobError(job_id, f"field {name!r} is missing")
            return h[name].decode()

        def num(name: str, *, optional: bool = False) -> int | None:
            if optional and name not in h:
                return None
            value = text(name)
            try:
                return int(value)
            except ValueError:
                raise CorruptJobError(job_id, f"field {name!r} is {value!r}, not an integer") from None

        def need(name: str) -> int:
            value = num(name)
            assert value is not None
            return value

        version = text("v")
        if version != "1":
            raise CorruptJobError(job_id, f"record version {version!r}; this Sluice reads version 1")
        try:
            state = JobState(text("state"))
        except ValueError:
            raise CorruptJobError(job_id, f"unknown state {h['state']!r}") from None
        try:
            payload = decode(h["payload"]) if "payload" in h else None
            result = decode(h["result"]) if "result" in h else None
        except ValueError as exc:
            raise CorruptJobError(job_id, f"payload or result is not JSON ({exc})") from None
        try:
            backoff = Backoff.from_json(h["backoff"]) if "backoff" in h else DEFAULT_BACKOFF
        except (ValueError, InvalidJobError) as exc:
            raise CorruptJobError(job_id, f"backoff does not parse ({exc})") from None
        timeout_ms = need("timeout_ms")
        idem = h["idem"].decode() if "idem" in h else None
        if idem is not None and idem.startswith(idem_prefix):
            idem = idem[len(idem_prefix) :]
        return cls(
            id=job_id,
            name=text("name"),
            state=state,
            payload=payload,
            priority=need("priority"),
            attempt=need("attempt"),
            max_attempts=need("max_attempts"),
            failures=need("failures"),
            stalls=need("stalls"),
            max_stalls=need("max_stalls"),
            timeout=timeout_ms / 1000 if timeout_ms > 0 else None,
            backoff=backoff,
            created_ms=need("created"),
            due_ms=num("due", optional=True),
            started_ms=num("started", optional=True),
            finished_ms=num("finished", optional=True),
            worker=h["worker"].decode() if "worker" in h else None,
            result=result,
            error=h["error"].decode() if "error" in h else None,
            idempotency_key=idem,
            cancel_requested="cancel" in h,
            # Records written before budgets existed have no token fields.
            tokens=num("tokens", optional=True) or 0,
            budget=h["budget"].decode() if "budget" in h else None,
            on_exhausted=h["on_ex"].decode() if "on_ex" in h else "reject",
            usage=num("usage", optional=True),
            reservation=h["rid"].decode() if "rid" in h else None,
            parked_on=h["parked"].decode() if "parked" in h else None,
            spent=num("spent", optional=True) or 0,
            attempts_spend=_spend_list(job_id, h.get("spend")),
            correlation_id=h["cid"].decode() if "cid" in h else None,
            trace_context=valid_trace_context(h["trace"].decode(errors="replace")) if "trace" in h else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (for the CLI and the lab reports)."""
        return {
            "id": self.id,
            "name": self.name,
            "state": self.state.value,
            "payload": self.payload,
            "priority": self.priority,
            "attempt": self.attempt,
            "max_attempts": self.max_attempts,
            "failures": self.failures,
            "stalls": self.stalls,
            "created_ms": self.created_ms,
            "due_ms": self.due_ms,
            "started_ms": self.started_ms,
            "finished_ms": self.finished_ms,
            "worker": self.worker,
            "result": self.result,
            "error": self.error,
            "idempotency_key": self.idempotency_key,
            "tokens": self.tokens,
            "budget": self.budget,
            "on_exhausted": self.on_exhausted,
            "usage": self.usage,
            "reservation": self.reservation,
            "parked_on": self.parked_on,
            "spent": self.spent,
            "attempts_spend": [dataclasses.asdict(a) for a in self.attempts_spend],
            "correlation_id": self.correlation_id,
            "trace_context": self.trace_context,
        }
