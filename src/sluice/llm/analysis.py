"""The optional LLM explanation of a failure pattern: a job on the queue, under a budget.

The rules of ``store/categories.py`` say what kind of failure a pattern is and
what to do about that kind; an LLM can say more about the one at hand (the
likely root cause, the fix). It runs as a job of type ``failure-analysis``
on the same queue as everything else, so it takes its turn, is retried,
throttled and dead-lettered like any job, and it always spends from a budget
of its own (``failure-analysis`` by default, made with a daily window when
missing): an explanation nobody bounded is a bill nobody bounded. Nothing
here enqueues one without a budget, and the handler refuses a job that has
none.

The job's payload carries the pattern itself (its normalized message, types,
category, count and a sample error with whatever looks like a secret
masked), so the worker needs no database, and the sample that leaves for the
provider was masked before it entered the queue. Only the service makes these
jobs (``request_analysis``, through the intake's own path): the API refuses a
caller's job of this type, or one naming the analysis budget
(``service/submit.py``). The handler still bounds what it sends (each field cut
to its length again) and asks the model the worker is configured with.

The job's token estimate is an upper bound, never a guess: the prompt counted
by ``sluice.llm.tokens`` (exact for OpenAI's models, UTF-8 bytes plus framing
for every other) plus the longest answer asked for. The handler counts the
prompt it sends the same way, for the model it calls, and asks for no more
answer than the estimate leaves, so the usage the provider reports cannot
exceed what the budget reserved. The answer is the job's
result; the store copies it onto the pattern when the job completes
(``PatternStore.settle``), so a job can only ever write onto the pattern
that asked for it. One job per pattern and day of its last failure (its
idempotency key): asking twice, or from two places, makes one job.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, Any

import orjson

from sluice.engine.backoff import DEFAULT_BACKOFF
from sluice.errors import ConfigurationError, MissingExtra, PermanentError, RedisUnavailable, SluiceError
from sluice.llm.provider import Message, Provider, complete_observed
from sluice.llm.tokens import count_prompt_tokens, estimate_prompt_tokens, reservation
from sluice.store.categories import advice
from sluice.store.fingerprints import MAX_MESSAGE
from sluice.store.job import NewJob, StoredJob
from sluice.store.patterns import ANALYSIS_JOB_TYPE, Pattern, PatternStore

if TYPE_CHECKING:
    from sluice.engine.context import JobContext
    from sluice.engine.queue import Queue
    from sluice.engine.worker import Worker

#: The budget analyses spend from, and its daily limit, unless configured otherwise.
DEFAULT_BUDGET = "failure-analysis"
DEFAULT_BUDGET_TOKENS = 200_000
#: The longest answer asked for (root cause and fix: a few sentences each).
MAX_TOKENS = 400
#: Characters of the sample error sent to the provider.
MAX_SAMPLE_CHARS = 2000
#: Attempts of an analysis job (a provider outage is retried with the default backoff).
MAX_ATTEMPTS = 3
#: Characters of a name (job type, error type, category, time) put into the prompt.
MAX_NAME_CHARS = 200

SYSTEM_PROMPT = (
    "You analyse failures of background jobs in a job queue. You are given one failure pattern: "
    "jobs of one type that failed with the same error (variable parts such as ids and numbers are "
    "masked as <uuid>, <num>, ...). Explain the most likely root cause and the fix, concretely, in "
    "at most three sentences each. Answer with JSON only, no prose around it: "
    '{"root_cause": "...", "fix": "..."}'
)


class AnalysisRefused(SluiceError):
    """An analysis cannot be enqueued as asked (no budget could be made for it, or no AI
    provider is configured): nothing was enqueued."""


# ---- what leaves for the provider -----------------------------------------------------------------------
_SECRETS: tuple[tuple[re.Pattern[str], str], ...] = (
    # credentials in a URL: scheme://user:password@host
    (re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"), r"\1<credentials>@"),
    (re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1\2<secret>"),
    (
        re.compile(
            r"(?i)\b((?:x-)?api[_-]?key|apikey|access[_-]?key(?:[_-]?id)?|secret(?:[_-]?key)?|client[_-]?secret|"
            r"password|passwd|pwd|auth(?:orization)?|token|session[_-]?id|cookie)(\s*[=:]\s*)(['\"]?)[^\s'\",;&]{3,}"
        ),
        r"\1\2\3<secret>",
    ),
    (re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{8,}"), "<secret>"),
    (re.compile(r"\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{8,}"), "<secret>"),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "<secret>"),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"), "<secret>"),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), "<secret>"),
    (re.compile(r"\bxox[abpr]-[A-Za-z0-9-]{10,}"), "<secret>"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"), "<secret>"),
    (
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)", re.S),
        "<secret>",
    ),
    # a long run of letters and digits (both): an opaque token
    (re.compile(r"\b(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[A-Za-z])[A-Za-z0-9_-]{32,}\b"), "<secret>"),
    (re.compile(r"\b[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\b"), "<email>"),
)


def mask_secrets(text: str) -> str:
    """``text`` with what looks like a credential (keys, tokens, passwords, URL credentials,
    private keys) or an email address replaced: a sample error is sent to a third party."""
    for pattern, mask in _SECRETS:
        text = pattern.sub(mask, text)
    return text


def analysis_payload(
    pattern: Pattern, *, model: str | None = None, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """The job's payload: the pattern as the prompt needs it (the sample already masked)."""
    sample = mask_secrets(pattern.sample_error or "")[:MAX_SAMPLE_CHARS]
    payload: dict[str, Any] = {
        "tenant": pattern.tenant,
        "queue": pattern.queue,
        "pattern": pattern.id,
        "job_type": pattern.job_type,
        "error_type": pattern.error_type,
        "message": pattern.message,
        "category": pattern.category,
        "count": pattern.count,
        "first_seen": pattern.first_seen.isoformat(),
        "last_seen": pattern.last_seen.isoformat(),
        "sample": sample,
        "max_tokens": max_tokens,
    }
    if model:
        payload["model"] = model
    return payload


