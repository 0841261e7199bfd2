"""Ingest: what the HTTP service (``sluice serve``) accepts, and what the store costs the drain.

Three measurements, each against real processes: Redis, PostgreSQL, ``sluice
serve`` with N API processes (uvicorn workers), load generators and worker
processes, each an OS process of its own, so that none flatters another by
sharing its event loop or hiding its CPU.

**Sustained submissions** (:func:`ingest_rate`). A load generator
(:mod:`sluice_lab.ingest_load`) sends ``POST /jobs`` at a constant arrival
rate for ``seconds`` (an open model: a request is due at its time whatever
happened to the earlier ones, and its latency counts from then), each with
an idempotency key of its own, as a careful client sends them. No worker
runs: the submissions alone are measured (the API's transition sink does
run, as it does in production: it applies each job's ``added`` event to the
store). Reported per rate: the 201s per second achieved, every other answer
as an error, and the latency percentiles; with the CPU each party spent per
request (generator, API, Redis, PostgreSQL) and the machine's total, to say
what limits the figure on a 2-core machine that other work shares.

**The idempotency race** (:func:`race`). ``n`` connections are opened, then
one identical ``POST /jobs`` (one idempotency key) is written on each at
once; the kernel spreads the connections over the API processes. Every
answer must be a 201 naming the same job, the store must hold one row for
the key and the engine must have been given one job.

**Drain with the store** (:mod:`sluice_lab.ingest_drain`: ``drain_with_store``
and ``drain_engine_alone``). ``jobs`` generic jobs submitted through the API
(the store holds them, the sink has seen them added) are drained by worker
processes while the API's sink carries every transition to the store; the
drain is over when the store shows every job COMPLETED. Then the same jobs,
added straight to the engine (same spec, same idempotency keys' shape) with
no API and no sink, are drained by the same workers. The ratio of the two
rates is what keeping PostgreSQL up to date costs the drain.

The spec and the targets are :mod:`sluice_lab.ingest_spec`; the API servers
:mod:`sluice_lab.ingest_server`, the PostgreSQL :mod:`sluice_lab.bench_database`;
what the measurements share (the run, its CPU marks, the generators'
processes) :mod:`sluice_lab.ingest_run`.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sqlalchemy import text

from sluice.engine.queue import Queue
from sluice.store.database import Database
from sluice.store.sink import engine_key
from sluice_lab.bench_database import BenchDatabase
from sluice_lab.common import drop_queue, new_queue_name
from sluice_lab.ingest_drain import drain
from sluice_lab.ingest_run import Progress, _cpu_delta, _Run, _sink_catch_up, body_template, run_generators
from sluice_lab.ingest_server import ApiServer, make_key
from sluice_lab.ingest_spec import (
    SATURATED_ERRORS,
    SATURATED_SHARE,
    TARGET_DRAIN_RATIO,
    TARGET_P95_MS,
    TARGET_RATE,
    WARMUP_RATE,
    IngestSpec,
)
from sluice_lab.stats import percentile, rate, summarize_ms


def _merge_counts(parts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _us_to_ms(sorted_us: list[int]) -> dict[str, float | int | None]:
    """summarize_ms of microsecond samples, in milliseconds."""
    return {
        k: v if k == "samples" or v is None else round(v / 1000, 3)
        for k, v in summarize_ms(sorted_us).items()
    }


# ---- the run ---------------------------------------------------------------------------------------------


async def run_ingest(
    redis: Any,
    redis_url: str,
    database: BenchDatabase,
    spec: IngestSpec,
    log_dir: Path,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every measurement of the spec; the JSON-ready result (``meta`` is the caller's)."""
    db = Database(database.url, pool_size=2)
    run = _Run(spec, redis_url, database, redis, db, log_dir, progress or (lambda _: None))
    out: dict[str, Any] = {"spec": asdict(spec), "database": asdict(database)}
    try:
        await db.migrate()
        out["postgres_settings"] = await _pg_settings(db)
        out["ingest"], out["race"] = [], []
        for processes in spec.api_processes:
            rows, races = await _with_server(run, processes)
            out["ingest"] += rows
            out["race"] += races
        out["drain"] = await drain(run) if spec.drain_jobs > 0 else None
    finally:
        await db.close()
    out["targets"] = judge(out)
    return out


async def _pg_settings(db: Database) -> dict[str, str]:
    names = ("server_version", "fsync", "synchronous_commit", "max_connections", "shared_buffers")
    async with db.engine.connect() as conn:
        rows = (
            await conn.execute(
                text("SELECT name, setting FROM pg_settings WHERE name = ANY(:n)"), {"n": list(names)}
            )
        ).all()
    return {str(n): str(v) for n, v in rows}


