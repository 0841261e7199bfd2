"""The producer side: add jobs, look them up, wait for their results, cancel them.

:class:`Queue` is a face over parts that share one core (core.py): it offers
the operator's calls (admin.py: counts, listings, the dead-letter queue), the
shared flow controls (flow.py), retention (retention.py) and the job records
(records.py) as its own methods, and holds the token ledger
(``queue.budgets``, budgets.py) and the worker protocol (``queue.protocol``,
protocol.py), which only workers speak.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sluice.engine import tracehooks
from sluice.engine.admin import QueueAdmin
from sluice.engine.backoff import DEFAULT_BACKOFF, Backoff
from sluice.engine.budgets import Budgets
from sluice.engine.codec import JSONValue, decode, encode_limited
from sluice.engine.commands import Commands
from sluice.engine.connection import adopt, blocking_client, connect
from sluice.engine.core import QueueCore
from sluice.engine.events import Event, ResultWaiter, follow
from sluice.engine.eviction import warn_if_evicting
from sluice.engine.flow import FlowControl
from sluice.engine.job import JobRecord, JobSpec, JobState
from sluice.engine.keys import QueueKeys, check_caller_id, check_job_id
from sluice.engine.parts import part_method
from sluice.engine.protocol import WorkerProtocol
from sluice.engine.records import JobRecords
from sluice.engine.retention import QueueRetention, refuse_keep_finished
from sluice.engine.scripts import Scripts
from sluice.engine.transport import reads_once, reads_stream, writes
from sluice.errors import (
    BudgetNotFound,
    InvalidJobError,
    JobCancelled,
    JobExhausted,
    JobFailed,
    JobNotFound,
    JobRejected,
    ResultTimeout,
    UnknownJobName,
)
from sluice.settings import (
    DEFAULT_EVENTS_MAXLEN,
    DEFAULT_IDEMPOTENCY_TTL,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_STALLS,
    DEFAULT_PREFIX,
    DEFAULT_QUEUE,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

#: Jobs per add script call in add_bulk: large enough to amortize the round
#: trip, small enough that one call does not stall Redis for other clients.
BULK_CHUNK = 64


class Job:
    """A handle on one job: its id and the queue it lives in."""

    __slots__ = ("created", "id", "queue")

    def __init__(self, queue: Queue, job_id: str, created: bool = True) -> None:
        self.queue = queue
        self.id = job_id
        #: False when an idempotency key returned an existing job instead.
        self.created = created

    def __repr__(self) -> str:
        return f"Job(queue={self.queue.name!r}, id={self.id!r})"

    async def info(self) -> JobRecord:
        """The job's stored record; raises JobNotFound once it has expired."""
        record = await self.queue.get_job(self.id)
        if record is None:
            raise JobNotFound(self.id)
        return record

    async def state(self) -> JobState | None:
        return await self.queue.job_state(self.id)

    async def result(self, timeout: float | None = None) -> JSONValue:
        """Wait for the job to finish and return its result, without polling.

        Raises JobFailed if it was dead-lettered, JobCancelled if cancelled,
        JobRejected if its budget refused it (JobExhausted, a JobRejected, if
        it had spent in earlier attempts),
        ResultTimeout after ``timeout`` seconds (the job itself goes on).
        """
        return await self.queue.wait_result(self.id, timeout)

    async def cancel(self) -> bool:
        return await self.queue.cancel(self.id)


