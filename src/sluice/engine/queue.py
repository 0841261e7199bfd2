"""The producer side: add jobs, look them up, wait for results, manage the DLQ."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from sluice.engine.backoff import DEFAULT_BACKOFF, Backoff
from sluice.engine.budgets import Budgets
from sluice.engine.clock import now_ms
from sluice.engine.codec import JSONValue, decode, encode_limited
from sluice.engine.connection import blocking_client, connect
from sluice.engine.events import Event, ResultWaiter, follow
from sluice.engine.flow import FlowControl
from sluice.engine.job import JobRecord, JobSpec, JobState
from sluice.engine.keys import QueueKeys, is_job_id
from sluice.engine.scripts import Scripts
from sluice.errors import (
    InvalidJobError,
    JobCancelled,
    JobFailed,
    JobNotFound,
    JobRejected,
    JobStateError,
    ResultTimeout,
    UnknownJobName,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: Jobs per add script call in add_bulk: large enough to amortize the round
#: trip, small enough that one call does not stall Redis for other clients.
BULK_CHUNK = 1000

_COUNTERS = (
    "added",
    "completed",
    "failed",
    "retried",
    "stalled",
    "cancelled",
    "released",
    "stale_refused",
    "orphaned",
    "throttled",
    "rejected",
    "unknown_outcome",
)


#: One finished attempt as the worker reports it:
#: (job id, token, kind, value, retry_at ms, tokens used or -1).
Outcome = tuple[str, bytes, bytes, bytes, int, int]


class StepReply(NamedTuple):
    """What one dispatch step answered."""

    codes: list[int]
    next_due: int
    jobs: list[Any]

    @classmethod
    def parse(cls, reply: list[Any]) -> StepReply:
        """Split the dispatch script's flat reply: {n, codes..., next_due, jobs...}."""
        n = reply[0]
        return cls(reply[1 : 1 + n], reply[1 + n], reply[2 + n :])


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
        JobRejected if its budget refused it,
        ResultTimeout after ``timeout`` seconds (the job itself goes on).
        """
        return await self.queue.wait_result(self.id, timeout)

    async def cancel(self) -> bool:
        return await self.queue.cancel(self.id)


class Queue(FlowControl):
    """One named queue on one Redis: the producer API, its flow controls
    (:class:`~sluice.engine.flow.FlowControl`) and its token ledger (``queue.budgets``).

    ``redis`` is an asyncio client that the queue uses but does not own (close
    it yourself), or use :meth:`from_url`, which owns its client.
    ``known_names``: if given, ``add`` refuses job names outside it, before
    anything is written (pass ``worker.names`` to check against a worker).
    """

    def __init__(
        self,
        name: str = "default",
        *,
        redis: Redis,
        prefix: str = "sluice",
        known_names: Collection[str] | None = None,
        max_payload_bytes: int = 1_048_576,
        keep_finished: float = 86_400.0,
        idempotency_ttl: float = 86_400.0,
        events_maxlen: int = 10_000,
        event_result_max_bytes: int = 4096,
    ) -> None:
        self.name = name
        self.keys = QueueKeys.for_queue(name, prefix)
        self.prefix = prefix
        self.redis = redis
        self.known_names = frozenset(known_names) if known_names is not None else None
        if max_payload_bytes <= 0:
            raise InvalidJobError("max_payload_bytes must be > 0")
        self.max_payload_bytes = max_payload_bytes
        self.keep_finished_ms = int(keep_finished * 1000)
        self.idempotency_ttl_ms = max(1, int(idempotency_ttl * 1000))
        self.events_maxlen = events_maxlen
        self.event_result_max_bytes = event_result_max_bytes
        self.scripts = Scripts(redis)
        #: the token ledger of this queue (see sluice.engine.budgets)
        self.budgets = Budgets(self)
        self._owns_redis = False
        self._blocking: Redis | None = None
        self._waiter: ResultWaiter | None = None

    @classmethod
    def from_url(cls, url: str, name: str = "default", **options: Any) -> Queue:
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
        max_stalls: int = 1,
        tokens: int = 0,
        budget: str | None = None,
        on_exhausted: str = "reject",
    ) -> Job:
        """Add one job; see :class:`JobSpec` for what each option means.

        With ``idempotency_key``, a second add with the same key (within the
        queue's ``idempotency_ttl``) returns the first job, ``created=False``.
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
        )
        return (await self.add_bulk([spec]))[0]

    async def add_bulk(self, specs: Iterable[JobSpec]) -> list[Job]:
        """Add many jobs in few round trips; every spec is checked before any is written."""
        specs = list(specs)
        for i, spec in enumerate(specs):
            if not isinstance(spec, JobSpec):
                raise InvalidJobError(f"add_bulk item {i} is {type(spec).__name__}, not a JobSpec")
        encoded = [self._encode(spec) for spec in specs]
        jobs: list[Job] = []
        for start in range(0, len(specs), BULK_CHUNK):
            jobs.extend(
                await self._add_chunk(specs[start : start + BULK_CHUNK], encoded[start : start + BULK_CHUNK])
            )
        return jobs

    def _encode(self, spec: JobSpec) -> list[bytes | str | int]:
        if self.known_names is not None and spec.name not in self.known_names:
            known = ", ".join(sorted(self.known_names)) or "none"
            raise UnknownJobName(
                f"no handler named {spec.name!r} on this queue (known: {known}); "
                "check the name or register the handler on the worker"
            )
        payload = encode_limited(spec.payload, self.max_payload_bytes)
        timeout_ms = 0 if spec.timeout is None else max(1, int(spec.timeout * 1000))
        return [
            spec.name,
            payload,
            spec.priority,
            int(spec.delay * 1000),
            spec.max_attempts,
            spec.backoff.to_json(),
            timeout_ms,
            spec.max_stalls,
            spec.tokens,
            spec.budget or "",
            spec.on_exhausted,
        ]

    async def _add_chunk(self, specs: Sequence[JobSpec], encoded: list[list[Any]]) -> list[Job]:
        k = self.keys
        keys = [k.seq, k.waiting, k.delayed, k.events, k.wake, k.stats, k.job_prefix]
        idem_index: dict[str, int] = {}
        args: list[Any] = [now_ms(), self.events_maxlen, self.idempotency_ttl_ms, len(specs)]
        for spec, enc in zip(specs, encoded, strict=True):
            index = 0
            if spec.idempotency_key is not None:
                index = idem_index.get(spec.idempotency_key, 0)
                if not index:
                    keys.append(k.idem(spec.idempotency_key))
                    index = idem_index[spec.idempotency_key] = len(keys) - 7
            args.extend(enc)
            args.append(index)
        reply = await self.scripts.add(keys=keys, args=args)
        return [Job(self, reply[i].decode(), reply[i + 1] == 1) for i in range(0, len(reply), 2)]

    # ---- reading -------------------------------------------------------------
    def job(self, job_id: str) -> Job:
        """A handle on an existing job id (not checked until used)."""
        self._check_id(job_id)
        return Job(self, job_id)

    async def get_job(self, job_id: str) -> JobRecord | None:
        """The parsed record of one job, or None if it does not exist (any more)."""
        self._check_id(job_id)
        raw: dict[bytes, bytes] = await self.redis.hgetall(self.keys.job(job_id))  # type: ignore[assignment]
        if not raw:
            return None
        return JobRecord.from_hash(job_id, raw, self.keys.idem_prefix)

    async def get_jobs(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        """Many records in one round trip (a pipeline), in the order asked."""
        for job_id in job_ids:
            self._check_id(job_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self.keys.job(job_id))
            raws = await pipe.execute()
        return [
            JobRecord.from_hash(i, raw, self.keys.idem_prefix) if raw else None
            for i, raw in zip(job_ids, raws, strict=True)
        ]

    async def job_state(self, job_id: str) -> JobState | None:
        self._check_id(job_id)
        raw: bytes | None = await self.redis.hget(self.keys.job(job_id), "state")  # type: ignore[assignment]
        return JobState(raw.decode()) if raw else None

    async def counts(self) -> dict[str, int]:
        """Jobs in each live state now, and cumulative counters since the queue began.

        Live: waiting, delayed, parked (waiting for a budget), active, dead.
        Cumulative: added, completed, failed (attempts), retried, stalled,
        cancelled, released, dead_total, stale_refused (late answers from
        workers that had lost their lease), orphaned (queue entries whose
        record had vanished), throttled (attempts the provider refused),
        rejected (jobs their budget refused), unknown_outcome (reservations
        kept charged because the attempt's outcome is unknown).
        """
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in (k.waiting, k.delayed, k.active, k.dead):
                pipe.zcard(key)
            pipe.hgetall(k.stats)
            pipe.zrange(k.parkedby, 0, -1)
            waiting, delayed, active, dead, stats, parked_on = await pipe.execute()
        parked = 0
        if parked_on:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name in parked_on:
                    pipe.zcard(k.parked_prefix + name.decode())
                parked = sum(await pipe.execute())
        out = {"waiting": waiting, "delayed": delayed, "parked": parked, "active": active, "dead": dead}
        for name in _COUNTERS:
            out[name] = int(stats.get(name.encode(), 0))
        out["dead_total"] = int(stats.get(b"dead", 0))
        return out

    async def ids(self, state: JobState, offset: int = 0, limit: int = 100) -> list[str]:
        """Ids of jobs in a live state, in the order they will run (or died).

        Parked jobs are kept per budget; their ids come in waiting order
        across all budgets.
        """
        if state is JobState.PARKED:
            return (await self._parked_ids())[offset : offset + limit]
        key = {
            JobState.WAITING: self.keys.waiting,
            JobState.DELAYED: self.keys.delayed,
            JobState.ACTIVE: self.keys.active,
            JobState.DEAD: self.keys.dead,
        }.get(state)
        if key is None:
            raise InvalidJobError(
                f"finished jobs of state {state} are not indexed; "
                "use waiting, delayed, parked, active or dead"
            )
        raw: list[bytes] = await self.redis.zrange(key, offset, offset + limit - 1)  # type: ignore[assignment]
        return [r.decode() for r in raw]

    async def _parked_ids(self) -> list[str]:
        k = self.keys
        names: list[bytes] = await self.redis.zrange(k.parkedby, 0, -1)  # type: ignore[assignment]
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.zrange(k.parked_prefix + name.decode(), 0, -1, withscores=True)
            sets: list[list[tuple[bytes, float]]] = await pipe.execute()
        return [m.decode() for m, _ in sorted((e for s in sets for e in s), key=lambda e: e[1])]

    # ---- results ---------------------------------------------------------------
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
                    outcome = await asyncio.wait_for(asyncio.shield(fut), step)
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
        return False, None

    def _result_waiter(self) -> ResultWaiter:
        if self._waiter is None:
            self._blocking = blocking_client(self.redis)
            self._waiter = ResultWaiter(self._blocking, self.keys.events)
        return self._waiter

    async def events(self, since: str = "$") -> AsyncIterator[Event]:
        """Follow the queue's lifecycle events (``since='0'``: from the oldest kept)."""
        blocking = blocking_client(self.redis)
        try:
            async for event in follow(blocking, self.keys.events, since=since):
                yield event
        finally:
            await blocking.aclose()

    # ---- changing jobs -------------------------------------------------------------
    async def cancel(self, job_id: str) -> bool:
        """Cancel a job: at once if waiting, delayed or parked; a running job's worker is
        asked to stop it (at its next lease renewal). False if already finished."""
        self._check_id(job_id)
        k = self.keys
        code, _state = await self.scripts.cancel(
            keys=[k.job(job_id), k.waiting, k.delayed, k.events, k.stats, k.parked_prefix],
            args=[now_ms(), job_id, self.events_maxlen, self.keep_finished_ms],
        )
        if code == -1:
            raise JobNotFound(job_id)
        return bool(code > 0)

    async def dead_letters(self, offset: int = 0, limit: int = 100) -> list[JobRecord]:
        """Dead-lettered jobs, oldest first, with their last error."""
        ids = await self.ids(JobState.DEAD, offset, limit)
        return [r for r in await self.get_jobs(ids) if r is not None]

    async def redrive(self, job_ids: Iterable[str] | None = None) -> int:
        """Move dead jobs (all if ``job_ids`` is None) back to waiting, attempts reset."""
        ids = list(job_ids) if job_ids is not None else await self._all_dead()
        moved = 0
        for chunk in _chunks(ids, 500):
            for job_id in chunk:
                self._check_id(job_id)
            k = self.keys
            codes = await self.scripts.redrive(
                keys=[k.dead, k.waiting, k.events, k.wake, *(k.job(i) for i in chunk)],
                args=[self.events_maxlen, *chunk],
            )
            for job_id, code in zip(chunk, codes, strict=True):
                if code == -1 and job_ids is not None:
                    raise JobNotFound(job_id)
                if code == 0 and job_ids is not None:
                    state = await self.job_state(job_id)
                    raise JobStateError(job_id, str(state), "only dead jobs can be redriven")
                moved += code == 1
        return moved

    async def purge_dead(self, job_ids: Iterable[str] | None = None) -> int:
        """Delete dead jobs for good (all if ``job_ids`` is None)."""
        ids = list(job_ids) if job_ids is not None else await self._all_dead()
        removed = 0
        for chunk in _chunks(ids, 500):
            for job_id in chunk:
                self._check_id(job_id)
            removed += await self.scripts.purge(
                keys=[self.keys.dead, *(self.keys.job(i) for i in chunk)], args=chunk
            )
        return removed

    async def _all_dead(self) -> list[str]:
        raw: list[bytes] = await self.redis.zrange(self.keys.dead, 0, -1)  # type: ignore[assignment]
        return [r.decode() for r in raw]

    # ---- the worker protocol (used by Runner, and by tests that drive time) ------------
    async def step(
        self, *, now: int, want: int, lease_ms: int, worker_id: str, outcomes: Sequence[Outcome] = ()
    ) -> StepReply:
        """Record ``outcomes`` (fenced by token), promote due jobs, lease up to ``want``.

        An outcome is ``(job_id, token, kind, value, retry_at_ms, tokens_used)``
        with kind b"c" completed, b"f" failed, b"p" failed permanently, b"r"
        released, b"x" cancelled, b"t" throttled (value: retry after, ms), and
        tokens_used -1 when not reported (see lua/includes/finish.lua). Returns the per-outcome
        codes, the next delayed due time (ms, or -1) and the leased jobs as
        flat 9-value groups (see lua/includes/dispatch.lua).
        """
        keys, args = self.step_command(
            now=now, want=want, lease_ms=lease_ms, worker_id=worker_id, outcomes=outcomes
        )
        return StepReply.parse(await self.scripts.dispatch(keys=keys, args=args))

    def step_command(
        self, *, now: int, want: int, lease_ms: int, worker_id: str, outcomes: Sequence[Outcome] = ()
    ) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV of one dispatch call, for callers that send it themselves.

        The worker's pump does: it owns a connection of its own for this one
        script (see runner.py), and parses the answer with :meth:`StepReply.parse`.
        """
        k = self.keys
        keys = [k.waiting, k.delayed, k.active, k.events, k.stats, k.wake, k.job_prefix, k.dead, *k.flow]
        args: list[Any] = [
            now,
            want,
            lease_ms,
            worker_id,
            self.events_maxlen,
            self.keep_finished_ms,
            self.event_result_max_bytes,
            len(outcomes),
        ]
        job_prefix = k.job_prefix
        for outcome in outcomes:
            if len(outcome) != 6:
                raise ValueError(
                    f"an outcome is (job id, token, kind, value, retry_at, tokens used), got {outcome!r}"
                )
            keys.append(job_prefix + outcome[0])
            args += outcome
        return keys, args

    async def extend(self, *, now: int, lease_ms: int, leases: Sequence[tuple[str, bytes]]) -> list[int]:
        """Renew leases; per job 1 renewed, 2 renewed but cancel requested, 0 lost, -1 gone."""
        if not leases:
            return []
        keys = [self.keys.active, *(self.keys.job(job_id) for job_id, _ in leases)]
        args: list[Any] = [now, lease_ms]
        for job_id, token in leases:
            args += (job_id, token)
        return list(await self.scripts.extend(keys=keys, args=args))

    async def reap(self, *, now: int, limit: int = 1000) -> tuple[int, int]:
        """Return expired leases to waiting (or dead); returns (returned, dead-lettered)."""
        k = self.keys
        back, dead = await self.scripts.reap(
            keys=[k.active, k.waiting, k.dead, k.events, k.stats, k.wake, k.job_prefix, *k.flow],
            args=[now, limit, self.events_maxlen, self.keep_finished_ms],
        )
        return int(back), int(dead)

    @staticmethod
    def _check_id(job_id: str) -> None:
        if not is_job_id(job_id):
            raise InvalidJobError(f"{job_id!r} is not a job id (ids are decimal numbers, e.g. '42')")


def _chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
