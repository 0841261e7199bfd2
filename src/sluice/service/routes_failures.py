"""Failure analysis over HTTP: the patterns of the jobs that ended badly, and their analyses.

``/v1/failures/patterns`` lists a tenant's patterns (``store/patterns.py``:
fingerprinted, counted, classified by rules, each with what to do about it)
and their cached LLM analyses; ``POST .../{id}/analysis`` (admin) asks for
one, which runs as a job under its own budget (``llm/analysis.py``). The
ArQueue routes ``GET /dead_letter/{id}/analysis`` and ``GET /ai/patterns``
answer the same in that design's snake_case shape, with times in Unix ms as
its other routes have them. Every route sees the caller's tenant only: an id
of another tenant's is a 404, as for jobs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response
from pydantic import BaseModel

from sluice.llm.analysis import AnalysisRefused, request_analysis
from sluice.service.context import AdminDep, AdmittedDep, CallerDep, Services, ServicesDep
from sluice.service.errors import ApiError, responses
from sluice.service.routes_v1 import job_out, parse_id
from sluice.service.schemas import JobOut
from sluice.store.categories import Category, advice, classify
from sluice.store.collector import COUNTED
from sluice.store.fingerprints import fingerprint
from sluice.store.jobs import MAX_PAGE
from sluice.store.patterns import AnalysisState, Pattern, PatternStore

router = APIRouter(prefix="/v1/failures", tags=["failures"], responses=responses(401, 413, 429, 503))
arqueue_router = APIRouter(tags=["compatibility: ArQueue"], responses=responses(401, 429, 503))

#: A pattern id as the store makes them (16 hex digits).
PATTERN_ID = r"^[0-9a-f]{16}$"
PatternId = Annotated[str, Path(pattern=PATTERN_ID, description="A pattern's id (16 hex digits)")]

NOT_CONFIGURED = (
    "no AI provider is configured: set SLUICE_LLM_PROVIDER (or AI_PROVIDER) and SLUICE_LLM_MODEL (or "
    "AI_MODEL) for the service and its workers; the rule-based analysis (category, advice) needs none"
)


class AnalysisOut(BaseModel):
    """An LLM's explanation of a pattern (cached on the pattern)."""

    root_cause: str
    fix: str
    model: str | None = None
    provider: str | None = None
    #: tokens the provider reported for it
    tokens: int | None = None
    #: US dollars (None: the model has no price)
    cost: float | None = None
    #: the analysis job
    job_id: str | None = None
    analyzed_at: datetime | None = None


class PatternOut(BaseModel):
    id: str
    queue: str
    job_type: str
    error_type: str
    #: the first line of the error with ids, numbers, paths, ... masked
    message: str
    category: Category
    #: what to do about this category of failure (rules, no LLM)
    advice: str
    #: deaths counted (a redriven job that died again counts again)
    count: int
    first_seen: datetime
    last_seen: datetime
    sample_job_id: str | None
    sample_error: str | None
    analysis_state: AnalysisState
    analysis: AnalysisOut | None
    #: the analysis job while it is pending
    analysis_job_id: str | None
    #: why the last analysis job failed
    analysis_error: str | None


class PatternsOut(BaseModel):
    patterns: list[PatternOut]
    #: pass it as ``offset`` for the next page; None: this was the last
    next_offset: int | None


class PatternJobsOut(BaseModel):
    pattern_id: str
    #: latest death first
    jobs: list[JobOut]
    next_cursor: str | None


class AnalysisRequestOut(BaseModel):
    pattern_id: str
    #: done: the cached analysis (200); pending: the job working on it (202)
    state: Literal["pending", "done"]
    job_id: str | None
    analysis: AnalysisOut | None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def analysis_out(p: Pattern) -> AnalysisOut | None:
    a = p.analysis
    if a is None:
        return None
    cost = a.get("cost")
    return AnalysisOut(
        root_cause=str(a.get("root_cause", "")),
        fix=str(a.get("fix") or ""),
        model=str(a["model"]) if a.get("model") is not None else None,
        provider=str(a["provider"]) if a.get("provider") is not None else None,
        tokens=_int(a.get("tokens")),
        cost=float(cost) if isinstance(cost, int | float) and not isinstance(cost, bool) else None,
        job_id=str(a["job_id"]) if a.get("job_id") is not None else None,
        analyzed_at=p.analysis_at,
    )


def _category(value: str) -> Category:
    """A stored category (an older version's unknown one reads as unknown)."""
    try:
        return Category(value)
    except ValueError:
        return Category.UNKNOWN


