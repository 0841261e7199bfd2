"""The chaos bench's worker: ``sluice worker sluice_lab.chaos_worker:worker``.

Its one handler, ``chaos_job``, stands for a job with a side effect: it
sleeps the milliseconds its payload asks for. Around that, it keeps a
*witness* of the execution outside the queue's Redis, because the bench's
whole point is to check the queue against something the queue cannot have
rewritten or lost: a line when the execution starts and a line when it ends
(returned, or cancelled by the worker when its lease was lost), appended to
a file of this process's own (``witness-<pid>.jsonl`` in the folder the
payload names) with ``O_APPEND`` and fsync'd before the handler goes on.
A line is in the kernel once ``write`` returns, so a SIGKILL right after it
cannot take it back; the fsync keeps it through a crash of the machine too.

The job's result names the execution (process id and lease token), so the
bench can tell which execution's commit the queue kept.

The folder travels in the payload, not in an environment variable: the
bench hands the workers nothing else, and each job then says where its own
witness goes.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import orjson

from sluice.engine.context import JobContext
from sluice.engine.worker import Worker

#: Seconds a lease lasts without renewal. Short, so that a frozen worker's jobs
#: are taken over within a few seconds; the bench freezes workers for longer.
LEASE_S = 2.0
#: Events the stream keeps: every completion of a run must stay readable,
#: since the bench counts accepted commits per job from the 'completed' events.
EVENTS_MAXLEN = 10_000_000
#: File name of one process's witness, in the folder the payload names.
WITNESS_PATTERN = "witness-{pid}.jsonl"

#: The bench passes --queue and --concurrency; these are only defaults.
worker = Worker("chaos", concurrency=8, lease=LEASE_S, shutdown_grace=10.0, events_maxlen=EVENTS_MAXLEN)


class Witness:
    """This process's witness file: one JSON line per event, appended and fsync'd.

    One descriptor per folder, opened on first use. Lines are far shorter
    than PIPE_BUF, so appends from concurrent handlers never interleave.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def write(self, folder: str, record: dict[str, Any]) -> None:
        fd = self._fds.get(folder)
        if fd is None:
            path = Path(folder) / WITNESS_PATTERN.format(pid=os.getpid())
            fd = self._fds[folder] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        os.fsync(fd)


_witness = Witness()


def _token(ctx: JobContext) -> int:
    return int(ctx.token.decode() if isinstance(ctx.token, bytes) else ctx.token)


@worker.handler
async def chaos_job(job: JobContext) -> dict[str, Any]:
    """Witness the start, sleep ``ms``, witness the end; the result names this execution."""
    payload: dict[str, Any] = job.payload
    folder = str(payload["dir"])
    execution = {
        "job": job.id,
        "n": payload["n"],
        "attempt": job.attempt,
        "token": _token(job),
        "pid": os.getpid(),
        "worker": job.worker_id,
    }
    _witness.write(folder, {"ev": "start", **execution, "t": time.time()})
    status = "cancelled"
    try:
        await asyncio.sleep(int(payload["ms"]) / 1000)
        status = "returned"
        return {"pid": execution["pid"], "token": execution["token"], "n": payload["n"]}
    finally:
        _witness.write(folder, {"ev": "end", **execution, "status": status, "t": time.time()})
