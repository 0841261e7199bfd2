"""Failure patterns: jobs that ended badly, grouped by what went wrong, classified by rules.

A dead-letter queue of ten thousand jobs is usually a handful of problems.
Each such job is *fingerprinted* (:func:`fingerprint`): the first line of its
error (what the engine records is ``Name: message`` and then the traceback)
with what varies between occurrences masked (ids, numbers, paths, URLs,
addresses, quoted values), its error type and its job type. Jobs with the
same fingerprint in one tenant's queue are one pattern, with a count and
first/last seen. Each pattern is *classified* by rules (:func:`classify`)
into a category that says what to do about it (:data:`ADVICE`), so the
analysis is useful without any LLM; the optional LLM explanation
(``llm/analysis.py``) is cached on the pattern's row.

:class:`PatternCollector` counts them: a periodic, bounded pass like the
reconciler's, in the process whose sink leads. It pages through the jobs
that ended badly by ``(updated_at, id)`` (the partial index
``ix_job_states_failed``), 500 a page, one transaction per page, and only through
jobs updated more than ``settle`` seconds ago, so that a sink batch that
committed late (its ``updated_at`` is taken before it connects, so it may
commit seconds after that time) is not passed by. A batch that commits later
still lands behind the pass's cursor: each pass therefore first looks back
``overlap`` seconds behind it, for the jobs there that are not counted yet
(only those: a job already counted at its lease is left out by the query). What
was counted is remembered per job in ``failure_pattern_jobs``, with the lease
(highest attempt token) it was counted at:

* a job is counted once, however often it is paged through (passes,
  restarts, two collectors at once: the membership row is written first,
  ``ON CONFLICT ... WHERE`` the token is higher, and only the rows it wrote
  are counted);
* a job that was redriven and died again counts again (a new death after a
  new lease), and moves to its new pattern; the old pattern keeps its count,
  which counts deaths, not distinct jobs. A death the store learnt of from
  the reconciler (the engine's record, when its events were lost) carries
  no new attempt, so such a second death is not counted.

Which jobs count: DEAD_LETTER, and REJECTED and EXHAUSTED too: a budget or
an admission limit that refuses jobs is a failure an operator needs to see
as much as a crashing handler. A REJECTED job whose reason names a budget or
a limit, and every EXHAUSTED one, is in the budget category; another
rejection (a stored job the engine cannot take) is classified by the rules.
CANCELLED jobs do not count: someone asked for it.

Where a restarted collector goes on is derived, not stored: the latest
``dead_at`` of the membership table, less a margin (clocks of the API
processes that led before may differ); paging again over jobs already
counted costs a read and counts nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

import orjson
from sqlalchemy import Select, select, text, tuple_, update

from sluice.errors import InvalidJobError
from sluice.store.job import StoredJob
from sluice.store.schema import FailurePatternJobRow, FailurePatternRow, JobRow, JobStateRow

if TYPE_CHECKING:
    from sluice.store.database import Database

log = logging.getLogger("sluice.store.patterns")

#: The job type of the LLM explanation (``llm/analysis.py`` runs it; its result is copied here).
ANALYSIS_JOB_TYPE = "failure-analysis"
#: The statuses a collector counts.
COUNTED = ("DEAD_LETTER", "REJECTED", "EXHAUSTED")
#: Longest normalized message kept (a pattern is its first few hundred characters).
MAX_MESSAGE = 300
#: Longest raw error kept as a pattern's sample.
MAX_SAMPLE = 4000
#: Jobs per page of a collector pass (one transaction each).
PAGE = 500


class Category(StrEnum):
    """What kind of failure a pattern is: each asks for a different action."""

    THROTTLE = "throttle"
    BUDGET = "budget"
    CONFIGURATION = "configuration"
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    UNKNOWN = "unknown"


#: What to do about each category, without asking an LLM.
ADVICE: dict[Category, str] = {
    Category.THROTTLE: (
        "A rate limit refused these jobs (the provider's or a queue's). Lower the queue's concurrency "
        "or token/request rate (sluice flow set), or raise the provider's quota; then redrive them."
    ),
    Category.BUDGET: (
        "A budget refused these jobs or ran out. Raise its limit or credit it (POST /v1/budgets/{name}/"
        "credit), check the jobs' token estimates, or let jobs wait for room (on_exhausted='wait'); "
        "then resubmit or redrive them."
    ),
    Category.CONFIGURATION: (
        "The workers are misconfigured (API key, model name, endpoint, environment variable, missing "
        "handler or extra). Every retry fails the same way until that is fixed on the workers; then "
        "redrive the jobs."
    ),
    Category.TRANSIENT: (
        "A temporary failure (timeout, broken connection, 5xx, unavailable service). Redrive the jobs; "
        "if it keeps happening, raise the jobs' timeout or max_attempts, or look at the dependency's health."
    ),
    Category.PERMANENT: (
        "The job itself is wrong for its handler (invalid payload, a 4xx from the provider, a bug such "
        "as a KeyError). Redriving as is fails again: fix the payload or the handler first."
    ),
    Category.UNKNOWN: (
        "No rule matched. Read the sample error and its traceback (GET /v1/jobs/{sample_job_id}), "
        "or ask for an LLM analysis of the pattern."
    ),
}


# ---- fingerprints ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What identifies a failure: ``id`` is a short stable hash of the queue, the job type,
    the error type and the normalized message. ``head`` is the raw first line (unmasked: the
    rules read status codes in it), ``message`` the same with its variable parts masked."""

    id: str
    job_type: str
    error_type: str
    message: str
    head: str


