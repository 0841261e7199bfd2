"""The provider's view wins: what answers say of the provider's limits reaches the queue's gates.

The script (observe.lua) step by step: use the provider counted that the queue did not start is
added to its windows at the dispatch time and leaves with them; a lower stated limit lowers the
queue's; nothing when following is off. Then the way there: a real worker process passing on
its handlers' reports, and Sluice's OpenAI provider reading the simulated provider's headers.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sluice import ConfigurationError, JobContext, JobSpec, Queue
from sluice.engine.provider_view import MAX_BATCH, LimitReport, ProviderView
from sluice.llm.openai import OpenAIProvider
from sluice.testing.provider import serve_provider
from sluice.testing.simulated_server import ProviderLimits
from tests.engine.test_flow import FLOW_TARGET
from tests.harness.proc_harness import WorkerProcs
from tests.harness.stepping import ids_of as ids
from tests.harness.stepping import leased, step

#: A fixed clock for the tests that pass ``now`` (Unix ms).
T = 1_800_000_000_000


async def observe(queue: Queue, now: int, *reports: LimitReport) -> list[int]:
    args = [a for r in reports for a in r.args()]
    return [int(v) for v in await queue.scripts.observe(keys=queue.keys.flow, args=[now, *args])]


async def test_requests_the_provider_counted_beyond_the_queue_fill_its_window(queue: Queue) -> None:
    # Given 10 starts a second (no pacer, no headroom) and two calls started at T
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_rate_limit(10, per=1)
    await queue.add_bulk(JobSpec("x") for _ in range(12))
    assert len(ids(await step(queue, T, want=2))) == 2

    # When an answer says 3 requests remain of 10 when the first arrived (7 used: 5 the
    # queue did not start, e.g. another program on the key)
    assert await observe(queue, T + 150, LimitReport(T, 10, 3)) == [5, 0, 0]

    # Then the window counts them from T, and only 3 more start before it turns
    flow = await queue.flow(now=T + 150)
    assert (flow.starts_in_window, flow.unseen_requests) == (7, 5)
    reply = await step(queue, T + 151)
    assert (len(ids(reply)), reply.next_due) == (3, T + 1000)
    # A second answer from the same moment saying the same adds nothing: the window saw it
    assert await observe(queue, T + 160, LimitReport(T, 10, 3)) == [0, 0, 0]
    # and they leave with the window
    assert len(ids(await step(queue, T + 1000))) == 7


async def test_a_lower_limit_stated_by_the_provider_lowers_the_queues(queue: Queue) -> None:
    await queue.set_rate_limit(10, per=1)
    await queue.set_token_rate_limit(50_000, per=60)
    assert await observe(queue, T, LimitReport(T, limit_requests=6, limit_tokens=40_000)) == [0, 2, 0]
    flow = await queue.flow(now=T)
    assert (flow.rate_max, flow.token_limit) == (6, 40_000)
    # a higher one changes nothing: the queue may be meant to use part of the key
    assert await observe(queue, T, LimitReport(T, limit_requests=600, limit_tokens=90_000)) == [0, 0, 0]
    assert (await queue.flow(now=T)).rate_max == 6


async def test_tokens_remaining_are_not_compared_only_the_token_limit_is(queue: Queue) -> None:
    """The token window drops charges as they leave it: by the time an answer is back it no
    longer holds what it held at the dispatch, so remaining tokens would be misread."""
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_token_rate_limit(1000, per=1)
    await queue.add_bulk(JobSpec("llm", tokens=100) for _ in range(3))
    assert len(ids(await step(queue, T, want=1))) == 1
    said = LimitReport(T, limit_tokens=1000, remaining_tokens=600)
    assert await observe(queue, T + 100, said) == [0, 0, 0]
    assert (await queue.flow(now=T + 100)).tokens_in_window == 100


async def test_nothing_follows_the_provider_when_turned_off(queue: Queue) -> None:
    await queue.set_rate_limit(10, per=1)
    await queue.follow_provider(False)
    assert (await queue.flow(now=T)).follows_provider is False
    assert await observe(queue, T, LimitReport(T, 5, 0)) == [0, 0, 0]
    assert (await queue.flow(now=T)).rate_max == 10
    await queue.follow_provider(True)
    assert (await queue.flow(now=T)).follows_provider is True
    with pytest.raises(ConfigurationError, match="enabled must be True or False"):
        await queue.follow_provider("no")  # type: ignore[arg-type]


async def test_late_calls_stay_longer_in_the_windows(queue: Queue) -> None:
    # Given 2 starts a second and 1000 tokens (no pacer, no headroom), two calls started at T
    await queue.set_pacing(tolerance_ms=None, headroom_ms=0)
    await queue.set_rate_limit(2, per=1)
    await queue.set_token_rate_limit(1000, per=1)
    await queue.add_bulk(JobSpec("llm", tokens=400) for _ in range(4))
    (first, t1), _ = leased(await step(queue, T))

    # When the first reached the provider 30 ms later than the quickest: it holds its place in
    # the provider's windows 30 ms longer, and so in the queue's
    late = LimitReport(T, member=f"{first}:{t1.decode()}", tokens=400, late_ms=30)
    assert await observe(queue, T + 200, late) == [0, 0, 2]
    reply = await step(queue, T + 1000)
    assert (len(ids(reply)), reply.next_due) == (1, T + 1030)  # the second's place is free
    assert len(ids(await step(queue, T + 1030))) == 1
    # moved later only, never earlier; a start that has left the log is not looked for
    assert await observe(
        queue, T + 1031, LimitReport(T, member=f"{first}:{t1.decode()}", tokens=400, late_ms=10)
    ) == [
        0,
        0,
        0,
    ]


def test_the_view_keeps_the_latest_reports_and_refuses_what_is_not_a_count() -> None:
    view = ProviderView()
    view.add(T)  # said nothing: not kept
    for i in range(MAX_BATCH + 5):
        view.add(T + i, remaining_requests=i)
    taken = view.take()
    assert [r.remaining_requests for r in taken] == list(range(5, MAX_BATCH + 5))
    assert view.take() == []
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="remaining_tokens must be an integer >= 0"):
            view.add(T, remaining_tokens=bad)  # type: ignore[arg-type]


# ---- the way there ---------------------------------------------------------------------------------------
async def test_a_worker_process_passes_its_handlers_reports_to_the_queue(
    redis: Redis, queue: Queue, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # Given a queue of 10 starts a minute whose provider says, in every answer, that 2 of its
    # 10 remain: 8 used, most of them by someone else
    await queue.set_rate_limit(10, per=60)
    with WorkerProcs(redis_url, prefix, tmp_path) as procs:
        procs.launch("w1", FLOW_TARGET, "--concurrency", "2")
        first = await queue.add("says_limits", {"limit_requests": 10, "remaining_requests": 2})
        await first.result(timeout=30)
        # Then within a report interval the queue's window holds the 7 it did not start
        deadline = time.monotonic() + 10
        flow = await queue.flow()
        while flow.unseen_requests == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            flow = await queue.flow()
        assert (flow.unseen_requests, flow.starts_in_window) == (7, 8)


async def test_the_openai_provider_passes_on_the_answers_rate_limit_headers() -> None:
    view = ProviderView()
    job = JobContext("q", "1", "x", None, 1, 1, 0, "w", 1, dispatched_ms=T, provider_view=view)
    from sluice.engine.context import set_current_job

    with serve_provider(ProviderLimits(requests=50, tokens=10_000, window=60)) as url:
        provider = OpenAIProvider(base_url=f"{url}/v1", api_key_env=None, name="simulated")
        try:
            set_current_job(job)
            await provider.complete([{"role": "user", "content": "abcd" * 10}], model="m", max_tokens=20)
        finally:
            set_current_job(None)
            await provider.aclose()
    (report,) = view.take()
    # 10 prompt tokens (40 characters) + 20 to write, as the provider counts them
    assert report == LimitReport(T, 50, 49, 10_000, 10_000 - 30, member="1:1", tokens=0, late_ms=0)


def test_the_transit_is_the_round_trip_less_the_providers_own_time() -> None:
    import httpx

    from sluice.llm.limit_headers import transit_ms

    assert transit_ms(httpx.Headers({"openai-processing-ms": "120"}), 150.5) == 30.5
    assert transit_ms(httpx.Headers({}), 150.5) is None
    assert transit_ms(httpx.Headers({"openai-processing-ms": "x"}), 150.5) is None
    assert transit_ms(httpx.Headers({"openai-processing-ms": "200"}), 150.5) is None  # clocks disagree


async def test_the_simulated_provider_says_how_long_it_spent_as_openai_does() -> None:
    import httpx

    from sluice.testing.provider import COMPLETIONS_PATH, PROCESSING_HEADER

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    with serve_provider(ProviderLimits(requests=10, window=60, latency=0.05)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            reply = await http.post(COMPLETIONS_PATH, json=body)
    assert 50 <= int(reply.headers[PROCESSING_HEADER]) < 1000