class Queue:
    """One named queue on one Redis: the producer API, the operator's calls
    (:class:`~sluice.engine.admin.QueueAdmin`), its flow controls
    (:class:`~sluice.engine.flow.FlowControl`), its retention
    (:class:`~sluice.engine.retention.QueueRetention`) and its token ledger
    (``queue.budgets``).

    ``redis`` is an asyncio client that the queue uses but does not own (close
    it yourself), or use :meth:`from_url`, which owns its client. For a Redis
    Cluster, pass a ``redis.asyncio.RedisCluster`` or a client of
    :func:`~sluice.engine.connection.connect` (given any node's URL).
    ``known_names``: if given, ``add`` refuses job names outside it, before
    anything is written (pass ``worker.names`` to check against a worker).
    """

    def __init__(
        self,
        name: str = DEFAULT_QUEUE,
        *,
        redis: Redis | RedisCluster,
        prefix: str = DEFAULT_PREFIX,
        known_names: Collection[str] | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        keep_finished: None = None,
        idempotency_ttl: float = DEFAULT_IDEMPOTENCY_TTL,
        events_maxlen: int = DEFAULT_EVENTS_MAXLEN,
        event_result_max_bytes: int = 4096,
    ) -> None:
        self.name = name
        self.keys = QueueKeys.for_queue(name, prefix)
        self.prefix = prefix
        self._eviction_checked = False
        self.redis = adopt(redis)
        self.known_names = frozenset(known_names) if known_names is not None else None
        if max_payload_bytes <= 0:
            raise InvalidJobError("max_payload_bytes must be > 0")
        self.max_payload_bytes = max_payload_bytes
        refuse_keep_finished(keep_finished)
        self.idempotency_ttl_ms = max(1, int(idempotency_ttl * 1000))
        self.events_maxlen = events_maxlen
        self.event_result_max_bytes = event_result_max_bytes
        self.scripts = Scripts(self.redis)
        #: what every part shares, built once (see sluice.engine.core)
        self.core = core = QueueCore(
            name,
            prefix,
            self.keys,
            self.redis,
            self.scripts,
            Commands(
                self.keys,
                events_maxlen=events_maxlen,
                event_result_max_bytes=event_result_max_bytes,
                idempotency_ttl_ms=self.idempotency_ttl_ms,
            ),
            self.max_payload_bytes,
            self.idempotency_ttl_ms,
            self.events_maxlen,
            self.event_result_max_bytes,
        )
        #: the token ledger of this queue (see sluice.engine.budgets)
        self.budgets = Budgets(core)
        #: the calls workers make (see sluice.engine.protocol)
        self.protocol = WorkerProtocol(core)
        self._records = JobRecords(core)
        self._admin = QueueAdmin(core, self._records)
        self._flow = FlowControl(core, self.budgets)
        self._retention = QueueRetention(core)
        self._owns_redis = False
        self._blocking: Redis | None = None
        self._waiter: ResultWaiter | None = None

    @classmethod
    def from_url(cls, url: str, name: str = DEFAULT_QUEUE, **options: Any) -> Queue:
        """A queue with a client of its own for ``url`` (closed by :meth:`close`).

        ``url``: redis://[:password@]host:port/db, rediss://... (TLS) or
        unix:///path/to/redis.sock; or any node of a Redis Cluster.
        """
        queue = cls(name, redis=connect(url), **options)
        queue._owns_redis = True
        return queue

    async def close(self) -> None:
        if self._waiter is not None:
            await self._waiter.close()
            self._waiter = None
        if self._blocking is not None:
            await self._blocking.aclose()
            self._blocking = None
        if self._owns_redis:
            await self.redis.aclose()

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- adding ------------------------------------------------------------
    @writes
    async def add(
        self,
        name: str,
        payload: JSONValue = None,
        *,
        priority: int = 0,
        delay: float = 0.0,
        max_attempts: int = 3,
        backoff: Backoff = DEFAULT_BACKOFF,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        max_stalls: int = DEFAULT_MAX_STALLS,
        tokens: int = 0,
        budget: str | None = None,
        on_exhausted: str = "reject",
        correlation_id: str | None = None,
        job_id: str | None = None,
    ) -> Job:
        """Add one job; see :class:`JobSpec` for what each option means.

        With ``idempotency_key``, a second add with the same key (within the
        queue's ``idempotency_ttl``) returns the first job, ``created=False``;
        with ``job_id``, so does a second add of an id the queue still holds.
        """
        spec = JobSpec(
            name,
            payload,
            priority,
            delay,
            max_attempts,
            backoff,
            timeout,
            idempotency_key,
            max_stalls,
            tokens,
            budget,
            on_exhausted,
            correlation_id,
            job_id=job_id,
        )
        return (await self._add_many([spec]))[0]

    @writes
    async def add_bulk(
        self, specs: Iterable[JobSpec], *, progress: Callable[[int], None] | None = None
    ) -> list[Job]:
        """Add many jobs in few round trips; every spec is checked before any is written.

        Raises :class:`~sluice.errors.BudgetNotFound` if a job names a budget
        that does not exist (none of that call's jobs are added), and
        :class:`~sluice.errors.OutcomeUnknown` if the connection broke after
        the jobs were sent: add them again only with idempotency keys.
        ``progress`` is called with the number of jobs added so far after
        each script call (of at most BULK_CHUNK jobs), for a progress bar.
        """
        return await self._add_many(specs, progress)

    async def _add_many(
        self, specs: Iterable[JobSpec], progress: Callable[[int], None] | None = None
    ) -> list[Job]:
        specs = list(specs)
        for i, spec in enumerate(specs):
            if not isinstance(spec, JobSpec):
                raise InvalidJobError(f"add_bulk item {i} is {type(spec).__name__}, not a JobSpec")
        scope = tracehooks.enqueue_scope(self.name, specs)
        if scope is None:
            return await self._add_specs(specs, progress)
        given = scope.trace_context
        if given is not None:
            specs = [s if s.trace_context else dataclasses.replace(s, trace_context=given) for s in specs]
        try:
            jobs = await self._add_specs(specs, progress)
        except BaseException as exc:
            tracehooks.close_enqueue(scope, None, exc)
            raise
        tracehooks.close_enqueue(scope, [job.id for job in jobs], None)
        return jobs

    async def _add_specs(
        self, specs: list[JobSpec], progress: Callable[[int], None] | None = None
    ) -> list[Job]:
        if not self._eviction_checked:
            self._eviction_checked = True
            await warn_if_evicting(self.redis)
        encoded = [self._encode(spec) for spec in specs]
        if len(specs) > BULK_CHUNK:
            await self._check_budgets(specs)
        jobs: list[Job] = []
        for start in range(0, len(specs), BULK_CHUNK):
            jobs.extend(
                await self._add_chunk(specs[start : start + BULK_CHUNK], encoded[start : start + BULK_CHUNK])
            )
            if progress is not None:
                progress(len(jobs))
        return jobs

    def _encode(self, spec: JobSpec) -> tuple[list[str], bytes]:
        """A job's options (the first of ``wireformat.ADDED``, up to its idempotency key's
        index, which its chunk gives) and its payload, checked."""
        if self.known_names is not None and spec.name not in self.known_names:
            known = ", ".join(sorted(self.known_names)) or "none"
            raise UnknownJobName(
                f"no handler named {spec.name!r} on this queue (known: {known}); "
                "check the name or register the handler on the worker"
            )
        payload = encode_limited(spec.payload, self.max_payload_bytes)
        timeout_ms = 0 if spec.timeout is None else max(1, int(spec.timeout * 1000))
        options = [
            spec.name,
            str(spec.priority),
            str(int(spec.delay * 1000)),
            str(spec.max_attempts),
            spec.backoff.to_json().decode(),
            str(timeout_ms),
            str(spec.max_stalls),
            str(spec.tokens),
            spec.budget or "",
            spec.on_exhausted,
            spec.correlation_id or "",
        ]
        return options, payload

    async def _add_chunk(self, specs: Sequence[JobSpec], encoded: list[tuple[list[str], bytes]]) -> list[Job]:
        reply = await self.core.run(self.core.commands.add(specs, encoded))
        if reply and reply[0] == -1:
            raise _no_budget(reply[1].decode())
        return [Job(self, reply[i].decode(), reply[i + 1] == 1) for i in range(0, len(reply), 2)]

    async def _check_budgets(self, specs: Sequence[JobSpec]) -> None:
        """Before a call of several chunks: every budget named exists (each chunk checks
        again, atomically; this makes the whole call all-or-nothing)."""
        names = sorted({s.budget for s in specs if s.budget is not None})
        if not names:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(self.keys.budget_prefix + name)
            found = await pipe.execute()
        for name, exists in zip(names, found, strict=True):
            if not exists:
                raise _no_budget(name)

    # ---- reading -------------------------------------------------------------
    def job(self, job_id: str) -> Job:
        """A handle on an existing job id (not checked until used)."""
        self._check_id(job_id)
        return Job(self, job_id)

    get_job = part_method("_records", JobRecords.get_job)
    get_jobs = part_method("_records", JobRecords.get_jobs)
    job_state = part_method("_records", JobRecords.job_state)

    # ---- results ---------------------------------------------------------------
    @reads_once
    async def wait_result(self, job_id: str, timeout: float | None = None) -> JSONValue:
        self._check_id(job_id)
        waiter = self._result_waiter()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        fut = await waiter.register(job_id)
        try:
            while True:
                # Read the state after registering: an outcome written in between
                # reaches the future; one written before is in the record.
                finished, value = await self._final_outcome(job_id)
                if finished:
                    return value
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    raise ResultTimeout(job_id, timeout or 0.0, str(await self.job_state(job_id)))
                # Re-check the record now and then: the capped stream may have
                # been trimmed past an event before the reader saw it.
                step = 5.0 if remaining is None else min(remaining, 5.0)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(step):  # not wait_for, which can drop a cancel
                        outcome = await asyncio.shield(fut)
                    if outcome.event == b"completed" and b"result" in outcome.fields:
                        return decode(outcome.fields[b"result"])
                    fut = await waiter.register(job_id)
        finally:
            waiter.forget(job_id, fut)

    async def _final_outcome(self, job_id: str) -> tuple[bool, JSONValue]:
        """(True, result) once completed; raises if dead or cancelled; (False, None) before."""
        fields: Any = await self.redis.hmget(self.keys.job(job_id), "state", "result", "error")
        state, result, error = fields
        if state is None:
            raise JobNotFound(job_id)
        if state == b"completed":
            return True, decode(result) if result is not None else None
        if state == b"dead":
            raise JobFailed(job_id, (error or b"").decode())
        if state == b"cancelled":
            raise JobCancelled(job_id)
        if state == b"rejected":
            raise JobRejected(job_id, (error or b"").decode())
        if state == b"exhausted":
            raise JobExhausted(job_id, (error or b"").decode())
        return False, None

    def _result_waiter(self) -> ResultWaiter:
        if self._waiter is None:
            self._blocking = blocking_client(self.redis, self.keys.events)
            self._waiter = ResultWaiter(self._blocking, self.keys.events)
        return self._waiter

    @reads_stream
    async def events(self, since: str = "$") -> AsyncIterator[Event]:
        """Follow the queue's lifecycle events (``since='0'``: from the oldest kept)."""
        blocking = blocking_client(self.redis, self.keys.events)
        try:
            async for event in follow(blocking, self.keys.events, since=since):
                yield event
        finally:
            await blocking.aclose()

    # ---- the operator's calls, the shared gates and retention: the parts' (core.py) ------
    counts = part_method("_admin", QueueAdmin.counts)
    ids = part_method("_admin", QueueAdmin.ids)
    workers = part_method("_admin", QueueAdmin.workers)
    latency = part_method("_admin", QueueAdmin.latency)
    latency_series = part_method("_admin", QueueAdmin.latency_series)
    refusals = part_method("_admin", QueueAdmin.refusals)
    latency_totals = part_method("_admin", QueueAdmin.latency_totals)
    dead_letters = part_method("_admin", QueueAdmin.dead_letters)
    redrive = part_method("_admin", QueueAdmin.redrive)
    purge_dead = part_method("_admin", QueueAdmin.purge_dead)
    set_global_concurrency = part_method("_flow", FlowControl.set_global_concurrency)
    set_rate_limit = part_method("_flow", FlowControl.set_rate_limit)
    set_token_rate_limit = part_method("_flow", FlowControl.set_token_rate_limit)
    set_limits = part_method("_flow", FlowControl.set_limits)
    set_pacing = part_method("_flow", FlowControl.set_pacing)
    follow_provider = part_method("_flow", FlowControl.follow_provider)
    pause = part_method("_flow", FlowControl.pause)
    resume = part_method("_flow", FlowControl.resume)
    throttle = part_method("_flow", FlowControl.throttle)
    flow = part_method("_flow", FlowControl.flow)
    retention = part_method("_retention", QueueRetention.retention)
    set_retention = part_method("_retention", QueueRetention.set_retention)

    # ---- changing jobs -------------------------------------------------------------
    @writes
    async def cancel(self, job_id: str, *, ahead: bool = False) -> bool:
        """Cancel a job: at once if waiting, delayed or parked; a running job's worker is
        asked to stop it (at its next lease renewal). False if already finished.

        ``ahead``: a caller's id that names no job yet is cancelled before it is added (its
        add then adds nothing), for a caller whose add may still be on its way; without it,
        an id that names no job raises :class:`~sluice.errors.JobNotFound`.
        """
        self._check_id(job_id)
        if ahead:
            check_caller_id(job_id)
        code, _state = await self.core.run(self.core.commands.cancel(job_id, ahead=ahead))
        if code == -1:
            raise JobNotFound(job_id)
        return bool(code > 0)

    @staticmethod
    def _check_id(job_id: str) -> None:
        check_job_id(job_id)


def _no_budget(name: str) -> BudgetNotFound:
    return BudgetNotFound(
        name,
        f"a job names budget {name!r}, which does not exist; no job was added. Create the "
        "budget first (queue.budgets.create), or add the job without a budget",
    )
