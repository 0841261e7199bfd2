"""Failure categories: what kind of failure a pattern is, by rules, and what to do about it.

Each pattern is classified by rules (:func:`classify`) into a category that
says what to do about it (:data:`ADVICE`), so the analysis of failures is
useful without any LLM; the optional LLM explanation (``llm/analysis.py``)
says more about the one at hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


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