def pattern_out(p: Pattern) -> PatternOut:
    return PatternOut(
        id=p.id,
        queue=p.queue,
        job_type=p.job_type,
        error_type=p.error_type,
        message=p.message,
        category=_category(p.category),
        advice=p.advice,
        count=p.count,
        first_seen=p.first_seen,
        last_seen=p.last_seen,
        sample_job_id=str(p.sample_job) if p.sample_job else None,
        sample_error=p.sample_error,
        analysis_state=p.analysis_state,
        analysis=analysis_out(p),
        analysis_job_id=str(p.analysis_job) if p.analysis_job else None,
        analysis_error=p.analysis_error,
    )


async def _pattern(svc: Services, tenant: str, pattern_id: str) -> Pattern:
    found = await PatternStore(svc.db).get(tenant, pattern_id)
    if found is None:
        raise ApiError(404, f"no failure pattern {pattern_id!r}", field="id")
    return found


@router.get("/patterns", response_model=PatternsOut, responses=responses(422))
async def list_patterns(
    svc: ServicesDep,
    who: CallerDep,
    queue: Annotated[str | None, Query(max_length=100)] = None,
    category: Category | None = None,
    sort: Annotated[
        Literal["count", "last_seen"], Query(description="Most frequent or most recent first")
    ] = "count",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    offset: Annotated[int, Query(ge=0, le=100_000)] = 0,
) -> PatternsOut:
    """Your failure patterns: the jobs that ended badly (dead-lettered, rejected, exhausted)
    grouped by job type, error type and normalized message, with counts, first and last seen,
    the category the rules gave each, what to do about it, and the LLM analysis if any."""
    found = await PatternStore(svc.db).list_patterns(
        who.tenant,
        queue=queue,
        category=category.value if category is not None else None,
        sort=sort,
        limit=limit + 1,
        offset=offset,
    )
    more = len(found) > limit
    return PatternsOut(
        patterns=[pattern_out(p) for p in found[:limit]], next_offset=offset + limit if more else None
    )


@router.get("/patterns/{pattern_id}", response_model=PatternOut, responses=responses(404, 422))
async def get_pattern(pattern_id: PatternId, svc: ServicesDep, who: CallerDep) -> PatternOut:
    """One failure pattern, with its analysis (settled as soon as its job has finished)."""
    return pattern_out(await _pattern(svc, who.tenant, pattern_id))


@router.get("/patterns/{pattern_id}/jobs", response_model=PatternJobsOut, responses=responses(404, 422))
async def pattern_jobs(
    pattern_id: PatternId,
    svc: ServicesDep,
    who: CallerDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
) -> PatternJobsOut:
    """The jobs of a pattern, latest death first (each as ``GET /v1/jobs/{id}`` has it, without
    its attempts)."""
    pattern = await _pattern(svc, who.tenant, pattern_id)
    page = await PatternStore(svc.db).jobs(who.tenant, pattern.queue, pattern_id, limit=limit, cursor=cursor)
    return PatternJobsOut(
        pattern_id=pattern_id, jobs=[job_out(j) for j, _ in page.jobs], next_cursor=page.next_cursor
    )


@router.post(
    "/patterns/{pattern_id}/analysis",
    status_code=202,
    response_model=AnalysisRequestOut,
    responses={
        200: {"model": AnalysisRequestOut, "description": "The cached analysis"},
        **responses(403, 404, 409, 422),
    },
)
async def analyze_pattern(
    pattern_id: PatternId,
    response: Response,
    svc: ServicesDep,
    who: AdminDep,
    _admitted: AdmittedDep,
    refresh: Annotated[
        bool, Query(description="Ask again even if an analysis is cached (once per day of the last failure)")
    ] = False,
) -> AnalysisRequestOut:
    """Ask an LLM to explain a pattern (admin): 202 with the job that does it (a job on the
    queue, under the analysis budget, ``SLUICE_ANALYSIS_BUDGET``), or 200 with the cached
    analysis. 409 when no AI provider is configured, or the budget cannot be made."""
    pattern = await _pattern(svc, who.tenant, pattern_id)
    if not svc.settings.llm_provider:
        raise ApiError(409, NOT_CONFIGURED, code="ai_not_configured")
    patterns = PatternStore(svc.db)
    try:
        asked = await request_analysis(
            patterns,
            svc.queue,
            pattern,
            svc.intake.submit_analysis,
            budget=svc.settings.analysis_budget,
            budget_tokens=svc.settings.analysis_budget_tokens,
            provider=svc.settings.llm_provider,
            model=svc.settings.llm_model,
            refresh=refresh,
        )
    except AnalysisRefused as exc:
        raise ApiError(409, str(exc), code="analysis_refused") from None
    if asked.state == "done":
        response.status_code = 200
        settled = await patterns.get(who.tenant, pattern_id)
        return AnalysisRequestOut(
            pattern_id=pattern_id,
            state="done",
            job_id=str(asked.job_id) if asked.job_id else None,
            analysis=analysis_out(settled) if settled is not None else None,
        )
    return AnalysisRequestOut(
        pattern_id=pattern_id,
        state="pending",
        job_id=str(asked.job_id) if asked.job_id else None,
        analysis=None,
    )


