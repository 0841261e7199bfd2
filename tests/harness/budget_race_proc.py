"""One process of the budget race (tests/engine/test_budgets.py): many reservations, as fast as it can.

``python -m tests.harness.budget_race_proc URL PREFIX BUDGET INDEX COUNT SEED OUT`` (cwd: the repository).

It says it is ready (INCR :func:`ready_key`), waits for the start signal (a
BLPOP on :func:`go_key`), then makes COUNT reservations of 1 to 200 tokens
(sizes from ``random.Random(SEED)``) with ids ``p<INDEX>-<i>`` against BUDGET
through ``Queue.budgets.reserve``, each followed by a pause of up to a
millisecond (half of them none). After every tenth it also reserves one of
the ids ``shared-<i>.<BUDGET>``, which every process of that budget asks for
with the same size, so the processes race on the same ids too (an id names
one reservation, so processes of other budgets use ids of their own). It writes what each call answered
to OUT as JSON: a list of ``[id, tokens, accepted, duplicate, remaining,
refused_by]``.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import orjson

from sluice import Queue


def ready_key(prefix: str) -> str:
    return f"{prefix}:test:race:ready"


def go_key(prefix: str) -> str:
    return f"{prefix}:test:race:go"


def shared_size(i: int) -> int:
    """The size every process asks for under the id ``shared-<i>``."""
    return i * 37 % 200 + 1


async def race(url: str, prefix: str, budget: str, index: int, count: int, seed: int) -> list[list[object]]:
    rng = random.Random(seed)
    answers: list[list[object]] = []
    async with Queue.from_url(url, "q", prefix=prefix) as queue:

        async def reserve(rid: str, tokens: int) -> None:
            r = await queue.budgets.reserve(budget, tokens, rid)
            answers.append([rid, tokens, r.accepted, r.duplicate, r.remaining, r.refused_by])

        await queue.redis.incr(ready_key(prefix))
        if not await queue.redis.blpop([go_key(prefix)], timeout=30):
            raise SystemExit("no start signal within 30 s")
        for i in range(count):
            await reserve(f"p{index}-{i}", rng.randint(1, 200))
            if i % 10 == 0:
                await reserve(f"shared-{i}.{budget}", shared_size(i))
            if rng.random() < 0.5:
                await asyncio.sleep(rng.random() / 1000)
    return answers


def main() -> None:
    url, prefix, budget, index, count, seed, out = sys.argv[1:]
    answers = asyncio.run(race(url, prefix, budget, int(index), int(count), int(seed)))
    Path(out).write_bytes(orjson.dumps(answers))


if __name__ == "__main__":
    main()
