"""``sluice serve -p N`` as ``sluice bench ingest`` runs it, and the API key its load sends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from sluice.local.embedded import free_port
from sluice.store.database import Database
from sluice.store.keys import KeyStore
from sluice_lab.procs import process_cpu_s

#: Settings of the API processes. Backpressure and the per-key rate limit are measured by their
#: own tests; here a refused submission would be an error of the benchmark (one key sends every
#: request), so neither refuses.
SERVICE_ENV = {
    "SLUICE_MAX_BACKLOG_SECONDS": "1e12",
    "SLUICE_MAX_DEPTH": str(10**12),
    "SLUICE_RATE_LIMIT": "0",
}


@dataclass
class ApiServer:
    """``sluice serve -p N`` as a user runs it, in a session of its own, stopped by its pid."""

    redis_url: str
    database_url: str
    queue: str
    processes: int
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        env |= SERVICE_ENV
        argv = [sys.executable, "-m", "sluice", "serve", "-p", str(self.processes), "--port", str(self.port)]
        argv += ["--queue", self.queue, "--redis", self.redis_url, "--database", self.database_url]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )

    async def wait_ready(self, timeout: float = 90.0) -> None:
        """/readyz answers 200, and every API process runs."""
        assert self.proc is not None
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.base, timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sluice serve exited with {self.proc.returncode}: {self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    ready = (await client.get("/readyz")).status_code == 200
                    if ready and len(self.api_pids()) >= self.processes:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sluice serve was not ready within {timeout:g} s: {self.log_tail()}")
                await asyncio.sleep(0.2)

    def api_pids(self) -> list[int]:
        """The processes serving requests: uvicorn's workers, or the one process with -p 1."""
        if self.proc is None:
            return []
        if self.processes == 1:
            return [self.proc.pid]
        pids = []
        try:
            for child in psutil.Process(self.proc.pid).children():
                # uvicorn's workers are multiprocessing children; its resource tracker is not one
                with contextlib.suppress(psutil.Error):
                    if any("spawn_main" in arg for arg in child.cmdline()):
                        pids.append(child.pid)
        except psutil.Error:
            return []
        return pids

    def cpu_s(self) -> dict[int, float]:
        """CPU seconds of each API process so far (and of uvicorn's supervisor, under its pid)."""
        pids = self.api_pids()
        if self.proc is not None and self.proc.pid not in pids:
            pids.append(self.proc.pid)
        out = {}
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                out[pid] = process_cpu_s(psutil.Process(pid))
        return out

    def log_tail(self, size: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM (uvicorn stops its workers), SIGKILL to the session after ``grace``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(10)


async def make_key(db: Database, tenant: str) -> str:
    _, key = await KeyStore(db).create(tenant, admin=False, name="sluice bench ingest")
    return key
