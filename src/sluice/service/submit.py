"""Accepting a job: checked, written to the store, then enqueued.

The order is the guarantee. The engine checks the job first (a job it would
refuse is never stored); the store's row is written next, so the job exists
once the API answers 201; the engine gets it last, under the row's id and the
idempotency key ``job:<uuid>``, so enqueueing it again (the reconciler, after
a crash between the two writes or after Redis lost its data) never makes two:
the id while the engine keeps the job's record, the key for its TTL after.

Some jobs are the service's own: the LLM failure analyses
(``llm/analysis.py``) run as ``failure-analysis`` jobs under the analysis
budget, asked for by an admin (``POST /v1/failures/patterns/{id}/analysis``).
A caller's submission (every route's: ``Intake.submit``) may not make one, name
that budget, or take the idempotency keys those jobs use; the service makes
them through ``Intake.submit_analysis``, which no route calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING, Any

from sluice import tracing
from sluice.engine import tracehooks
from sluice.engine.backoff import Backoff
from sluice.engine.codec import encode_limited
from sluice.engine.job import JobSpec
from sluice.errors import BudgetNotFound, InvalidJobError, RedisUnavailable, SluiceError, StoreUnavailable
from sluice.llm.analysis import DEFAULT_BUDGET as ANALYSIS_BUDGET
from sluice.store.ids import new_job_id
from sluice.store.job import NewJob, StoredJob
from sluice.store.patterns import ANALYSIS_JOB_TYPE
from sluice.store.sink import engine_key

if TYPE_CHECKING:
    from sluice.engine.queue import Queue
    from sluice.store.jobs import JobStore
    from sluice.store.ledger import BudgetLedger

log = logging.getLogger("sluice.service")

#: Retries of jobs made through the NestJS routes wait 1000 * 2^attempt ms, as that design does.
NEST_BACKOFF = Backoff("exponential", 2.0, 86_400.0, 0.0)


def spec_of(
    job: StoredJob | NewJob, idempotency_key: str | None = None, job_id: uuid.UUID | None = None
) -> JobSpec:
    """The engine's job for a stored one (its checks run here), under the store's id."""
    kind, delay, max_delay, jitter = job.backoff
    return JobSpec(
        job.type,
        job.payload,
        priority=job.priority,
        delay=job.delay_ms / 1000,
        max_attempts=job.max_attempts,
        backoff=Backoff(kind, delay, max_delay, jitter),
        tokens=job.tokens,
        budget=job.budget,
        correlation_id=job.correlation_id,
        idempotency_key=idempotency_key,
        job_id=None if job_id is None else str(job_id),
    )


#: The job type the LLM layer runs: its payload is checked and its reservation counted here.
LLM_JOB = "llm-inference"


def llm_job(new: NewJob) -> NewJob:
    """An ``llm-inference`` job as accepted: payload checked (422 naming the field), ``tenant``
    set to the caller's, and ``tokens`` raised to what the prompt plus ``max_tokens`` can use,
    so that the provider's reported usage never exceeds the reservation."""
    from sluice.llm.inference import InvalidInference, prepare_payload

    try:
        payload, tokens = prepare_payload(new.payload, new.tenant, new.tokens)
    except InvalidInference as exc:
        raise InvalidJobError(str(exc)) from None
    return dataclasses.replace(new, payload=payload, tokens=tokens)


#: The idempotency keys of the service's analysis jobs start so (``llm/analysis.py``'s
#: ``idempotency_key``): a caller's job holding one would stand in for the next analysis.
ANALYSIS_KEY_PREFIX = f"{ANALYSIS_JOB_TYPE}:"
#: The payload fields an ``llm-inference`` job names a money budget with.
_MONEY_BUDGET_FIELDS = ("budget_usd", "budgetUsd")


def backoff_json(backoff: Backoff) -> list[Any]:
    return [backoff.kind, backoff.delay, backoff.max_delay, backoff.jitter]


def engine_spec(job: StoredJob) -> JobSpec:
    """The engine's job for a stored one, under its id and engine idempotency key."""
    return spec_of(job, engine_key(job.id), job.id)


async def enqueue(queue: Queue, job: StoredJob) -> str:
    """Hand a stored job to the engine; returns the id the engine holds it by (the job's own,
    or an earlier version's number for it, found by its idempotency key)."""
    (added,) = await queue.add_bulk([engine_spec(job)])
    return added.id