async def _with_server(run: _Run, processes: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One ``sluice serve -p processes``: the ladder of rates, then the races."""
    spec = run.spec
    queue = new_queue_name("ingest")
    tenant = f"bench-{secrets.token_hex(4)}"
    server = ApiServer(
        run.redis_url, run.database.url, queue, processes, run.log_dir / f"serve-p{processes}.log"
    )
    rows: list[dict[str, Any]] = []
    races: list[dict[str, Any]] = []
    try:
        run.progress(f"starting sluice serve -p {processes}")
        server.start()
        await server.wait_ready()
        key = await make_key(run.db, tenant)
        if spec.warmup_seconds > 0:
            run.progress(f"-p {processes}: warming up")
            await ingest_rate(run, server, key, tenant, WARMUP_RATE, spec.warmup_seconds, "warmup")
        saturated: float | None = None
        for offered in sorted(spec.rates):
            # Past a saturated rate only the target's is run: its row says by how much it is missed.
            if saturated is not None and spec.stop_when_saturated and offered != TARGET_RATE:
                rows.append(
                    {"api_processes": processes, "rate": offered, "skipped": f"{saturated:g}/s saturated"}
                )
                continue
            run.progress(f"-p {processes}: {offered:g} submissions/s for {spec.seconds:g} s")
            row = await ingest_rate(run, server, key, tenant, offered, spec.seconds, f"r{offered:g}")
            rows.append(row)
            if row["saturated"]:
                saturated = offered
        for n in spec.races:
            run.progress(f"-p {processes}: {n:,} concurrent duplicates")
            races.append(await race(run, server, key, tenant, queue, n))
    finally:
        server.stop()
        await drop_queue(run.redis, queue)
    return rows, races


async def ingest_rate(
    run: _Run, server: ApiServer, key: str, tenant: str, offered: float, seconds: float, label: str
) -> dict[str, Any]:
    """``offered`` submissions/s for ``seconds`` from the generators; one row of the table."""
    spec = run.spec
    body, ok = body_template(spec.route, f"{label}-{secrets.token_hex(3)}-")
    start_at = time.time() + 1.0  # the generators' interpreters start meanwhile
    configs = [
        {
            "mode": "rate",
            "client": spec.client,
            "host": "127.0.0.1",
            "port": server.port,
            "path": spec.route,
            "token": key,
            "body": body,
            "ok_status": ok,
            "rate": offered,
            "seconds": seconds,
            "generator": g,
            "generators": spec.generators,
            "start_at": start_at,
            "max_connections": spec.max_connections,
            "timeout": spec.timeout,
        }
        for g in range(spec.generators)
    ]
    before = await run.cpu_mark(server)
    results = await run_generators(configs)
    after = await run.cpu_mark(server)
    sent = sum(r["sent"] for r in results)
    statuses = _merge_counts([r["statuses"] for r in results])
    exceptions = _merge_counts([r["exceptions"] for r in results])
    good = statuses.get(str(ok), 0)
    latency = sorted(v for r in results for v in r["latency_us"])
    lag = sorted(v for r in results for v in r["send_lag_us"])
    last_ok = max((r["last_ok_s"] or 0.0) for r in results)
    achieved = rate(good, max(seconds, last_ok))
    per_second = [sum(col) for col in zip(*(r["per_second_ok"] for r in results), strict=True)]
    steady = per_second[1 : int(seconds)] or per_second
    worst = [max(col) for col in zip(*(r["per_second_worst_us"] for r in results), strict=True)]
    catch_up = await _sink_catch_up(run, server.queue)
    gen_cpu = sum(r["cpu_s"] for r in results)
    errors = sent - good
    row: dict[str, Any] = {
        "api_processes": server.processes,
        "rate": offered,
        "seconds": seconds,
        "route": spec.route,
        "client": spec.client,
        "generators": spec.generators,
        "sent": sent,
        "ok": good,
        "errors": errors,
        "statuses": statuses,
        "exceptions": exceptions,
        "achieved_rate": achieved,
        "latency_ms": _us_to_ms(latency),
        "send_lag_ms": {
            "p50": _ms(percentile(lag, 50)),
            "p99": _ms(percentile(lag, 99)),
            "max": _ms(lag[-1] if lag else None),
        },
        "per_second_ok": {"min": min(steady, default=0), "max": max(steady, default=0)},
        "per_second_worst_ms": [round(us / 1000, 1) for us in worst],
        "connections_opened": sum(r["connections_opened"] for r in results),
        "generator_cpu_us_per_request": round(gen_cpu / max(sent, 1) * 1e6, 1),
        **_cpu_delta(before, after, sent),
        "sink_catch_up_s": catch_up,
    }
    row["saturated"] = bool(
        achieved is None or achieved < SATURATED_SHARE * offered or errors > SATURATED_ERRORS * max(sent, 1)
    )
    row["met"] = bool(
        errors == 0
        and achieved is not None
        and achieved >= min(offered, TARGET_RATE) * 0.99
        and (row["latency_ms"]["p95_ms"] or 0) <= TARGET_P95_MS
    )
    return row


def _ms(us: float | None) -> float | None:
    return None if us is None else round(us / 1000, 3)


# ---- the idempotency race ---------------------------------------------------------------------------------
async def race(
    run: _Run, server: ApiServer, key: str, tenant: str, queue_name: str, n: int
) -> dict[str, Any]:
    """``n`` identical submissions of one idempotency key at once: one job, only 201s."""
    spec = run.spec
    prefix = f"race-{n}-{secrets.token_hex(4)}-"
    body, ok = body_template(spec.route, prefix)
    idem = prefix + "0"  # every request is request 0: one key, one payload
    queue = Queue(queue_name, redis=run.redis)
    added0 = (await queue.counts())["added"]
    before = await run.cpu_mark(server)
    cfg = {
        "mode": "race",
        "host": "127.0.0.1",
        "port": server.port,
        "path": spec.route,
        "token": key,
        "body": body.replace("{i}", "0"),
        "n": n,
        "timeout": 120.0,
    }
    [result] = await run_generators([cfg])
    after = await run.cpu_mark(server)
    await _sink_catch_up(run, queue_name, timeout=30.0)
    async with run.db.engine.connect() as conn:
        rows = int(
            await conn.scalar(
                text("SELECT count(*) FROM jobs WHERE tenant = :t AND idempotency_key = :k"),
                {"t": tenant, "k": idem},
            )
            or 0
        )
    engine_jobs = (await queue.counts())["added"] - added0
    ids = result["ids"]
    in_engine = 0
    if len(ids) == 1:
        only = uuid.UUID(next(iter(ids)))
        in_engine = int(await run.redis.exists(queue.keys.idem(engine_key(only))))
    statuses = result["statuses"]
    cpu = _cpu_delta(before, after, n)
    out = {
        "api_processes": server.processes,
        "duplicates": n,
        "route": spec.route,
        "statuses": statuses,
        "exceptions": result["exceptions"],
        "distinct_ids": len(ids),
        "store_rows": rows,
        "engine_jobs": engine_jobs,
        "engine_has_the_job": bool(in_engine),
        "answer_all_s": result["answer_all_s"],
        "open_connections_s": result["open_s"],
        "api_cpu_s_per_process": cpu["api_cpu_s_per_process"],
    }
    out["passed"] = bool(
        statuses == {str(ok): n} and len(ids) == 1 and rows == 1 and engine_jobs == 1 and in_engine
    )
    return out


# ---- the verdict ----------------------------------------------------------------------------------------
def judge(result: dict[str, Any]) -> dict[str, Any]:
    """Each target of the issue, met or not, with the figure it was judged on."""
    rows = [r for r in result["ingest"] if "skipped" not in r]
    at_target = [r for r in rows if r["rate"] >= TARGET_RATE]
    met_rows = [r for r in at_target if r["met"]]
    # The best figure is the highest rate sustained (0 errors, not saturated); else the highest reached.
    clean = [r for r in rows if r["errors"] == 0 and not r["saturated"]]
    best = max(clean or rows, key=lambda r: (r["met"], r["achieved_rate"] or 0), default=None)
    ingest = {
        "target": f">= {TARGET_RATE:,.0f} submissions/s sustained, 0 errors, p95 <= {TARGET_P95_MS:g} ms",
        "met": bool(met_rows),
        "best": None
        if best is None
        else {k: best[k] for k in ("api_processes", "rate", "achieved_rate", "errors")}
        | {"p95_ms": best["latency_ms"]["p95_ms"], "p99_ms": best["latency_ms"]["p99_ms"]},
    }
    races = result["race"]
    race_target = {
        "target": "one job per key (one row, one engine job, one id) and only 201s, at every size",
        "met": bool(races) and all(r["passed"] for r in races),
        "largest": max((r["duplicates"] for r in races), default=0),
    }
    drained = result.get("drain")
    ratio = drained["ratio"] if drained else None
    drain_target = {
        "target": f"drain with the store >= {TARGET_DRAIN_RATIO:.0%} of the engine alone's",
        "met": ratio is not None and ratio >= TARGET_DRAIN_RATIO,
        "ratio": ratio,
    }
    return {"ingest": ingest, "race": race_target, "drain": drain_target}
