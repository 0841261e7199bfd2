"""Driving the dispatch script by hand, with the clock passed in (shared by the flow and budget tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice import Queue
from sluice.engine.protocol import LEASED_FIELDS, StepReply

LEASE_MS = 10_000


def leased(reply: StepReply) -> list[tuple[str, bytes]]:
    """(job id, token) of each job a step leased, in order."""
    j = reply.jobs
    return [(j[i].decode(), str(j[i + 1]).encode()) for i in range(0, len(j), LEASED_FIELDS)]


def lease_pairs(jobs: list[Any]) -> list[tuple[str, Any]]:
    """(job id, token as the reply has it) of each job in a dispatch reply's flat job list."""
    return [(jobs[i].decode(), jobs[i + 1]) for i in range(0, len(jobs), LEASED_FIELDS)]


def ids_of(reply: StepReply) -> list[str]:
    return [job_id for job_id, _ in leased(reply)]


def completed(job_id: str, token: bytes, usage: int = -1) -> tuple[str, bytes, bytes, bytes, int, int]:
    return (job_id, token, b"c", b'"ok"', 0, usage)


async def step(queue: Queue, now: int, want: int = 10, outcomes: Sequence[Any] = ()) -> StepReply:
    return await queue.protocol.step(now=now, want=want, lease_ms=LEASE_MS, worker_id="w", outcomes=outcomes)