def _cut(payload: dict[str, Any], name: str, limit: int, default: str = "") -> str:
    """A payload field as prompt text, at most ``limit`` characters (cut again here, whoever
    made the payload: the sample is the one field that could be long)."""
    value = payload.get(name)
    return (default if value is None else str(value))[:limit]


def build_messages(payload: dict[str, Any]) -> list[Message]:
    """The chat the provider is sent, from an analysis job's payload (each field at most as long
    as the service makes it: the sample ``MAX_SAMPLE_CHARS``, names ``MAX_NAME_CHARS``)."""
    category = _cut(payload, "category", MAX_NAME_CHARS, "unknown")
    count = payload.get("count")
    user = (
        f"Job type: {_cut(payload, 'job_type', MAX_NAME_CHARS)}\n"
        f"Error type: {_cut(payload, 'error_type', MAX_NAME_CHARS)}\n"
        f"Normalized error message: {_cut(payload, 'message', MAX_MESSAGE)}\n"
        f"Category by rules: {category} (the rules advise: {advice(category)})\n"
        f"Occurrences: {count if isinstance(count, int) and not isinstance(count, bool) else '?'} "
        f"(first {_cut(payload, 'first_seen', MAX_NAME_CHARS)}, "
        f"last {_cut(payload, 'last_seen', MAX_NAME_CHARS)})\n"
        f"Sample error of the latest occurrence (secrets masked, may be truncated):\n"
        f"{_cut(payload, 'sample', MAX_SAMPLE_CHARS) or '(none)'}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def prompt_tokens(messages: Sequence[Message], *, provider: str, model: str) -> int:
    """An upper bound of the prompt's input tokens for ``provider``'s ``model``
    (``sluice.llm.tokens.count_prompt_tokens``: exact for OpenAI's models, UTF-8 bytes plus
    framing otherwise; the byte bound too when tiktoken, the llm extra, is not installed).
    A damaged rank file is a :class:`ConfigurationError`."""
    try:
        return count_prompt_tokens(messages, provider=provider, model=model)
    except MissingExtra:
        return estimate_prompt_tokens(messages)


def _answer_tokens(payload: dict[str, Any], default: int = MAX_TOKENS) -> int:
    asked = payload.get("max_tokens", default)
    return asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else default


def estimate_tokens(payload: dict[str, Any], *, provider: str | None = None, model: str | None = None) -> int:
    """The job's token estimate, what its budget reserves: an upper bound of its prompt's tokens
    for ``provider``'s ``model`` (default: the payload's; without either, the byte bound, which
    holds for every model) plus the longest answer it asks for
    (``sluice.llm.tokens.reservation``)."""
    messages = build_messages(payload)
    use = model or _cut(payload, "model", MAX_NAME_CHARS)
    answer = _answer_tokens(payload)
    try:
        return reservation(messages, provider=provider or "", model=use, max_tokens=answer)
    except MissingExtra:
        return estimate_prompt_tokens(messages) + answer


_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.IGNORECASE)
_OBJECT = re.compile(r"\{.*\}", re.S)


def parse_answer(answer: str) -> dict[str, str]:
    """``{"root_cause", "fix"}`` from the model's answer: its JSON (inside a code fence or
    prose, too), or, when it is not JSON, the whole text as the root cause."""
    text = answer.strip()
    found = _OBJECT.search(_FENCE.sub("", text))
    if found is not None:
        try:
            data = orjson.loads(found.group(0))
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("root_cause"), str):
            fix = data.get("fix")
            return {
                "root_cause": data["root_cause"].strip(),
                "fix": fix.strip() if isinstance(fix, str) else "",
            }
    return {"root_cause": text[:4000] or "(the model gave no answer)", "fix": ""}


