"""What the transition sink's writes cost PostgreSQL per drained job, by schema.

A drain with the store on spends a third of its CPU in PostgreSQL (``sluice
bench ingest``'s drain table). This script isolates that part: it stores
``--jobs`` jobs as the API does (QUEUED rows), then applies to each what the
sink applies when a job is drained (one UPDATE to COMPLETED and one attempt,
in batches of ``--batch``, the sink's own statements), and reports the CPU
the PostgreSQL backend spent per job. It runs each variant of the schema
``--reps`` times, interleaved, each in a fresh database:

- ``as built``: the migrations at head (a job's state in ``job_states``, a
  narrow row of its own, since 0008);
- ``wide jobs``: before 0008, the state in the job's own row, so that an
  update rewrites the whole job and adds an entry to each of its five indexes;
- ``attempts FK``: as ``wide jobs``, with the attempts' foreign key to jobs
  (before 0007);
- ``no attempts``: the job's UPDATE alone (what the attempt costs at all).

    .venv/bin/python benchmarks/store_writes.py
    .venv/bin/python benchmarks/store_writes.py --database postgresql://postgres@127.0.0.1:5432/postgres

With no ``--database`` it starts an embedded PostgreSQL (durable, as the
benchmarks' is). On a given server it creates a database per variant and run
and drops it after; the backend's CPU is read from /proc, so the server must
be on this machine (elsewhere only wall time is reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
from sqlalchemy.engine import make_url

from sluice.local.postgres import EmbeddedPostgres
from sluice.store.database import Database, redact_url
from sluice.store.patches import _START, _UPDATE

VARIANTS = ("as built", "wide jobs", "attempts FK", "no attempts")
#: The schema each variant starts from (a migration's revision).
_REVISION = {"wide jobs": "0007", "attempts FK": "0007"}

# The sink's planner settings (store/patches.py says why).
_PLAN = "SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off; SET LOCAL enable_seqscan = off"
_FK = (
    "ALTER TABLE job_attempts ADD CONSTRAINT fk_job_attempts_job_id_jobs "
    "FOREIGN KEY (job_id) REFERENCES jobs (id) ON DELETE CASCADE"
)
# The API's rows, as ``JobStore`` inserts them for a NestJS-style ``generic`` job with a key.
_INSERT = """
WITH j AS (
    INSERT INTO jobs (id, tenant, queue, type, priority, max_attempts, payload, idempotency_key,
                      correlation_id, tokens, delay_ms, backoff, created_at)
    SELECT id, 't', 'q', 'generic', 10, 10, ('{"n":' || n || '}')::jsonb, 'key-' || id, md5(id::text),
           0, 0, '["exponential", 2.0, 86400.0, 0.0]'::jsonb, $2
    FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, n)
    RETURNING id
)
INSERT INTO job_states (id, tenant, queue, created_at, status, updated_at)
SELECT id, 't', 'q', $2, 'QUEUED', $2 FROM j
"""
_INSERT_WIDE = """
INSERT INTO jobs (id, tenant, queue, type, status, priority, attempts, max_attempts, payload,
                  idempotency_key, correlation_id, tokens, delay_ms, backoff, created_at, updated_at)
SELECT id, 't', 'q', 'generic', 'QUEUED', 10, 0, 10, ('{"n":' || n || '}')::jsonb, 'key-' || id,
       md5(id::text), 0, 0, '["exponential", 2.0, 86400.0, 0.0]'::jsonb, $2, $2
FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, n)
"""
_COMPLETED = "SELECT count(*) FROM job_states WHERE status = 'COMPLETED'"
_COMPLETED_WIDE = "SELECT count(*) FROM jobs WHERE status = 'COMPLETED'"


def _cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_variant(server_url: str, variant: str, jobs: int, batch: int) -> dict[str, Any]:
    """One variant in a database of its own: store the jobs, then time their drain's writes."""
    name = "store_writes_" + secrets.token_hex(4)
    plain = make_url(server_url).set(drivername="postgresql")
    admin = await asyncpg.connect(plain.render_as_string(hide_password=False))
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = plain.set(database=name)
    try:
        db = Database(url.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False))
        try:
            await db.migrate(_REVISION.get(variant, "head"))
        finally:
            await db.close()
        conn = await asyncpg.connect(url.render_as_string(hide_password=False))
        try:
            return await _measure(conn, variant, jobs, batch)
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        await admin.close()


