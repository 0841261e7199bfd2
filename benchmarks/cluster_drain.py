"""Outgrowing one Redis: drain queues spread over a 3-master Redis Cluster, against one node.

Every key of a queue shares its hash tag, so one queue lives on one master;
a cluster adds capacity by giving different queues different masters. This
script spreads K queues (default 6, named so that their slots land on every
master in turn) over a local cluster of 3 masters, adds M no-op jobs to them,
drains them with W worker processes (``python -m sluice worker
sluice_lab.noop:worker``, one queue each, round robin), and does the same on a
single redis-server of the same version, alternating the two ``--reps`` times.

    .venv/bin/python benchmarks/cluster_drain.py                  # 6 queues, 30,000 jobs, 6 processes
    .venv/bin/python benchmarks/cluster_drain.py --jobs 60000 --processes 12 --reps 3

The drain rate is taken over the steady state, as ``sluice bench throughput``
does: from the moment every queue has completed a job until all M are done
(counted by the engine's counters). It prints a table and writes
``benchmarks/results/cluster-drain-<date>.json`` with every run, the CPU of
the worker processes (including start-up) and of every Redis node over the
run, and the machine it ran on.

Reading the ratio: a cluster helps when one Redis process is the bottleneck
(a core of its own at 100%). The workers need more CPU per job than Redis
(about 2:1), so the cluster's gain only shows on a machine with cores to
spare for more workers; on a small machine, where every process shares the
same few cores, expect a ratio near 1 (or below: three servers and more
connections cost a little), and read the per-node Redis CPU instead, which
shows the load shared out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import resource
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from sluice import JobSpec, Queue
from sluice.engine.connection import connect
from sluice.local.processes import worker_process
from sluice.testing import EmbeddedCluster, EmbeddedRedis, RedisBinary, find_binary

RESULTS = Path(__file__).parent / "results"
TARGET = "sluice_lab.noop:worker"


@dataclass
class Run:
    target: str  # "single" or "cluster"
    rep: int
    nodes: int
    queues: int
    jobs: int
    processes: int
    concurrency: int
    enqueue_rate: float = 0.0
    drain_rate: float = 0.0
    drain_s: float = 0.0
    startup_to_first_s: float = 0.0
    worker_cpu_s: float = 0.0
    redis_cpu_s: list[float] = field(default_factory=list)
    per_queue: dict[str, int] = field(default_factory=dict)


def queue_names(count: int, cluster: EmbeddedCluster, rep: int) -> list[str]:
    """``count`` fresh queue names whose slots take every master of ``cluster`` in turn."""
    names: list[str] = []
    masters = cluster.master_nodes
    i = 0
    while len(names) < count:
        name = f"drain{rep}-{i}"
        i += 1
        if cluster.node_for_slot(key_slot(name.encode())) is masters[len(names) % len(masters)]:
            names.append(name)
    return names


def redis_cpu(urls: list[str]) -> list[float]:
    """used_cpu_user + used_cpu_sys of every node, in seconds."""
    out = []
    for url in urls:
        with redis.Redis.from_url(url, socket_timeout=10) as c:
            info: Any = c.info("cpu")
            out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return out


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def drain(run: Run, url: str, node_urls: list[str], names: list[str]) -> None:
    client = connect(url)
    queues = [Queue(name, redis=client) for name in names]
    try:
        per_queue = run.jobs // len(queues)
        started = time.perf_counter()
        await asyncio.gather(*(q.add_bulk(JobSpec("noop") for _ in range(per_queue)) for q in queues))
        run.enqueue_rate = round(per_queue * len(queues) / (time.perf_counter() - started), 1)
        total = per_queue * len(queues)
        cpu0, redis0 = children_cpu(), redis_cpu(node_urls)
        env = dict(os.environ, SLUICE_LOG_LEVEL="warning")
        t0 = time.perf_counter()
        procs = [
            worker_process(url, names[i % len(names)], run.concurrency, f"w{i}", TARGET, env=env)
            for i in range(run.processes)
        ]
        try:
            steady: tuple[float, int] | None = None
            while True:
                counts = [(await q.counts())["completed"] for q in queues]
                done = sum(counts)
                now = time.perf_counter()
                if steady is None and all(counts):
                    steady = (now, done)
                    run.startup_to_first_s = round(now - t0, 3)
                if done >= total:
                    break
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError("a worker process exited early; run it by hand to see why")
                if now - t0 > 600:
                    raise RuntimeError(f"only {done} of {total} jobs done after 600 s")
                await asyncio.sleep(0.02)
            assert steady is not None
            run.drain_s = round(now - steady[0], 3)
            run.drain_rate = round((done - steady[1]) / max(run.drain_s, 1e-9), 1)
            run.per_queue = dict(zip(names, counts, strict=True))
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(30)
        run.worker_cpu_s = round(children_cpu() - cpu0, 2)
        run.redis_cpu_s = [round(b - a, 2) for a, b in zip(redis0, redis_cpu(node_urls), strict=True)]
    finally:
        for q in queues:
            await q.close()
        await client.aclose()


def run_single(binary: RedisBinary, run: Run, names: list[str], folder: Path) -> None:
    with EmbeddedRedis(folder / f"single-{run.rep}", binary=binary, port=0, persist=False) as server:
        asyncio.run(drain(run, server.url, [server.url], names))


def run_cluster(cluster: EmbeddedCluster, run: Run, names: list[str]) -> None:
    # Any node's URL will do; the workers find their queue's master themselves.
    asyncio.run(drain(run, cluster.url, cluster.urls, names))


def table(runs: list[Run], ratio: float) -> str:
    head = f"{'target':8} {'rep':>3} {'nodes':>5} {'queues':>6} {'procs':>5} {'jobs':>7} "
    head += f"{'drain jobs/s':>12} {'worker CPU s':>12}  redis CPU s per node"
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r.target:8} {r.rep:3d} {r.nodes:5d} {r.queues:6d} {r.processes:5d} {r.jobs:7d} "
            f"{r.drain_rate:12,.0f} {r.worker_cpu_s:12.1f}  {', '.join(f'{c:.1f}' for c in r.redis_cpu_s)}"
        )
    lines.append(f"aggregate drain, cluster / single (median of reps): {ratio:.2f}")
    return "\n".join(lines)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queues", type=int, default=6)
    ap.add_argument("--jobs", type=int, default=30_000, help="jobs in all, shared by the queues")
    ap.add_argument("--processes", type=int, default=6, help="worker processes, one queue each")
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.processes < args.queues:
        sys.exit("--processes must be at least --queues: every queue needs a worker")
    binary = find_binary()
    if binary.major_minor < (7, 0):
        print(f"note: redis-server {binary.version}; the figures of record use Redis 7", file=sys.stderr)
    load_start = os.getloadavg()
    runs: list[Run] = []
    with (
        tempfile.TemporaryDirectory(prefix="sluice-drain-") as tmp,
        EmbeddedCluster(Path(tmp) / "cluster", binary=binary) as cluster,
    ):
        for rep in range(1, args.reps + 1):
            names = queue_names(args.queues, cluster, rep)
            for target in ("single", "cluster"):
                nodes = 1 if target == "single" else cluster.masters
                run = Run(target, rep, nodes, args.queues, args.jobs, args.processes, args.concurrency)
                if target == "single":
                    run_single(binary, run, names, Path(tmp))
                else:
                    run_cluster(cluster, run, names)
                runs.append(run)
                print(f"{target} rep {rep}: {run.drain_rate:,.0f} jobs/s", file=sys.stderr)
    ratio = median([r.drain_rate for r in runs if r.target == "cluster"]) / median(
        [r.drain_rate for r in runs if r.target == "single"]
    )
    print(table(runs, ratio))
    out = args.json or RESULTS / f"cluster-drain-{dt.date.today().isoformat()}.json"
    meta = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis": f"{binary.version} ({binary.origin})",
        "masters": 3,
        "queues": args.queues,
        "load_avg_at_start": load_start,
        "load_avg_at_end": os.getloadavg(),
        "ratio_cluster_over_single": round(ratio, 3),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