# ---- the handler ----------------------------------------------------------------------------------------
ProviderSource = Provider | Callable[[], Provider] | None


async def _provider(source: ProviderSource) -> tuple[Provider, bool]:
    """The provider to call, and whether it was made here (and is closed after the call). By
    default the worker's environment chooses (``SLUICE_LLM_PROVIDER``/``AI_PROVIDER``, its key,
    ``SLUICE_LLM_MODEL``/``AI_MODEL``): ``sluice.llm.providers.provider_from_env``."""
    if isinstance(source, Provider):
        return source, False
    if source is not None:
        return source(), True
    try:
        # Imported here: the providers are a module of their own (and need the llm extra).
        from sluice.llm.providers import provider_from_env
    except ImportError as exc:
        raise PermanentError(
            f"ConfigurationError: the LLM providers cannot be loaded ({exc}); install sluice-queue[llm]"
        ) from exc
    try:
        made: Provider = provider_from_env()
    except (ConfigurationError, ImportError) as exc:
        # No retry can fix the environment: dead at once, with what to change.
        raise PermanentError(f"{type(exc).__name__}: {exc}") from exc
    return made, True


def _checked(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict) or not isinstance(payload.get("pattern"), str):
        raise PermanentError(
            f"{ANALYSIS_JOB_TYPE} jobs need the pattern in their payload; ask for one with "
            "POST /v1/failures/patterns/{id}/analysis or sluice failures analyze"
        )
    return payload


def make_handler(
    provider: ProviderSource = None, *, model: str | None = None, max_tokens: int = MAX_TOKENS
) -> Callable[[JobContext], Awaitable[dict[str, Any]]]:
    """The ``failure-analysis`` handler. ``provider``: a Provider, a function that makes one
    (per job, closed after it), or None for ``sluice.llm.providers.provider_from_env()``.

    The model is the worker's: ``model``, else the provider's ``default_model`` (what the
    worker's ``SLUICE_LLM_MODEL``/``AI_MODEL`` or the provider's default names); the model the
    job's payload names (the service's setting when it asked) only when the worker has none.
    The prompt is counted for that model, and the answer may take what the job's estimate
    leaves after it, and no more: the usage stays within what the budget reserved."""

    async def failure_analysis(job: JobContext) -> dict[str, Any]:
        if job.budget is None:
            raise PermanentError(
                f"{ANALYSIS_JOB_TYPE} jobs run under a budget and this one has none; ask for an analysis "
                "with POST /v1/failures/patterns/{id}/analysis or sluice failures analyze"
            )
        payload = _checked(job.payload)
        messages = build_messages(payload)
        chosen, owned = await _provider(provider)
        try:
            named = payload.get("model")
            use = (
                model or getattr(chosen, "default_model", None) or (named if isinstance(named, str) else None)
            )
            if not isinstance(use, str) or not use:
                raise PermanentError(
                    "ConfigurationError: no LLM model is configured; set SLUICE_LLM_MODEL (or AI_MODEL)"
                )
            try:
                # Off the loop: the first count of a process loads the tokenizer (slow).
                prompt = await asyncio.to_thread(prompt_tokens, messages, provider=chosen.name, model=use)
            except ConfigurationError as exc:
                raise PermanentError(f"ConfigurationError: {exc}") from exc
            # The answer may take what the reservation left after the prompt, and no more.
            room = job.tokens - prompt
            if room < 1:
                raise PermanentError(
                    f"{ANALYSIS_JOB_TYPE}: the job's token estimate ({job.tokens}) leaves no room for an "
                    f"answer after its prompt ({prompt} tokens for {chosen.name}/{use})"
                )
            cap = min(max_tokens, _answer_tokens(payload, max_tokens), room)
            completion = await complete_observed(
                chosen,
                messages,
                model=use,
                max_tokens=cap,
                temperature=0.0,
                idempotency_key=job.idempotency_key,
            )
        finally:
            if owned:
                await chosen.aclose()
        total = completion.usage.total_tokens
        if total > 0:  # else the estimate stays charged: never less than was reserved
            job.record_usage(total)
        return {
            **parse_answer(completion.text),
            "model": completion.model,
            "provider": completion.provider,
            "tokens": total,
            "cost": completion.cost,
        }

    return failure_analysis


