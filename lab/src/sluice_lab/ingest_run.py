"""What the measurements of ``sluice bench ingest`` share: the run's servers and clients, the
CPU each party spent, the load generators' processes and the sink's catch-up."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psutil

from sluice.engine.queue import Queue
from sluice.store.database import Database
from sluice.store.sink import caught_up
from sluice_lab.bench_database import BenchDatabase
from sluice_lab.ingest_server import ApiServer
from sluice_lab.ingest_spec import ROUTES, IngestSpec
from sluice_lab.procs import WorkerGroup, process_cpu_s, redis_cpu_s

#: Called with what the run is doing now.
Progress = Callable[[str], None]


def _tree_cpu(pid: int | None) -> float:
    """CPU seconds of a process and its live children (the API's workers, PostgreSQL's backends)."""
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    return sum(process_cpu_s(p) for p in procs)


# ---- the load generators --------------------------------------------------------------------------------
async def run_generators(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run one generator process per config (``python -m sluice_lab.ingest_load``), return their results."""

    async def one(cfg: dict[str, Any]) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="sluice-ingest-") as folder:
            out = Path(folder) / "result.json"
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "sluice_lab.ingest_load",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await proc.communicate(orjson.dumps(cfg | {"out": str(out)}))
            if proc.returncode != 0:
                raise RuntimeError(f"a load generator failed ({proc.returncode}): {err.decode()[-2000:]}")
            result: dict[str, Any] = orjson.loads(out.read_bytes())
        return result

    return list(await asyncio.gather(*(one(c) for c in configs)))


def body_template(route: str, key_prefix: str) -> tuple[str, int]:
    """The request body (``{i}`` stands for the request's number) and the status a success is."""
    template, ok = ROUTES[route]
    return template.format(key=key_prefix), ok


# ---- the run ---------------------------------------------------------------------------------------------
@dataclass
class _Run:
    """What the measurements share: the servers, the clients, where logs go."""

    spec: IngestSpec
    redis_url: str
    database: BenchDatabase
    redis: Any
    db: Database
    log_dir: Path
    progress: Progress

    async def cpu_mark(self, server: ApiServer | None, workers: WorkerGroup | None = None) -> dict[str, Any]:
        return {
            "t": time.monotonic(),
            "api": server.cpu_s() if server is not None else {},
            "workers": sum(workers.cpu_s().values()) if workers is not None else 0.0,
            "redis": await redis_cpu_s(self.redis),
            "postgres": _tree_cpu(self.database.pid),
            "machine": psutil.cpu_times(),
        }


def _cpu_delta(a: dict[str, Any], b: dict[str, Any], requests: int) -> dict[str, Any]:
    """CPU each party spent between two marks, per request (µs), and how busy the machine was."""
    api = {pid: b["api"][pid] - a["api"].get(pid, 0.0) for pid in b["api"]}
    ma, mb = a["machine"], b["machine"]
    total = sum(mb) - sum(ma)
    idle = (mb.idle + getattr(mb, "iowait", 0.0)) - (ma.idle + getattr(ma, "iowait", 0.0))
    per = max(requests, 1)
    workers = b["workers"] - a["workers"]
    return {
        **({"worker_cpu_us_per_job": round(workers / per * 1e6, 1)} if workers else {}),
        "api_cpu_s_per_process": sorted(round(v, 2) for v in api.values()),
        "api_cpu_us_per_request": round(sum(api.values()) / per * 1e6, 1),
        "redis_cpu_us_per_request": round((b["redis"] - a["redis"]) / per * 1e6, 1),
        "postgres_cpu_us_per_request": round((b["postgres"] - a["postgres"]) / per * 1e6, 1)
        if b["postgres"]
        else None,
        "machine_busy_share": round(1 - idle / total, 3) if total > 0 else None,
        "window_s": round(b["t"] - a["t"], 2),
    }


async def _sink_catch_up(run: _Run, queue_name: str, timeout: float = 120.0) -> float | None:
    """Seconds until the sink has read and applied every event of the queue (its consumer group
    delivered the stream's last entry and holds none pending; None: not within ``timeout``);
    the next rate starts from a store that is up to date."""
    t0 = time.monotonic()
    queue = Queue(queue_name, redis=run.redis)
    while time.monotonic() - t0 < timeout:
        if await caught_up(queue):
            return round(time.monotonic() - t0, 2)
        await asyncio.sleep(0.25)
    return None
