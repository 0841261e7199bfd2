"""Worker processes for the benchmarks, and the CPU they (and Redis) spend.

Workers are real OS processes started through the CLI (``python -m sluice
worker ...``), as users run them: an in-process worker would share the
event loop, the GIL and the CPU accounting with the driver and flatter the
figures. Each worker gets a session of its own so that a signal meant for
the driver never reaches it, and it is stopped by its pid only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from sluice.local.processes import worker_process

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: The handler module every benchmark worker runs.
WORKER_TARGET = "sluice_lab.noop:worker"

__all__ = ["WORKER_TARGET", "WorkerGroup", "process_cpu_s", "redis_cpu_s"]


def process_cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of one process and its reaped children (0 once it is gone)."""
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system + t.children_user + t.children_system)


async def redis_cpu_s(redis: Redis) -> float:
    """CPU seconds the Redis server has used (INFO cpu: used_cpu_sys + used_cpu_user)."""
    info: Any = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


@dataclass
class WorkerGroup:
    """Some worker processes started together and stopped together."""

    url: str
    queue: str
    concurrency: int
    env: Mapping[str, str] = field(default_factory=dict)
    #: where each worker's stderr goes (``<id>.log``); None discards it
    log_dir: Path | None = None
    #: the ``module:worker`` the processes run
    target: str = WORKER_TARGET
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    handles: list[psutil.Process] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def start(self, count: int) -> None:
        env = {**os.environ, "SLUICE_LOG_LEVEL": "warning", **self.env}
        for _ in range(count):
            wid = f"w{len(self.ids) + 1}"
            log = open(self.log_dir / f"{wid}.log", "wb") if self.log_dir else None  # noqa: SIM115
            try:
                proc = worker_process(
                    self.url,
                    self.queue,
                    self.concurrency,
                    wid,
                    self.target,
                    env=env,
                    stderr=log if log is not None else subprocess.DEVNULL,
                )
            finally:
                if log is not None:
                    log.close()  # the child holds its own descriptor
            self.procs.append(proc)
            self.handles.append(psutil.Process(proc.pid))
            self.ids.append(wid)

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds per worker id so far (a finished worker keeps its last reading)."""
        return {wid: process_cpu_s(h) for wid, h in zip(self.ids, self.handles, strict=True)}

    def peak_rss_mib(self) -> dict[str, float | None]:
        """Peak resident memory (VmHWM) per worker, as the peer harness reports it."""
        return {wid: _vm_hwm_mib(p.pid) for wid, p in zip(self.ids, self.procs, strict=True)}

    def exited(self) -> list[str]:
        return [wid for wid, p in zip(self.ids, self.procs, strict=True) if p.poll() is not None]

    def log_tail(self, wid: str, size: int = 2000) -> str:
        """The end of one worker's stderr, to explain a worker that died."""
        if self.log_dir is None:
            return ""
        try:
            return (self.log_dir / f"{wid}.log").read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> dict[str, float | None]:
        """SIGTERM each worker, wait up to ``grace`` s, SIGKILL the rest.

        Returns per worker the seconds it took to exit (None = it had to be killed),
        which shows whether a graceful stop works under benchmark load.
        """
        t0 = time.monotonic()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        exit_s: dict[str, float | None] = {}
        for wid, p in zip(self.ids, self.procs, strict=True):
            try:
                p.wait(max(0.0, grace - (time.monotonic() - t0)))
                exit_s[wid] = round(time.monotonic() - t0, 3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
                exit_s[wid] = None
        self.procs.clear()
        self.handles.clear()
        self.ids.clear()
        return exit_s


def _vm_hwm_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None
