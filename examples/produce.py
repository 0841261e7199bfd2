"""Add jobs and wait for their results: `python examples/produce.py redis://...`."""

from __future__ import annotations

import asyncio
import sys

from examples.tasks import worker
from sluice import JobSpec, Queue


async def main(url: str) -> None:
    async with Queue.from_url(url, "default", known_names=worker.names) as queue:
        jobs = await queue.add_bulk(JobSpec("shout", {"text": f"job {i}"}, priority=i % 3) for i in range(10))
        for job in jobs:
            print(job.id, await job.result(timeout=30))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