class Intake:
    """Accepts jobs: each is checked alone, and the ones that arrive together are written
    together: one INSERT for all of them, then one add to the engine.

    The batches form by themselves: the first submission starts a write at
    once; those arriving while it runs wait for the next, which takes all of
    them (up to ``max_batch``). An idle service answers one job as fast as
    before, and a busy one pays one round trip to PostgreSQL and one to Redis
    per batch rather than per job, so that the API keeps up with submissions
    instead of queueing them. If Redis is down after the rows are written, the
    jobs stay QUEUED in the store and the reconciler enqueues them when Redis
    is back: the answer is still 201, because they are kept.
    """

    def __init__(
        self,
        queue: Queue,
        store: JobStore,
        ledger: BudgetLedger | None = None,
        *,
        max_batch: int = 500,
        analysis_budget: str = ANALYSIS_BUDGET,
        token_rate_limit: int | None = None,
    ) -> None:
        self.queue = queue
        self.store = store
        self.ledger = ledger
        self.max_batch = max_batch
        #: budgets only the service's own jobs spend from: the analysis budget
        #: (``SLUICE_ANALYSIS_BUDGET``), and any budget ``submit_analysis`` was given
        self.service_budgets: set[str] = {analysis_budget}
        #: the provider's tokens per minute (``SLUICE_LLM_TPM``): a job reserving more can never
        #: be dispatched, so it is refused here rather than accepted and rejected later
        self.token_rate_limit = token_rate_limit
        self._pending: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self._conn: Any = None
        self._conn_stack: contextlib.AsyncExitStack | None = None
        #: batches written, and the jobs in them (for tests and metrics)
        self.batches = 0
        self.jobs = 0

    async def submit(self, new: NewJob) -> tuple[StoredJob, bool]:
        """Store then enqueue a caller's job; returns it and whether this call created it.

        A job whose budget does not exist is refused before anything is written;
        one that Redis lost but the store has a copy of is rebuilt first. So is a job
        that is the service's to make (:meth:`refuse_service_jobs`).
        """
        self.refuse_service_jobs(new)
        return await self._submit(new)

    async def submit_analysis(self, new: NewJob) -> tuple[StoredJob, bool]:
        """Store then enqueue one of the service's own ``failure-analysis`` jobs
        (``llm.analysis.request_analysis``, for ``POST /v1/failures/patterns/{id}/analysis``
        and ``sluice failures analyze``); no route calls it. Its budget is the service's
        from then on: callers' jobs naming it are refused."""
        if new.type != ANALYSIS_JOB_TYPE or new.budget is None:
            raise InvalidJobError(
                f"submit_analysis takes {ANALYSIS_JOB_TYPE} jobs under a budget, got a {new.type!r} job "
                f"under {new.budget!r}"
            )
        self.service_budgets.add(new.budget)
        return await self._submit(new)

    def refuse_service_jobs(self, new: NewJob) -> None:
        """Refuse (InvalidJobError: a 422) what only the service may submit: a
        ``failure-analysis`` job, a job spending from the analysis budget (as its budget, or as
        an ``llm-inference`` job's ``payload.budget_usd``), and an idempotency key of the
        analysis jobs' (one held by a caller's job would stand in for the next analysis)."""
        if new.type == ANALYSIS_JOB_TYPE:
            raise InvalidJobError(
                f"{ANALYSIS_JOB_TYPE} jobs are made by POST /v1/failures/patterns/{{id}}/analysis"
            )
        named = [new.budget]
        if new.type == LLM_JOB and isinstance(new.payload, dict):
            named += [new.payload.get(f) for f in _MONEY_BUDGET_FIELDS]
        for budget in named:
            if isinstance(budget, str) and budget in self.service_budgets:
                raise InvalidJobError(
                    f"budget {budget!r} is the failure analyses' (SLUICE_ANALYSIS_BUDGET); only the "
                    "service's analysis jobs spend from it: name a budget of your own"
                )
        key = new.idempotency_key
        if key is not None and key.startswith(ANALYSIS_KEY_PREFIX):
            raise InvalidJobError(
                f"idempotency keys starting with {ANALYSIS_KEY_PREFIX!r} are the service's (its analysis "
                "jobs'): choose another"
            )

    async def _submit(self, new: NewJob) -> tuple[StoredJob, bool]:
        job_id = new_job_id()
        if new.type == LLM_JOB:
            new = llm_job(new)
        if self.token_rate_limit is not None and new.tokens > self.token_rate_limit:
            raise InvalidJobError(
                f"this job reserves {new.tokens:,} tokens (its prompt and max_tokens), more than the "
                f"provider's {self.token_rate_limit:,} tokens per minute: it could never run; send less"
            )
        spec = await self.check(new, engine_key(job_id), job_id)
        # The job's span is opened here, in the request's context: the batch is written by
        # another task, which carries the context of whichever request started it.
        traced = tracing.enqueue_scope(self.queue.name, spec, tenant=new.tenant, job_uuid=str(job_id))
        if traced is not None:
            spec = dataclasses.replace(spec, trace_context=traced.trace_context)
        done: asyncio.Future[tuple[StoredJob, bool]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(new, job_id, spec, done))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_all(), name="sluice-intake")
        if traced is None:
            return await done
        try:
            result = await done
        except BaseException as exc:
            tracehooks.close_enqueue(traced, None, exc)
            raise
        tracehooks.close_enqueue(traced, None, None)
        return result

    async def check(
        self, new: NewJob, idempotency_key: str | None = None, job_id: uuid.UUID | None = None
    ) -> JobSpec:
        """What the engine would refuse, refused before anything is stored; the engine's job."""
        spec = spec_of(new, idempotency_key, job_id)
        encode_limited(new.payload, self.queue.max_payload_bytes)
        if new.budget is not None:
            ledger = self.ledger
            found = (await self.queue.budgets.get_many([new.budget]))[0]
            if found is None and ledger is not None and new.budget in await ledger.restore_missing():
                found = (await self.queue.budgets.get_many([new.budget]))[0]
            if found is None:
                raise BudgetNotFound(new.budget)
            if ledger is not None:
                await ledger.remember(new.budget)
        return spec

    async def _write_all(self) -> None:
        """Batches until none is waiting."""
        try:
            while self._pending:
                try:
                    conn = await self._connection()
                except Exception as exc:  # noqa: BLE001 - no connection: the batch answers it
                    _fail(self._take(), _unavailable(exc))
                    continue
                if not await self._write_batches(conn):
                    await self._release()  # it may be broken: the next batch takes another
        finally:
            self._writer = None

    async def _connection(self) -> Any:
        """The intake's own connection, kept between batches.

        The pool checks a connection each time it lends one (two round trips),
        which at a batch per request or two dominated a submission's time and
        took a large share of its CPU (docs/decisions/0016 has the figures). A
        connection the server closed is noticed (asyncpg sees its socket close)
        and replaced; one that broke unnoticed fails one batch, whose requests
        get an error, and is replaced.
        """
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        await self._release()
        stack = contextlib.AsyncExitStack()
        try:
            self._conn = await stack.enter_async_context(self.store.connection())
        except BaseException:
            await stack.aclose()
            raise
        self._conn_stack = stack
        return self._conn

    async def _release(self) -> None:
        stack, self._conn_stack, self._conn = self._conn_stack, None, None
        if stack is not None:
            with contextlib.suppress(Exception):
                await stack.aclose()

    async def close(self) -> None:
        """Give the intake's connection back (the service is stopping)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        await self._release()

    async def _write_batches(self, conn: Any) -> bool:
        """Each batch stored, then added to the engine, then answered, until none waits; False
        when one could not be stored. (Overlapping a batch's INSERT with the last one's add
        was tried: smaller batches, more CPU per job in the API and in PostgreSQL, and no
        lower latency.)"""
        while self._pending:
            batch = self._take()
            try:
                results = await self.store.create_many(
                    [p.new for p in batch], ids=[p.id for p in batch], conn=conn
                )
            except Exception as exc:  # noqa: BLE001 - each waiting request answers it
                _fail(batch, _unavailable(exc))
                return False
            self.batches += 1
            self.jobs += len(batch)
            await self._enqueue(batch, results)
        return True

    def _take(self) -> list[_Pending]:
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        return batch

    async def _enqueue(self, batch: list[_Pending], results: list[tuple[StoredJob, bool]]) -> None:
        """The jobs this batch created, to the engine; then every request of it is answered."""
        created = [p.spec for p, (_, new) in zip(batch, results, strict=True) if new]
        try:
            if created:
                await self.queue.add_bulk(created)
        except (RedisUnavailable, SluiceError) as exc:
            log.warning(
                "%d job(s) are stored but not enqueued (%s); the reconciler enqueues them when Redis is back",
                len(created),
                exc,
                extra={"job_ids": [str(p.id) for p, (_, new) in zip(batch, results, strict=True) if new]},
            )
        except Exception as exc:  # noqa: BLE001 - stored, so kept: the reconciler enqueues them
            _fail(batch, exc)
            return
        for p, result in zip(batch, results, strict=True):
            if not p.done.done():
                p.done.set_result(result)


@dataclasses.dataclass(slots=True)
class _Pending:
    """A submission waiting for its batch: the job, the id it gets if it is new, the engine's
    job for it, and the request's answer."""

    new: NewJob
    id: uuid.UUID
    spec: JobSpec
    done: asyncio.Future[tuple[StoredJob, bool]]


def _fail(batch: list[_Pending], exc: BaseException) -> None:
    for p in batch:
        if not p.done.done():
            p.done.set_exception(exc)


def _unavailable(exc: Exception) -> Exception:
    """A failed store write as the error a request answers: a 503 for the database's
    trouble (its message kept for the log, never a password: asyncpg's errors name none)."""
    if isinstance(exc, SluiceError):
        return exc
    found = StoreUnavailable(f"{type(exc).__name__}: {exc}")
    found.__cause__ = exc
    return found