def register_analysis(
    worker: Worker, *, provider: ProviderSource = None, model: str | None = None, max_tokens: int = MAX_TOKENS
) -> None:
    """Run ``failure-analysis`` jobs on this worker (see :func:`make_handler`)."""
    worker.register(ANALYSIS_JOB_TYPE, make_handler(provider, model=model, max_tokens=max_tokens))


# ---- asking for one -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AnalysisRequest:
    """What asking for an analysis did: ``done`` (the cached analysis) or ``pending`` (the
    job working on it: made by this call when ``created``)."""

    state: str
    job_id: uuid.UUID | None
    analysis: dict[str, Any] | None
    created: bool = False


async def ensure_budget(queue: Queue, name: str, tokens: int) -> None:
    """The analyses' budget, made with a daily window of ``tokens`` if it does not exist (an
    existing one is left as its owner set it). Refused with :class:`AnalysisRefused` when it
    cannot be made; Redis being down is :class:`RedisUnavailable` (try again)."""
    try:
        await queue.budgets.create(name, tokens, window="day", exist_ok=True)
    except RedisUnavailable:
        raise
    except SluiceError as exc:
        raise AnalysisRefused(
            f"the analysis budget {name!r} cannot be made ({exc}); "
            "an analysis runs under a budget or not at all"
        ) from exc


def idempotency_key(pattern: Pattern) -> str:
    """One analysis job per pattern, day of its last failure, and failed try: asking twice
    makes one job; a pattern that failed again another day, or whose analysis failed, may
    have a new one."""
    day = pattern.last_seen.astimezone(UTC).date().isoformat()
    return f"{ANALYSIS_JOB_TYPE}:{pattern.queue}:{pattern.id}:{day}:{pattern.analysis_tries}"


async def request_analysis(
    patterns: PatternStore,
    queue: Queue,
    pattern: Pattern,
    submit: Callable[[NewJob], Awaitable[tuple[StoredJob, bool]]],
    *,
    budget: str = DEFAULT_BUDGET,
    budget_tokens: int = DEFAULT_BUDGET_TOKENS,
    provider: str | None = None,
    model: str | None = None,
    max_tokens: int = MAX_TOKENS,
    refresh: bool = False,
) -> AnalysisRequest:
    """The pattern's analysis: the cached one (unless ``refresh``), the pending job's, or a
    new job on ``queue`` (stored and enqueued by ``submit``, the service's intake:
    ``Intake.submit_analysis``, the path callers cannot reach) under ``budget``, with a
    token estimate that bounds what it can use with ``provider``'s ``model`` (see
    :func:`estimate_tokens`). Raises :class:`AnalysisRefused` when the budget cannot be
    made: never an unbudgeted call."""
    if pattern.analysis_job is not None:
        return AnalysisRequest("pending", pattern.analysis_job, None)
    if pattern.analysis is not None and not refresh:
        return AnalysisRequest("done", _job_of(pattern.analysis), pattern.analysis)
    await ensure_budget(queue, budget, budget_tokens)
    payload = analysis_payload(pattern, model=model, max_tokens=max_tokens)
    try:
        # Off the loop: the first count of a process may load the tokenizer.
        tokens = await asyncio.to_thread(estimate_tokens, payload, provider=provider, model=model)
    except ConfigurationError as exc:
        raise AnalysisRefused(f"the analysis's tokens cannot be counted: {exc}") from exc
    new = NewJob(
        tenant=pattern.tenant,
        queue=queue.name,
        type=ANALYSIS_JOB_TYPE,
        payload=payload,
        priority=0,
        max_attempts=MAX_ATTEMPTS,
        backoff=[
            DEFAULT_BACKOFF.kind,
            DEFAULT_BACKOFF.delay,
            DEFAULT_BACKOFF.max_delay,
            DEFAULT_BACKOFF.jitter,
        ],
        idempotency_key=idempotency_key(pattern),
        tokens=tokens,
        budget=budget,
    )
    stored, created = await submit(new)
    if stored.type != ANALYSIS_JOB_TYPE:
        # Another job holds the analysis's idempotency key (made before the intake reserved
        # such keys): it must not become the pattern's analysis job.
        raise AnalysisRefused(
            f"the analysis's idempotency key {new.idempotency_key!r} is held by job {stored.id} of type "
            f"{stored.type!r}, not an analysis"
        )
    await patterns.mark_pending(pattern.tenant, pattern.queue, pattern.id, stored.id)
    # An earlier job of the same key may have finished already (asked again the same day).
    now = await patterns.get(pattern.tenant, pattern.id)
    if now is not None and now.analysis is not None and now.analysis_job is None and not created:
        return AnalysisRequest("done", _job_of(now.analysis), now.analysis)
    return AnalysisRequest("pending", stored.id, None, created)


def _job_of(analysis: dict[str, Any]) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(analysis.get("job_id")))
    except ValueError:
        return None
