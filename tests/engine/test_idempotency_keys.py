"""Provider idempotency keys (``JobContext.idempotency_key``) never repeat.

Job ids are per queue and start again from 1 when Redis loses its data, so a
key made of the queue and the id alone was handed to a provider twice for two
different jobs: by two environments (key prefixes) on one provider account,
or by the same queue before and after a data loss. The key now carries the
prefix, the queue and the queue's epoch, a random value kept in Redis.
"""

from __future__ import annotations

from redis.asyncio import Redis

from sluice import Backoff, JobContext, Queue, Worker
from sluice_lab.common import drop_queue
from tests.conftest import running


async def keys_of_two_jobs(redis: Redis, prefix: str) -> list[tuple[str, str]]:
    """(job id, the key its handler saw) for two jobs; the first fails once, so its key
    is seen by two attempts, which must agree."""
    queue = Queue("q", redis=redis, prefix=prefix)
    w = Worker("q", prefix=prefix)
    seen: dict[str, set[str]] = {}

    @w.handler
    async def call(job: JobContext) -> str:
        seen.setdefault(job.id, set()).add(job.idempotency_key)
        if job.payload == "flaky" and job.attempt == 1:
            raise RuntimeError("the provider timed out")
        return job.idempotency_key

    async with running(w, redis):
        flaky = await queue.add("call", "flaky", backoff=Backoff.fixed(0.01))
        jobs = [flaky, await queue.add("call", "steady")]
        results = [await j.result(timeout=10) for j in jobs]
    await queue.close()
    assert [len(seen[j.id]) for j in jobs] == [1, 1]  # every attempt of a job sees one key
    return [(j.id, key) for j, key in zip(jobs, results, strict=True)]


async def test_keys_are_unique_across_prefixes_and_after_redis_lost_its_data(
    redis: Redis, prefix: str
) -> None:
    staging = await keys_of_two_jobs(redis, prefix + "-staging")
    production = await keys_of_two_jobs(redis, prefix + "-production")
    # the same job ids in two environments
    assert [i for i, _ in staging] == [i for i, _ in production] == ["1", "2"]
    # Redis loses the production queue's data: ids start again from 1
    await drop_queue(redis, "q", prefix + "-production")
    after_loss = await keys_of_two_jobs(redis, prefix + "-production")
    assert [i for i, _ in after_loss] == ["1", "2"]
    keys = [key for _, key in staging + production + after_loss]
    assert len(set(keys)) == 6, keys
    assert staging[0][1].startswith(f"{prefix}-staging:q:")