#: A class name at the start of the error, as the engine writes it (``Name: message``);
#: dotted names (``httpx.ReadTimeout``) keep their last part.
_PREFIX = re.compile(r"^((?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*))(?:\[[^\]\n]*\])?:(?:\s|$)")
#: A name in the text that is an exception class by its spelling.
_NAMED = re.compile(
    r"\b([A-Z][A-Za-z0-9]*(?:Error|Exception|Timeout|Throttled|Unavailable|Rejected|NotFound|Exhausted|Refused))\b"
)
_CLASS_LIKE = re.compile(r"^[A-Z]\w*$|(?:Error|Exception|Warning|Exit|Interrupt|Timeout)$")
#: Phrases of the engine's own errors that name no class.
_ENGINE_TYPES = ((re.compile(r"^no handler named\b"), "UnknownJobName"),)

_MASKS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+"), "<url>"),
    (re.compile(r"\b[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\b"), "<email>"),
    (
        re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
        "<uuid>",
    ),
    (re.compile(r"(?<![\w.:])\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?(?![\w.])"), "<ip>"),
    (re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{1,4}:){3,7}[0-9a-fA-F]{1,4}(?![\w:])"), "<ip>"),
    (re.compile(r"(?<![\w/<>.~-])(?:~|\.{1,2})?(?:/[\w.@%+=,-]+){2,}/?"), "<path>"),
    (re.compile(r"\b[A-Za-z]:\\[^\s'\"]+"), "<path>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<hex>"),
    (re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"), "<hex>"),
    (re.compile(r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[\w-]{16,}\b"), "<id>"),
)
_QUOTED = re.compile(r"""(?<!\w)(['"])([^'"\n]{0,200})\1(?!\w)""")
#: A quoted value kept as it is: a bare name (a key, a field, a handler), not a value. Two
#: ``KeyError: 'prompt'`` and ``KeyError: 'model'`` are two bugs; two user names are one.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z_.:-]{0,59}$|^<\w+>$")
_NUMBER = re.compile(r"(?<![A-Za-z_<])\d+(?:[.,]\d+)*(?:[eE][-+]?\d+)?")
_SPACE = re.compile(r"\s+")


def error_head(error: str) -> str:
    """The first line of a recorded error, what identifies it: the engine writes ``Name:
    message`` then the traceback; a bare traceback ends with that line instead."""
    text = error.strip()
    marker = "Traceback (most recent call last):"
    at = text.find(marker)
    if at == 0:
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln[:1].isspace()]
        last = [ln for ln in lines if not ln.startswith(marker)]
        text = last[-1] if last else ""
    elif at > 0:
        text = text[:at]
    return _SPACE.sub(" ", text).strip()[:2000]


def _error_type(head: str, status: str | None) -> tuple[str, str]:
    """The error's class name and the rest of the head line."""
    found = _PREFIX.match(head)
    if found and _CLASS_LIKE.search(found.group(2)):
        return found.group(2), head[found.end() :].strip()
    if status == "EXHAUSTED":
        return "JobExhausted", head
    if status == "REJECTED":
        return "JobRejected", head
    for phrase, name in _ENGINE_TYPES:
        if phrase.search(head):
            return name, head
    named = _NAMED.search(head)
    return (named.group(1) if named else "Error"), head


def normalize(message: str) -> str:
    """The message with what varies between occurrences masked (``<url>``, ``<email>``,
    ``<uuid>``, ``<ip>``, ``<path>``, ``<hex>``, ``<id>``, ``<str>``, ``<num>``), its
    whitespace collapsed, at most ``MAX_MESSAGE`` characters."""
    out = message
    for pattern, mask in _MASKS:
        out = pattern.sub(mask, out)
    out = _QUOTED.sub(lambda m: m.group(0) if _NAME.match(m.group(2)) else "<str>", out)
    out = _NUMBER.sub("<num>", out)
    out = _SPACE.sub(" ", out).strip()
    return out if len(out) <= MAX_MESSAGE else out[: MAX_MESSAGE - 1] + "…"


def fingerprint(error: str, job_type: str, *, queue: str = "", status: str | None = None) -> Fingerprint:
    """The fingerprint of a job's recorded error.

    ``status`` names the error type of a rejection (``JobRejected``, ``JobExhausted``: their
    reason names no class). The id hashes the queue too, so that within a tenant an id names
    one pattern (the routes look patterns up by tenant and id).
    """
    head = error_head(error or "")
    error_type, rest = _error_type(head, status)
    message = normalize(rest) or "<empty>"
    digest = hashlib.sha256("\x1f".join((queue, job_type, error_type, message)).encode()).hexdigest()
    return Fingerprint(digest[:16], job_type, error_type, message, rest)


# ---- classification -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Rule:
    """A category, by error type or by a phrase of the head line (``unless`` another)."""

    category: Category
    types: frozenset[str]
    pattern: re.Pattern[str]
    unless: re.Pattern[str] | None = None


def _re(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_BUDGET_TEXT = _re(
    r"\bbudget\b[^.;]*\b(?:refus|reject|exhaust|cannot admit|exceed|over)|no budget named|"
    r"\b(?:budget|quota|credits?)\b[^.;]*\bexhausted\b|\bexhausted\b[^.;]*\b(?:budget|quota|credits?)\b|"
    r"insufficient[_ ]quota|credit balance|billing|token estimate \d+ exceeds"
)
_CONFIG_TYPES = frozenset(
    {
        "ConfigurationError",
        "MissingExtra",
        "AuthenticationError",
        "PermissionDeniedError",
        "NotFoundModelError",
        "ModuleNotFoundError",
        "ImportError",
        "UnknownJobName",
    }
)

#: The rules, in order: the first that matches decides.
RULES: tuple[Rule, ...] = (
    Rule(
        Category.THROTTLE,
        frozenset({"Throttled", "ProviderThrottled", "RateLimitError", "RateLimited", "TooManyRequests"}),
        _re(r"\b429\b|rate[ _-]?limit|too many requests|throttl|\bquota\b|resource[_ ]exhausted"),
        unless=_re(r"insufficient[_ ]quota|budget"),
    ),
    Rule(
        Category.BUDGET,
        frozenset({"BudgetNotFound", "BudgetError", "JobExhausted", "InsufficientQuota"}),
        _BUDGET_TEXT,
    ),
    Rule(
        Category.CONFIGURATION,
        _CONFIG_TYPES,
        _re(
            r"\b40[13]\b|unauthori[sz]ed|forbidden|permission denied|invalid[ _-]?(?:api[ _-]?)?key|"
            r"incorrect api key|api[ _-]?key\b[^.;]*\b(?:missing|invalid|not set|required|expired|revoked)|"
            r"authenticat|\bkind[=: ]+(?:auth|model)\b|unknown model|model[ _]not[ _]found|no such model|"
            r"model\b[^.;]*\bdoes not exist|does not have access to (?:the )?model|"
            r"(?:environment variable|env var)\b[^.;]*\b(?:not set|missing|unset|required)|"
            r"missing (?:env(?:ironment)? var(?:iable)?s?)|"
            r"\b[A-Z][A-Z0-9_]{2,}_(?:KEY|TOKEN|URL|SECRET)\b[^.;]*\b(?:not set|missing)|"
            r"no handler named|needs the '\w+' extra"
        ),
    ),
    Rule(
        Category.TRANSIENT,
        frozenset(
            {
                "AttemptTimeout",
                "TimeoutError",
                "ReadTimeout",
                "ConnectTimeout",
                "WriteTimeout",
                "PoolTimeout",
                "ConnectionError",
                "ConnectionResetError",
                "ConnectionRefusedError",
                "ConnectionAbortedError",
                "BrokenPipeError",
                "ProviderUnavailable",
                "RedisUnavailable",
                "StoreUnavailable",
                "OutcomeUnknown",
                "APIConnectionError",
                "APITimeoutError",
                "InternalServerError",
                "ServiceUnavailableError",
                "RemoteProtocolError",
            }
        ),
        _re(
            r"timed? ?out|timeout|connection (?:reset|refused|aborted|closed|error|lost)|"
            r"connection(?:reset|refused|aborted)?error|broken pipe|"
            r"\b(?:HTTP|status(?: code)?|code|error)[ :=]*5\d\d\b|\b50[0234]\b|unavailable|temporar|"
            r"try again|overloaded|bad gateway|internal server error|ECONNRESET|ECONNREFUSED|network"
        ),
    ),
    Rule(
        Category.PERMANENT,
        frozenset(
            {
                "PermanentError",
                "ProviderRejected",
                "ValidationError",
                "ValueError",
                "TypeError",
                "KeyError",
                "IndexError",
                "AttributeError",
                "AssertionError",
                "JSONDecodeError",
                "UnicodeDecodeError",
                "ZeroDivisionError",
                "NotImplementedError",
                "InvalidJobError",
                "PayloadNotSerializable",
                "PayloadTooLarge",
                "CorruptJobError",
                "BadRequestError",
                "UnprocessableEntityError",
            }
        ),
        _re(
            r"validation|invalid|malformed|bad request|unprocessable|"
            r"\b(?:HTTP|status(?: code)?|code|error)[ :=]*4\d\d\b|\b4(?:00|04|09|10|13|15|22)\b|"
            r"is over this queue's limit|needs? (?:payload|an? object)"
        ),
    ),
)

#: Error types a handler raises to say "do not retry": the transient rule leaves them to the
#: permanent one (a PermanentError saying "upstream said 503" was a decision, not a timeout).
_DECIDED = frozenset({"PermanentError", "ProviderRejected"})
_LIMIT_REFUSAL = _re(r"exceeds the queue token-rate limit|cannot admit|no budget named")


def classify(error_type: str, head: str, *, status: str | None = None) -> Category:
    """The category of a failure, by these rules, in order (the first that matches decides):

    =============  =====================================================================
    category       matches (error type, or a phrase of the first line of the error)
    =============  =====================================================================
    (status)       EXHAUSTED; REJECTED by a budget or a limit ("cannot admit", "no budget
                   named", "exceeds the queue token-rate limit"): **budget**
    throttle       Throttled, ProviderThrottled, RateLimitError; 429, "rate limit", "too
                   many requests", "throttl", "quota" (not "insufficient_quota")
    budget         BudgetNotFound, BudgetError, JobExhausted; "budget ... refused /
                   exhausted / cannot admit", "no budget named", "insufficient_quota",
                   "billing", "credit balance"
    configuration  ConfigurationError, MissingExtra, AuthenticationError, ImportError,
                   UnknownJobName; 401/403, "unauthorized", "forbidden", "invalid api
                   key", "authentication", "unknown model", "model not found", "model ...
                   does not exist", a missing environment variable, "no handler named",
                   ProviderRejected of kind auth or model (by its message)
    transient      AttemptTimeout, TimeoutError, ConnectionError (and its kinds),
                   ProviderUnavailable, RedisUnavailable, StoreUnavailable; "timeout",
                   "connection reset / refused", 5xx, "unavailable", "temporarily",
                   "overloaded"; not when the handler raised PermanentError or
                   ProviderRejected (it said retrying cannot help)
    permanent      PermanentError, ProviderRejected, ValidationError, ValueError,
                   TypeError, KeyError, IndexError, AttributeError, InvalidJobError,
                   CorruptJobError; "validation", "invalid", "malformed", "bad request",
                   4xx; any other REJECTED job (the engine could not take it)
    unknown        nothing above
    =============  =====================================================================

    The head is read unmasked (a status code is a number); the order puts the specific
    before the general: a ``ValueError: invalid api key`` is configuration, not permanent.
    """
    if status == "EXHAUSTED" or (
        status == "REJECTED" and (_LIMIT_REFUSAL.search(head) or _BUDGET_TEXT.search(head))
    ):
        return Category.BUDGET
    for rule in RULES:
        if rule.category is Category.TRANSIENT and error_type in _DECIDED:
            continue
        if rule.unless is not None and rule.unless.search(head):
            continue
        if error_type in rule.types or rule.pattern.search(head):
            return rule.category
    return Category.PERMANENT if status == "REJECTED" else Category.UNKNOWN


def advice(category: str) -> str:
    """What to do about a pattern of this category."""
    try:
        return ADVICE[Category(category)]
    except ValueError:
        return ADVICE[Category.UNKNOWN]


#: Where a pattern's LLM analysis stands.
AnalysisState = Literal["none", "pending", "done", "failed"]


# ---- patterns as stored ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Pattern:
    """A pattern's row."""

    tenant: str
    queue: str
    id: str
    job_type: str
    error_type: str
    message: str
    category: str
    count: int
    first_seen: datetime
    last_seen: datetime
    sample_job: uuid.UUID | None
    sample_error: str | None
    analysis: dict[str, Any] | None
    analysis_at: datetime | None
    analysis_job: uuid.UUID | None
    analysis_error: str | None
    analysis_tries: int

    @property
    def advice(self) -> str:
        return advice(self.category)

    @property
    def analysis_state(self) -> AnalysisState:
        """none, pending (a job is on it), done (cached) or failed (the last job failed)."""
        if self.analysis_job is not None:
            return "pending"
        if self.analysis is not None:
            return "done"
        return "failed" if self.analysis_error is not None else "none"

    @classmethod
    def of(cls, row: FailurePatternRow) -> Pattern:
        return cls(
            tenant=row.tenant,
            queue=row.queue,
            id=row.id,
            job_type=row.job_type,
            error_type=row.error_type,
            message=row.message,
            category=row.category,
            count=row.count,
            first_seen=row.first_seen,
            last_seen=row.last_seen,
            sample_job=row.sample_job,
            sample_error=row.sample_error,
            analysis=row.analysis if isinstance(row.analysis, dict) else None,
            analysis_at=row.analysis_at,
            analysis_job=row.analysis_job,
            analysis_error=row.analysis_error,
            analysis_tries=row.analysis_tries,
        )


#: The orders a list can take.
SORTS = ("count", "last_seen")


@dataclass(frozen=True, slots=True)
class PatternJobsPage:
    """A pattern's jobs, latest death first, each with when it was counted."""

    jobs: list[tuple[StoredJob, datetime]]
    next_cursor: str | None


def _encode_cursor(at: datetime, job_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([at.isoformat(), str(job_id)])).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        at, job_id = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return datetime.fromisoformat(at), uuid.UUID(job_id)
    except (ValueError, TypeError) as exc:
        raise InvalidJobError(f"cursor {cursor!r} is not one this API gave out ({exc})") from None


def _no_nul(*values: str | None) -> bool:
    """PostgreSQL cannot keep NUL, nor compare it: a filter holding one matches nothing."""
    return not any(v is not None and "\x00" in v for v in values)


def pattern_jobs_query(
    tenant: str, queue: str, pattern_id: str, *, limit: int, after: tuple[datetime, uuid.UUID] | None = None
) -> Select[JobRow, JobStateRow, datetime]:
    """A page of a pattern's jobs, latest death first, after ``after`` (a ``(dead_at,
    job_id)``). Every column of the pattern's key is a condition, so that
    ``ix_failure_pattern_jobs_pattern`` (tenant, queue, pattern, dead_at DESC, job_id DESC)
    gives the rows in order and the page stops after ``limit`` of them: no sort of all the
    tenant's memberships per page, however many there are."""
    m = FailurePatternJobRow
    query = (
        select(JobRow, JobStateRow, m.dead_at)
        .join(JobStateRow, JobStateRow.id == JobRow.id)
        .join(m, m.job_id == JobRow.id)
        .where(m.tenant == tenant, m.queue == queue, m.pattern == pattern_id)
    )
    if after is not None:
        query = query.where(tuple_(m.dead_at, m.job_id) < tuple_(after[0], after[1]))
    return query.order_by(m.dead_at.desc(), m.job_id.desc()).limit(limit)


class PatternStore:
    """Patterns as the API and the command line read them (always within one tenant)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def list_patterns(
        self,
        tenant: str,
        *,
        queue: str | None = None,
        category: str | None = None,
        sort: str = "count",
        limit: int = 50,
        offset: int = 0,
    ) -> list[Pattern]:
        """A tenant's patterns, most frequent (or most recent) first."""
        if sort not in SORTS:
            raise InvalidJobError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
        if not _no_nul(tenant, queue, category):
            return []
        await self.settle(tenant=tenant)
        p = FailurePatternRow
        query = select(p).where(p.tenant == tenant)
        if queue is not None:
            query = query.where(p.queue == queue)
        if category is not None:
            query = query.where(p.category == category)
        first = (
            (p.count.desc(), p.last_seen.desc()) if sort == "count" else (p.last_seen.desc(), p.count.desc())
        )
        query = query.order_by(*first, p.queue, p.id).limit(limit).offset(offset)
        async with self.db.sessions() as session:
            return [Pattern.of(r) for r in await session.scalars(query)]

    async def get(self, tenant: str, pattern_id: str) -> Pattern | None:
        """A tenant's pattern by id (None: no such pattern, or another tenant's), its analysis
        settled first if its job has finished."""
        if not _no_nul(tenant, pattern_id):
            return None
        await self.settle(tenant=tenant, pattern=pattern_id)
        async with self.db.sessions() as session:
            row = await session.scalar(
                select(FailurePatternRow).where(
                    FailurePatternRow.tenant == tenant, FailurePatternRow.id == pattern_id
                )
            )
        return Pattern.of(row) if row is not None else None

    async def pattern_of(self, job_id: uuid.UUID) -> str | None:
        """The id of the pattern a job was last counted into (None: not counted yet)."""
        async with self.db.sessions() as session:
            found: str | None = await session.scalar(
                select(FailurePatternJobRow.pattern).where(FailurePatternJobRow.job_id == job_id)
            )
        return found

    async def jobs(
        self, tenant: str, queue: str, pattern_id: str, *, limit: int = 50, cursor: str | None = None
    ) -> PatternJobsPage:
        """The jobs last counted into a pattern (its key: tenant, queue, id), latest death
        first; ``cursor`` goes on."""
        if not _no_nul(tenant, queue, pattern_id):
            return PatternJobsPage([], None)
        query = pattern_jobs_query(
            tenant, queue, pattern_id, limit=limit + 1, after=_decode_cursor(cursor) if cursor else None
        )
        async with self.db.sessions() as session:
            rows = (await session.execute(query)).all()
        found = [(StoredJob.of(row, state), at) for row, state, at in rows[:limit]]
        more = len(rows) > limit and found
        return PatternJobsPage(found, _encode_cursor(found[-1][1], found[-1][0].id) if more else None)

    async def mark_pending(self, tenant: str, queue: str, pattern_id: str, job_id: uuid.UUID) -> bool:
        """The pattern's analysis is this job's to write, unless another is pending already."""
        p = FailurePatternRow
        async with self.db.sessions() as session, session.begin():
            done = await session.execute(
                update(p)
                .where(p.tenant == tenant, p.queue == queue, p.id == pattern_id, p.analysis_job.is_(None))
                .values(analysis_job=job_id)
            )
        return bool(getattr(done, "rowcount", 0))

    async def settle(
        self, *, tenant: str | None = None, pattern: str | None = None, limit: int = PAGE
    ) -> int:
        """Finished analysis jobs written onto their patterns: a completed one's result (which
        must hold a ``root_cause`` string, and the job must be of the analysis type) becomes
        the cached analysis; another end becomes ``analysis_error``. Returns how many settled.

        The worker does not write here: its job's result reaches the store like any other
        (the sink), and is copied from there, so the worker needs no database and a job
        cannot write onto a pattern that did not ask for it.
        """
        where = ["p.analysis_job IS NOT NULL"]
        params: dict[str, Any] = {"limit": limit, "type": ANALYSIS_JOB_TYPE}
        if tenant is not None:
            where.append("p.tenant = :tenant")
            params["tenant"] = tenant
        if pattern is not None:
            where.append("p.id = :pattern")
            params["pattern"] = pattern
        statement = text(_SETTLE.format(where=" AND ".join(where)))
        async with self.db.sessions() as session, session.begin():
            settled = (await session.execute(statement, params)).all()
        return len(settled)


# A completed job of the analysis type whose result has a root_cause string is the analysis;
# any other end of the job is a failure (its error's first line, or its status).
_SETTLE = """
WITH finished AS (
    SELECT p.tenant, p.queue, p.id, j.id AS job, s.updated_at,
           (s.status = 'COMPLETED' AND j.type = :type AND jsonb_typeof(s.result) = 'object'
            AND jsonb_typeof(s.result -> 'root_cause') = 'string') AS ok,
           s.result, left(split_part(COALESCE(NULLIF(s.error, ''), s.status), E'\\n', 1), 500) AS why
    FROM failure_patterns p JOIN job_states s ON s.id = p.analysis_job JOIN jobs j ON j.id = s.id
    WHERE {where}
      AND s.status IN ('COMPLETED', 'DEAD_LETTER', 'REJECTED', 'EXHAUSTED', 'CANCELLED')
    LIMIT :limit
)
UPDATE failure_patterns AS p SET
    analysis = CASE WHEN f.ok THEN f.result || jsonb_build_object('job_id', f.job::text) ELSE p.analysis END,
    analysis_at = CASE WHEN f.ok THEN f.updated_at ELSE p.analysis_at END,
    analysis_error = CASE WHEN f.ok THEN NULL
                          ELSE COALESCE(NULLIF(f.why, ''), 'the analysis job ended without a result') END,
    analysis_tries = CASE WHEN f.ok THEN p.analysis_tries ELSE p.analysis_tries + 1 END,
    analysis_job = NULL
FROM finished f
WHERE p.tenant = f.tenant AND p.queue = f.queue AND p.id = f.id AND p.analysis_job = f.job
RETURNING p.id
"""


# ---- the collector --------------------------------------------------------------------------------------
@dataclass
class CollectPass:
    """What one pass did."""

    #: jobs read
    looked: int = 0
    #: deaths counted (jobs read less those counted before at the same lease)
    counted: int = 0
    #: patterns made or updated
    patterns: int = 0
    #: analyses settled
    settled: int = 0
    #: of ``counted``: deaths found behind the cursor (a batch that committed late)
    late: int = 0


_PAGE = """
SELECT s.id, j.tenant, j.queue, j.type, s.status, s.error, s.updated_at,
       COALESCE((SELECT max(a.token) FROM job_attempts a WHERE a.job_id = s.id), 0) AS token
FROM job_states s JOIN jobs j ON j.id = s.id
WHERE s.status IN ('DEAD_LETTER', 'REJECTED', 'EXHAUSTED')
  AND (s.updated_at, s.id) > ($1, $2) AND s.updated_at < $3
ORDER BY s.updated_at, s.id
LIMIT $4
"""
# Behind the cursor: the jobs that ended badly in the overlap window and are not counted at their
# lease yet (a membership at that token or higher is a death counted). Counted rows are read by
# the index and left out, so a window of thousands of deaths costs a scan and returns the few.
_LOOK_BACK = """
SELECT s.id, j.tenant, j.queue, j.type, s.status, s.error, s.updated_at, t.token
FROM job_states s JOIN jobs j ON j.id = s.id
CROSS JOIN LATERAL (
    SELECT COALESCE(max(a.token), 0) AS token FROM job_attempts a WHERE a.job_id = s.id
) t
WHERE s.status IN ('DEAD_LETTER', 'REJECTED', 'EXHAUSTED')
  AND (s.updated_at, s.id) > ($1, $2) AND (s.updated_at, s.id) <= ($3, $4)
  AND NOT EXISTS (SELECT 1 FROM failure_pattern_jobs m WHERE m.job_id = s.id AND m.token >= t.token)
ORDER BY s.updated_at, s.id
LIMIT $5
"""
# Written first: only the rows it writes are counted, so a job read twice (passes, restarts,
# two collectors at once) counts once, and again only after a new lease (redriven, died again).
_MEMBERS = """
INSERT INTO failure_pattern_jobs AS m (job_id, tenant, queue, pattern, status, token, deaths, dead_at)
SELECT d.job_id, d.tenant, d.queue, d.pattern, d.status, d.token, 1, d.dead_at
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::timestamptz[])
     AS d(job_id, tenant, queue, pattern, status, token, dead_at)
ON CONFLICT (job_id) DO UPDATE
    SET pattern = EXCLUDED.pattern, status = EXCLUDED.status, token = EXCLUDED.token,
        deaths = m.deaths + 1, dead_at = EXCLUDED.dead_at
    WHERE m.token < EXCLUDED.token
RETURNING m.job_id
"""
_PATTERNS = """
INSERT INTO failure_patterns AS p (tenant, queue, id, job_type, error_type, message, category, count,
                                   first_seen, last_seen, sample_job, sample_error)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                     $8::bigint[], $9::timestamptz[], $10::timestamptz[], $11::uuid[], $12::text[])
ON CONFLICT (tenant, queue, id) DO UPDATE SET
    count = p.count + EXCLUDED.count,
    first_seen = LEAST(p.first_seen, EXCLUDED.first_seen),
    last_seen = GREATEST(p.last_seen, EXCLUDED.last_seen),
    category = EXCLUDED.category,
    sample_job = CASE WHEN EXCLUDED.last_seen >= p.last_seen THEN EXCLUDED.sample_job ELSE p.sample_job END,
    sample_error = CASE WHEN EXCLUDED.last_seen >= p.last_seen THEN EXCLUDED.sample_error
                        ELSE p.sample_error END
"""
_RESUME = "SELECT dead_at FROM failure_pattern_jobs ORDER BY dead_at DESC LIMIT 1"


@dataclass
class _Group:
    fp: Fingerprint
    tenant: str
    queue: str
    category: str
    count: int
    first: datetime
    last: datetime
    sample_job: uuid.UUID
    sample_error: str


class PatternCollector:
    """``run()`` every ``interval`` seconds until stopped; ``collect()`` once (tests, the CLI).

    A pass first looks ``overlap`` seconds behind its cursor for deaths not counted yet (a sink
    batch commits after the ``updated_at`` it stamps: one that took longer than ``settle``
    lands behind a cursor that has moved on), then reads at most ``pages`` pages of ``page``
    jobs (one transaction each) and settles the analyses that finished; a backlog (the first
    pass over an old dead-letter queue) is worked off over several passes.
    """

    def __init__(
        self,
        db: Database,
        *,
        interval: float = 30.0,
        settle: float = 10.0,
        pages: int = 4,
        page: int = PAGE,
        margin: float = 300.0,
        overlap: float = 300.0,
        lead: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.db = db
        self.interval = interval
        #: seconds a job's update must be old before it is read (a batch committed late)
        self.settle = settle
        self.pages = pages
        self.page = page
        #: how far before the last counted death a collector that starts or takes the lead goes
        #: back (another process's clock wrote those times)
        self.margin = margin
        #: how far behind its cursor each pass looks for deaths not counted yet (a sink batch
        #: that committed this much after the time it stamped is still counted)
        self.overlap = overlap
        #: passes run only while this returns True (the process whose sink leads); None: always
        self.lead = lead
        self.patterns = PatternStore(db)
        self._cursor: tuple[datetime, uuid.UUID] | None = None
        self._resumed = False

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if self.lead is None or await self.lead():
                    done = await self.collect()
                    if done.counted:
                        log.info(
                            "failure patterns: %d deaths counted into %d patterns (%d committed late)",
                            done.counted,
                            done.patterns,
                            done.late,
                            extra={"counted": done.counted, "patterns": done.patterns, "late": done.late},
                        )
                else:
                    self._resumed = False  # another process leads: start again from the table
            except asyncio.CancelledError:
                raise
            except Exception:  # an outage of PostgreSQL: the next pass tries again
                log.exception("failure patterns: a pass failed; the next one tries again")
            try:
                async with asyncio.timeout(self.interval):
                    await stop.wait()
            except TimeoutError:
                pass

    async def collect(self, *, now: datetime | None = None) -> CollectPass:
        """One pass: up to ``pages`` pages of jobs that ended badly, then the finished analyses."""
        done = CollectPass()
        if not self._resumed:
            self._cursor = await self._resume_point()
            self._resumed = True
        before = (now or datetime.now(UTC)) - timedelta(seconds=self.settle)
        if self._cursor is not None and self.overlap > 0:
            await self._look_back(done, self._cursor)
        for _ in range(self.pages):
            read = await self._page(done, before)
            if read < self.page:
                break
        done.settled = await self.patterns.settle()
        return done

    async def _resume_point(self) -> tuple[datetime, uuid.UUID] | None:
        async with self.db.engine.connect() as conn:
            last = (await conn.execute(text(_RESUME))).scalar()
        if last is None:
            return None
        return (last - timedelta(seconds=self.margin), uuid.UUID(int=0))

    async def _look_back(self, done: CollectPass, cursor: tuple[datetime, uuid.UUID]) -> None:
        """The deaths of the ``overlap`` seconds up to ``cursor`` that are not counted yet, up
        to ``pages`` pages of them (the cursor stays where it is)."""
        after = (cursor[0] - timedelta(seconds=self.overlap), uuid.UUID(int=0))
        for _ in range(self.pages):
            counted = done.counted
            rows = await self._count(done, _LOOK_BACK, after[0], after[1], cursor[0], cursor[1], self.page)
            done.late += done.counted - counted
            if len(rows) < self.page:
                return
            after = (rows[-1]["updated_at"], rows[-1]["id"])

    async def _page(self, done: CollectPass, before: datetime) -> int:
        """One page in one transaction; returns how many jobs it read."""
        after = self._cursor or (datetime(1970, 1, 1, tzinfo=UTC), uuid.UUID(int=0))
        rows = await self._count(done, _PAGE, after[0], after[1], before, self.page)
        if rows:
            self._cursor = (rows[-1]["updated_at"], rows[-1]["id"])
        return len(rows)

    async def _count(self, done: CollectPass, query: str, *args: Any) -> list[Any]:
        """The jobs ``query`` reads, counted into their patterns, in one transaction; returns them."""
        async with self.db.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            async with raw.transaction():
                rows: list[Any] = await raw.fetch(query, *args)
                if not rows:
                    return rows
                done.looked += len(rows)
                prints = {
                    r["id"]: fingerprint(r["error"] or "", r["type"], queue=r["queue"], status=r["status"])
                    for r in rows
                }
                counted = {
                    r["job_id"]
                    for r in await raw.fetch(
                        _MEMBERS,
                        [r["id"] for r in rows],
                        [r["tenant"] for r in rows],
                        [r["queue"] for r in rows],
                        [prints[r["id"]].id for r in rows],
                        [r["status"] for r in rows],
                        [r["token"] for r in rows],
                        [r["updated_at"] for r in rows],
                    )
                }
                groups = self._groups([r for r in rows if r["id"] in counted], prints)
                if groups:
                    await raw.execute(_PATTERNS, *_columns(groups))
                done.counted += len(counted)
                done.patterns += len(groups)
        return rows

    @staticmethod
    def _groups(rows: list[Any], prints: dict[uuid.UUID, Fingerprint]) -> list[_Group]:
        """The page's counted jobs, one group per pattern; in key order, so that two
        collectors at once lock pattern rows in the same order."""
        groups: dict[tuple[str, str, str], _Group] = {}
        for r in rows:  # oldest first: the last one seen is the sample
            fp = prints[r["id"]]
            key = (r["tenant"], r["queue"], fp.id)
            at: datetime = r["updated_at"]
            sample = (r["error"] or "")[:MAX_SAMPLE]
            g = groups.get(key)
            if g is None:
                category = classify(fp.error_type, fp.head, status=r["status"]).value
                groups[key] = _Group(fp, r["tenant"], r["queue"], category, 1, at, at, r["id"], sample)
            else:
                g.count += 1
                g.first, g.last = min(g.first, at), max(g.last, at)
                g.sample_job, g.sample_error = r["id"], sample
        return [groups[k] for k in sorted(groups)]


def _columns(groups: list[_Group]) -> tuple[list[Any], ...]:
    return (
        [g.tenant for g in groups],
        [g.queue for g in groups],
        [g.fp.id for g in groups],
        [g.fp.job_type for g in groups],
        [g.fp.error_type for g in groups],
        [g.fp.message for g in groups],
        [g.category for g in groups],
        [g.count for g in groups],
        [g.first for g in groups],
        [g.last for g in groups],
        [g.sample_job for g in groups],
        [g.sample_error for g in groups],
    )