async def _measure(conn: asyncpg.Connection, variant: str, jobs: int, batch: int) -> dict[str, Any]:
    wide = variant in _REVISION
    if variant == "attempts FK":
        await conn.execute(_FK)
    ids = [uuid.uuid4() for _ in range(jobs)]
    now = datetime.now(UTC)
    for start in range(0, jobs, 5000):
        await conn.execute(_INSERT_WIDE if wide else _INSERT, ids[start : start + 5000], now)
    # What autovacuum would have done by then, and a checkpoint: every variant starts alike.
    await conn.execute("VACUUM ANALYZE")
    await conn.execute("CHECKPOINT")
    update = _UPDATE.replace("UPDATE job_states AS j", "UPDATE jobs AS j") if wide else _UPDATE
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    ms = int(time.time() * 1000)
    cpu0, wall0 = _cpu_s(pid), time.perf_counter()
    for start in range(0, jobs, batch):
        part = sorted(ids[start : start + batch], key=lambda u: u.int)  # as the sink orders them
        n = len(part)
        async with conn.transaction():
            await conn.execute(_PLAN)
            await conn.fetch(
                update, part, ["COMPLETED"] * n, [1] * n, [False] * n,
                ['{"ok": true}'] * n, [None] * n, [ms] * n, [ms + 5] * n, [ms + 5] * n, [1] * n, now,
            )  # fmt: skip
            if variant != "no attempts":
                await conn.execute(
                    _START, part, [1] * n, [1] * n, ["worker-1"] * n, [ms] * n, [ms + 5] * n,
                    ["completed"] * n, [None] * n,
                )  # fmt: skip
    cpu1, wall = _cpu_s(pid), time.perf_counter() - wall0
    done = await conn.fetchval(_COMPLETED_WIDE if wide else _COMPLETED)
    if done != jobs:
        raise RuntimeError(f"{variant}: {done} of {jobs} jobs COMPLETED after the writes")
    cpu = None if cpu0 is None or cpu1 is None else round((cpu1 - cpu0) / jobs * 1e6, 1)
    return {"variant": variant, "backend_cpu_us_per_job": cpu, "wall_us_per_job": round(wall / jobs * 1e6, 1)}


async def main(server_url: str, variants: list[str], jobs: int, batch: int, reps: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for variant in variants:  # interleaved: a noisy minute weighs on every variant alike
            row = await run_variant(server_url, variant, jobs, batch)
            print(
                f"  rep {rep + 1}/{reps} {variant:>13}: {row['backend_cpu_us_per_job']} µs CPU/job",
                file=sys.stderr,
            )
            runs.append(row)
    summary = []
    for variant in variants:
        cpus = [r["backend_cpu_us_per_job"] for r in runs if r["variant"] == variant]
        walls = [r["wall_us_per_job"] for r in runs if r["variant"] == variant]
        summary.append(
            {
                "variant": variant,
                "backend_cpu_us_per_job_median": statistics.median(cpus) if None not in cpus else None,
                "backend_cpu_us_per_job": cpus,
                "wall_us_per_job_median": statistics.median(walls),
            }
        )
    base = summary[0]["backend_cpu_us_per_job_median"]
    for row in summary:
        cpu = row["backend_cpu_us_per_job_median"]
        row["vs_first"] = round(cpu / base, 2) if cpu is not None and base else None
    return {
        "benchmark": "store_writes",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "jobs": jobs,
        "batch": batch,
        "reps": reps,
        "cpus": os.cpu_count(),
        "summary": summary,
        "runs": runs,
    }


def _print(result: dict[str, Any]) -> None:
    print(f"{'variant':>14}  {'PG CPU µs/job (median)':>22}  {'vs first':>8}  {'wall µs/job':>11}")
    for row in result["summary"]:
        print(
            f"{row['variant']:>14}  {row['backend_cpu_us_per_job_median']!s:>22}  "
            f"{row['vs_first']!s:>8}  {row['wall_us_per_job_median']:>11}"
        )


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database", help="a PostgreSQL server's URL (default: an embedded one)")
    parser.add_argument("--jobs", type=int, default=100_000, help="jobs per run (default 100,000)")
    parser.add_argument("--batch", type=int, default=2500, help="jobs per transaction (the sink's: 2,500)")
    parser.add_argument("--reps", type=int, default=3, help="runs of each variant, interleaved (default 3)")
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="only these (repeatable)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.batch < 1 or args.reps < 1:
        parser.error("--jobs, --batch and --reps must be at least 1")
    variants = args.variant or list(VARIANTS)
    if args.database:
        try:
            result = asyncio.run(main(args.database, variants, args.jobs, args.batch, args.reps))
        except (OSError, asyncpg.PostgresError) as exc:
            print(
                f"error: PostgreSQL at {redact_url(args.database)} failed: {type(exc).__name__}: {exc}; "
                "check that it runs and that its user may create databases (or leave out --database for an "
                "embedded server)",
                file=sys.stderr,
            )
            return 1
    else:
        with (
            tempfile.TemporaryDirectory(prefix="sluice-store-writes-") as tmp,
            EmbeddedPostgres(tmp, port=0, durable=True, database="postgres") as server,
        ):
            result = asyncio.run(main(server.url, variants, args.jobs, args.batch, args.reps))
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
