"""The drain of ``sluice bench ingest``, with the store and without: what keeping PostgreSQL
up to date costs the drain."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from sluice.engine.job import JobSpec
from sluice.engine.queue import Queue
from sluice.service.submit import NEST_BACKOFF
from sluice.store.ids import new_job_id
from sluice.store.sink import engine_key
from sluice_lab.common import drop_queue, new_queue_name
from sluice_lab.ingest_run import _cpu_delta, _Run, _sink_catch_up, body_template, run_generators
from sluice_lab.ingest_server import ApiServer, make_key
from sluice_lab.ingest_spec import DRAIN_WORKER
from sluice_lab.ingest_worker import SERVICE_EVENTS_MAXLEN
from sluice_lab.procs import WorkerGroup
from sluice_lab.stats import rate


async def drain(run: _Run) -> dict[str, Any]:
    """``drain_rounds`` pairs of drains, each with the store then the engine alone.

    The pair's ratio is the figure: both of its drains run within a minute, on
    the machine as it is then. Single pairs vary widely on a shared VM (its
    neighbours' load moves the engine alone's rate; benchmarks/results/HISTORY.md
    has the figures), so the median of several pairs is what a verdict
    rests on; the median pair's drains are reported in full, every pair's
    ratio with them.
    """
    rounds: list[tuple[float | None, dict[str, Any], dict[str, Any]]] = []
    for index in range(run.spec.drain_rounds):
        if run.spec.drain_rounds > 1:
            run.progress(f"drain round {index + 1} of {run.spec.drain_rounds}")
        with_store = await drain_with_store(run)
        alone = await drain_engine_alone(run)
        a, b = with_store.get("store_rate"), alone.get("engine_rate")
        rounds.append((round(a / b, 3) if a and b else None, with_store, alone))
    measured = sorted((r for r in rounds if r[0] is not None), key=lambda r: r[0] or 0.0)
    ratio, with_store, alone = measured[(len(measured) - 1) // 2] if measured else rounds[0]
    return {
        "jobs": run.spec.drain_jobs,
        "workers": run.spec.drain_workers,
        "concurrency": run.spec.drain_concurrency,
        "api_processes": run.spec.drain_processes,
        "worker_target": run.spec.drain_worker,
        "worker_events_maxlen": SERVICE_EVENTS_MAXLEN if run.spec.drain_worker == DRAIN_WORKER else None,
        "with_store": with_store,
        "engine_alone": alone,
        "ratio": ratio,
        "rounds": [
            {
                "ratio": r,
                "store_rate": w.get("store_rate"),
                "engine_rate_with_store": w.get("engine_rate"),
                "engine_alone_rate": e.get("engine_rate"),
            }
            for r, w, e in rounds
        ],
    }


async def drain_with_store(run: _Run) -> dict[str, Any]:
    """Submit the jobs through the API, then drain them; done when the store has them COMPLETED."""
    spec = run.spec
    n = spec.drain_jobs
    queue_name = new_queue_name("drain-store")
    tenant = f"bench-{secrets.token_hex(4)}"
    server = ApiServer(
        run.redis_url, run.database.url, queue_name, spec.drain_processes, run.log_dir / "serve-drain.log"
    )
    queue = Queue(queue_name, redis=run.redis)
    try:
        run.progress(f"drain with the store: submitting {n:,} jobs")
        server.start()
        await server.wait_ready()
        key = await make_key(run.db, tenant)
        body, ok = body_template("/jobs", f"drain-{secrets.token_hex(3)}-")
        cfg = {
            "mode": "burst",
            "host": "127.0.0.1",
            "port": server.port,
            "path": "/jobs",
            "token": key,
            "body": body,
            "n": n,
            "connections": 32 * spec.drain_processes,
        }
        [submitted] = await run_generators([cfg])
        if submitted["statuses"] != {str(ok): n}:
            raise RuntimeError(f"submitting the drain's jobs failed: {submitted}")
        caught_up = await _sink_catch_up(run, queue_name)
        run.progress(f"drain with the store: {spec.drain_workers} workers")
        measured = await _drain(run, queue, n, lambda: _store_completed(run, tenant, queue_name), server)
    finally:
        server.stop()
        await queue.close()
        await drop_queue(run.redis, queue_name)
    return {
        "submit_closed_loop_rate": rate(n, submitted["seconds"]),
        "submit_connections": cfg["connections"],
        "sink_caught_up_after_submit_s": caught_up,
        **measured,
    }


async def drain_engine_alone(run: _Run) -> dict[str, Any]:
    """The same jobs added straight to the engine (no API, no sink), drained by the same workers."""
    n = run.spec.drain_jobs
    queue_name = new_queue_name("drain-engine")
    queue = Queue(queue_name, redis=run.redis)
    try:
        run.progress(f"drain, engine alone: adding {n:,} jobs")
        ids = (new_job_id() for _ in range(n))
        specs = (
            JobSpec(
                "generic",
                {"n": i},
                priority=10,
                max_attempts=10,
                backoff=NEST_BACKOFF,
                idempotency_key=engine_key(job_id),
                job_id=str(job_id),
            )
            for i, job_id in enumerate(ids)
        )
        await queue.add_bulk(specs)
        run.progress(f"drain, engine alone: {run.spec.drain_workers} workers")
        return await _drain(run, queue, n, None)
    finally:
        await queue.close()
        await drop_queue(run.redis, queue_name)


#: Whether a queue still has a job the store holds unfinished: the reconciler's partial index
#: (``ix_job_states_unfinished``), which holds only such jobs, so that the answer costs a few index
#: entries, not a visit to each of the drain's rows.
_ANY_UNFINISHED = text(
    "SELECT EXISTS (SELECT 1 FROM job_states WHERE queue = :q"
    " AND status IN ('QUEUED', 'PROCESSING', 'FAILED', 'PARKED'))"
)
_COMPLETED = text("SELECT count(*) FROM job_states WHERE tenant = :t AND status = 'COMPLETED'")


async def _store_completed(run: _Run, tenant: str, queue_name: str) -> int:
    """How many of the drain's jobs the store shows COMPLETED; 0 while it holds any unfinished.

    Counting them at every poll is what the drain did first: a count that
    visits every row of the drain, many times a second, put a large share of
    PostgreSQL's time on the store's bill. So
    the poll asks whether any job is unfinished, and counts only once none is.
    """
    async with run.db.engine.connect() as conn:
        # The partial index, never a scan of the table (whose statistics may still say that
        # every row is QUEUED, from before the drain).
        await conn.execute(text("SET LOCAL enable_seqscan = off"))
        if await conn.scalar(_ANY_UNFINISHED, {"q": queue_name}):
            return 0
        return int(await conn.scalar(_COMPLETED, {"t": tenant}) or 0)


async def _drain(
    run: _Run,
    queue: Queue,
    n: int,
    store_done: Callable[[], Any] | None,
    server: ApiServer | None = None,
    poll: float = 0.05,
) -> dict[str, Any]:
    """Start the workers and time the drain: from the first completion to the last (in the
    engine, and in the store when ``store_done`` counts it); with the CPU each party spent."""
    spec = run.spec
    group = WorkerGroup(
        run.redis_url,
        queue.name,
        spec.drain_concurrency,
        log_dir=run.log_dir,
        target=spec.drain_worker,
    )
    marks: dict[str, tuple[float, int]] = {}
    launch = time.monotonic()
    group.start(spec.drain_workers)
    before = await run.cpu_mark(server, group)
    try:
        while True:
            now = time.monotonic()
            engine = int(await run.redis.hget(queue.keys.stats, "completed") or 0)
            # The store cannot be done before the engine: asked only then, so that the poll
            # costs PostgreSQL nothing while the drain runs.
            stored = await store_done() if store_done is not None and "engine" in marks else None
            if engine and "first" not in marks:
                marks["first"] = (now, engine)
            if engine >= n and "engine" not in marks:
                marks["engine"] = (now, engine)
            if stored is not None and stored >= n and "store" not in marks:
                marks["store"] = (now, stored)
            if "engine" in marks and (store_done is None or "store" in marks):
                break
            if now - launch > spec.drain_timeout:
                break
            if len(group.exited()) == len(group.ids):
                raise RuntimeError(f"the drain's workers exited: {group.log_tail(group.ids[0])}")
            await asyncio.sleep(poll)
        after = await run.cpu_mark(server, group)
    finally:
        exits = group.stop()
    first = marks.get("first")

    def window_rate(end: str) -> float | None:
        """From the first completion seen to ``end``; from the launch when the first look
        already saw every job done (a drain shorter than a poll: only tiny runs)."""
        if first is None or end not in marks:
            return None
        start = first if marks[end][1] > first[1] else (launch, 0)
        return rate(marks[end][1] - start[1], marks[end][0] - start[0])

    out: dict[str, Any] = {
        "window": "from the first completion seen (polled every "
        f"{poll * 1000:g} ms) to the last; worker start-up excluded",
        "startup_to_first_s": round(first[0] - launch, 3) if first else None,
        "engine_rate": window_rate("engine"),
        "engine_done_s": round(marks["engine"][0] - launch, 3) if "engine" in marks else None,
        "complete": "engine" in marks and (store_done is None or "store" in marks),
        "cpu": {k.replace("_per_request", "_per_job"): v for k, v in _cpu_delta(before, after, n).items()},
        "graceful_exit_s": exits,
    }
    if store_done is not None:
        out["store_rate"] = window_rate("store")
        out["store_done_s"] = round(marks["store"][0] - launch, 3) if "store" in marks else None
        if "store" in marks and "engine" in marks:
            out["store_lag_at_end_s"] = round(marks["store"][0] - marks["engine"][0], 3)
    return out