# ---- ArQueue ----------------------------------------------------------------------------------------------
class ArqAiAnalysis(BaseModel):
    root_cause: str
    fix: str
    model: str | None
    #: Unix ms
    analyzed_at: int | None


class ArqDeadAnalysis(BaseModel):
    task_id: str
    pattern_id: str
    job_type: str
    error_type: str
    category: Category
    advice: str
    normalized_message: str
    #: tasks of this pattern so far (0: this one is not counted yet)
    count: int
    #: Unix ms (None: not counted yet)
    first_seen: int | None
    last_seen: int | None
    ai_status: AnalysisState
    ai_analysis: ArqAiAnalysis | None
    ai_job_id: str | None
    ai_error: str | None


class ArqPattern(BaseModel):
    pattern_id: str
    queue: str
    job_type: str
    error_type: str
    category: Category
    advice: str
    normalized_message: str
    count: int
    #: Unix ms
    first_seen: int
    last_seen: int
    sample_task_id: str | None
    ai_status: AnalysisState
    ai_analysis: ArqAiAnalysis | None


def _ms(at: datetime | None) -> int | None:
    return int(at.timestamp() * 1000) if at is not None else None


def _arq_ai(p: Pattern) -> ArqAiAnalysis | None:
    a = analysis_out(p)
    if a is None:
        return None
    return ArqAiAnalysis(root_cause=a.root_cause, fix=a.fix, model=a.model, analyzed_at=_ms(a.analyzed_at))


@arqueue_router.get(
    "/dead_letter/{task_id}/analysis", response_model=ArqDeadAnalysis, responses=responses(404, 409)
)
async def arq_dead_analysis(task_id: str, svc: ServicesDep, who: CallerDep) -> ArqDeadAnalysis:
    """The analysis of a dead-lettered task: its pattern's category, what to do about it, how
    often it happened, and the pattern's LLM analysis or its state."""
    try:
        job_id = parse_id(task_id)
    except ApiError:
        raise ApiError(404, f"no task {task_id!r} (task ids are UUIDs)", field="id") from None
    job = await svc.store.get(job_id, tenant=who.tenant)
    if job is None:
        raise ApiError(404, f"no task {task_id!r}", field="id")
    if job.status not in COUNTED:
        raise ApiError(409, f"task {task_id} is {job.status}; only dead-lettered tasks have an analysis")
    patterns = PatternStore(svc.db)
    fp = fingerprint(job.error or "", job.type, queue=job.queue, status=job.status)
    pattern = await patterns.get(who.tenant, await patterns.pattern_of(job.id) or fp.id)
    if pattern is None:  # not counted yet (the collector runs every half minute): the rules alone
        category = classify(fp.error_type, fp.head, status=job.status)
        return ArqDeadAnalysis(
            task_id=str(job.id),
            pattern_id=fp.id,
            job_type=fp.job_type,
            error_type=fp.error_type,
            category=category,
            advice=advice(category),
            normalized_message=fp.message,
            count=0,
            first_seen=None,
            last_seen=None,
            ai_status="none",
            ai_analysis=None,
            ai_job_id=None,
            ai_error=None,
        )
    out = pattern_out(pattern)
    return ArqDeadAnalysis(
        task_id=str(job.id),
        pattern_id=pattern.id,
        job_type=pattern.job_type,
        error_type=pattern.error_type,
        category=out.category,
        advice=out.advice,
        normalized_message=pattern.message,
        count=pattern.count,
        first_seen=_ms(pattern.first_seen),
        last_seen=_ms(pattern.last_seen),
        ai_status=out.analysis_state,
        ai_analysis=_arq_ai(pattern),
        ai_job_id=out.analysis_job_id,
        ai_error=pattern.analysis_error,
    )


@arqueue_router.get("/ai/patterns", response_model=list[ArqPattern], responses=responses(422))
async def arq_patterns(
    svc: ServicesDep,
    who: CallerDep,
    limit: Annotated[int, Query(ge=1)] = 50,
    category: Category | None = None,
) -> list[ArqPattern]:
    """Failure patterns of your dead-lettered tasks, most frequent first (at most 100)."""
    found = await PatternStore(svc.db).list_patterns(
        who.tenant, category=category.value if category is not None else None, limit=min(limit, 100)
    )
    out = []
    for p in found:
        view = pattern_out(p)
        out.append(
            ArqPattern(
                pattern_id=p.id,
                queue=p.queue,
                job_type=p.job_type,
                error_type=p.error_type,
                category=view.category,
                advice=view.advice,
                normalized_message=p.message,
                count=p.count,
                first_seen=_ms(p.first_seen) or 0,
                last_seen=_ms(p.last_seen) or 0,
                sample_task_id=view.sample_job_id,
                ai_status=view.analysis_state,
                ai_analysis=_arq_ai(p),
            )
        )
    return out
