"""The goodput benchmark, small: its variants against the simulated provider, real workers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from rich.console import Console

from sluice_lab.cli.goodput_cmd import goodput_table
from sluice_lab.goodput import (
    CLIENT_LIMITED,
    LIMITED,
    NO_LIMITER,
    GoodputSpec,
    goodput,
    run_variant,
    theoretical_min_s,
    workload,
)
from sluice_lab.goodput_limiter import ClientLimiter, ClientLimits
from sluice_lab.goodput_report import compare, spec_meta


def test_workload_is_deterministic_and_varied() -> None:
    calls = workload(200)
    assert calls == workload(200)
    costs = {c.tokens for c in calls}
    assert len(costs) > 50
    assert min(costs) >= 180 and max(costs) <= 440


def test_goodput_counts_complete_windows_and_takes_the_binding_limit() -> None:
    spec = GoodputSpec(requests=10, tokens=1000, window=1.0)
    # Two full windows (10 calls of 90 tokens each), then a partial one where the queue ran dry.
    accepted = [(100.0 + i * 0.1, 90) for i in range(20)] + [(102.5, 90)]
    figures = goodput(spec, accepted)
    assert figures["goodput_windows"] == 2
    assert figures["goodput_requests_pct"] == 100.0
    assert figures["goodput_tokens_pct"] == 90.0
    assert figures["goodput_pct"] == 100.0 and figures["binding"] == "requests"
    # Less than a window of arrivals: that one window stands.
    assert goodput(spec, [(5.0, 500), (5.5, 500)])["goodput_tokens_pct"] == 100.0
    assert goodput(spec, [])["goodput_pct"] is None
    # A run stopped with jobs left: the windows run to the stop, not to the last success.
    stopped = goodput(spec, [(100.0 + i * 0.1, 90) for i in range(10)], until=104.0)
    assert stopped["goodput_windows"] == 4 and stopped["goodput_requests_pct"] == 25.0
    minimum, binds = theoretical_min_s(spec, workload(10))
    assert binds == "tokens" and minimum == pytest.approx(sum(c.tokens for c in workload(10)) / 1000)


def result(variant: str, *, complete: bool) -> dict[str, Any]:
    """The figures the table reads, as run_variant returns them."""
    lat = {"p50_ms": 1000.0, "p95_ms": 2000.0, "p99_ms": 3000.0, "max_ms": 50.0}
    return {
        "variant": variant,
        "complete": complete,
        "completion_s": 20.0 if complete else None,
        "theoretical_min_s": 19.0,
        "goodput_pct": 97.0,
        "binding": "tokens",
        "rate_limited": 0 if complete else 900,
        "wasted_calls": 0 if complete else 900,
        "calls": 100 if complete else 1000,
        "e2e": lat,
        "dispatch_to_arrival": lat,
        "completed": 100 if complete else 10,
        "duplicates": 0,
        "lost_or_failed": 0 if complete else 90,
    }


def test_table_shows_no_time_or_latency_for_a_run_that_did_not_finish() -> None:
    variants = {LIMITED: result(LIMITED, complete=True), NO_LIMITER: result(NO_LIMITER, complete=False)}
    assert compare(variants) == {"goodput, % of the provider's limit": 1.0, "total calls": 10.0}
    console = Console(width=200, record=True)
    console.print(goodput_table({"spec": spec_meta(GoodputSpec(jobs=100)), "variants": variants}))
    text = console.export_text()
    assert "10 / 0 / 90" in text and "x10.00" in text
    completion = next(line for line in text.splitlines() if "completion time" in line)
    assert "20.00" in completion and "-" in completion.split("20.00")[1]


@pytest.mark.slow
async def test_limited_queue_meets_at_most_one_429_where_retrying_meets_many(
    redis: Redis, redis_url: str, tmp_path: Path
) -> None:
    # Given: 30 calls, a provider allowing 20 requests and 6,000 tokens per second (1.5 s of
    # work either way), and 2 worker processes of 8 that could send far more.
    spec = GoodputSpec(
        jobs=30,
        processes=2,
        concurrency=8,
        window=1.0,
        requests=20,
        tokens=6000,
        latency=0.02,
        latency_per_token=0.0,
        backoff_base=0.02,
        backoff_max=0.5,
        timeout=60.0,
    )
    # When: each variant runs against a fresh provider.
    results = {v: await run_variant(redis, redis_url, spec, v, tmp_path) for v in (LIMITED, NO_LIMITER)}
    # Then: every job ran exactly once in both, and only the retrying clients met 429s.
    for variant, r in results.items():
        assert r["warnings"] == [], variant
        assert (r["completed"], r["duplicates"], r["lost_or_failed"], r["dead"]) == (30, 0, 0, 0), variant
        assert r["accepted_calls"] == 30, variant
        assert r["provider"]["peak_window_requests"] <= 20 and r["provider"]["peak_window_tokens"] <= 6000
        assert r["e2e"]["samples"] == 30
    limited, retrying = results[LIMITED], results[NO_LIMITER]
    # At most one 429, at the first window's turn: a worker's first call can reach the
    # simulated provider about 15 ms after its dispatch (the others in about 3), and with no
    # quicker round trip seen yet the queue cannot tell it came late (see "Late calls stay
    # longer"), so the call that takes its place in the next window may arrive while the
    # provider still counts it. Measured in about half the runs of this tree; issue notes.
    assert limited["rate_limited"] <= 1 and limited["calls"] == 30 + limited["rate_limited"]
    # The provider's limits as they are, paced as the queue's own defaults say (none set here).
    assert limited["queue_limits"]["max_starts"] == 20
    assert limited["queue_limits"]["starts_window_s"] == pytest.approx(1.0)
    assert limited["queue_limits"]["tokens_window_s"] == pytest.approx(1.0)
    assert limited["queue_limits"]["pacing_set"] == {} and limited["queue_limits"]["pacing"]
    assert retrying["rate_limited"] > 3 * max(1, limited["rate_limited"])
    assert retrying["calls"] == 30 + retrying["rate_limited"] == 30 + retrying["wasted_calls"]
    assert retrying["max_attempt"] > 1
    assert compare(results)["total calls"] > 1
    console = Console(width=200, record=True)
    console.print(goodput_table({"spec": spec_meta(spec), "variants": results}))
    assert "sluice-limited" in console.export_text()


def test_pacing_is_left_to_the_queue_unless_given() -> None:
    assert GoodputSpec().pacing() == {}
    assert GoodputSpec(headroom_ms=10).pacing() == {"headroom_ms": 10}
    assert GoodputSpec(tolerance_ms=5, headroom_ms=0).pacing() == {"tolerance_ms": 5, "headroom_ms": 0}
    assert GoodputSpec(pacer=False).pacing() == {"tolerance_ms": None}
    assert GoodputSpec(pacer=True).pacing() == {}
    with pytest.raises(ValueError, match="not both"):
        GoodputSpec(pacer=False, tolerance_ms=20)
    with pytest.raises(ValueError, match="network_delay"):
        GoodputSpec(network_delay=-0.005)
    assert GoodputSpec(network_delay=0.05).provider_limits().network_delay == 0.05


def test_client_limits_keep_each_process_within_its_share() -> None:
    # 100 requests and 30,000 tokens per second over 2 processes, calls of at most 440 tokens.
    limits = ClientLimits(requests=100, tokens=30_000, window=1.0, processes=2, max_cost=440)
    buckets = limits.settings()
    assert buckets["request_bucket"] == {"max_rate": 1, "time_period": pytest.approx(0.02)}
    assert buckets["token_bucket"]["max_rate"] == 440
    # The most a bucket passes in W + s: its capacity, and what drains meanwhile, is the share.
    rate = 440 / buckets["token_bucket"]["time_period"]
    assert 440 + rate * (1.0 + 0.02) == pytest.approx(15_000)
    assert buckets["tokens_pct_of_limit"] == pytest.approx(95.16, abs=0.01)
    # A request limit the processes cannot split evenly: each keeps the whole part of its share.
    uneven = ClientLimits(100, 30_000, 1.0, 3, 440).settings()
    assert uneven["request_bucket"]["time_period"] == pytest.approx(1 / 33)
    with pytest.raises(ValueError, match="must exceed the largest call"):
        ClientLimits(requests=100, tokens=800, window=1.0, processes=2, max_cost=440)
    with pytest.raises(ValueError, match="cannot each keep a share"):
        ClientLimits(requests=1, tokens=30_000, window=1.0, processes=2, max_cost=440)
    assert ClientLimits.from_json(limits.to_json()) == limits


async def test_client_limiter_never_sends_more_than_the_share_in_any_window() -> None:
    # Given one process's buckets for 20 requests and 2,000 tokens per 0.5 s, calls of 60-200 tokens
    window = 0.5
    limiter = ClientLimiter(ClientLimits(requests=20, tokens=2000, window=window, processes=1, max_cost=200))
    costs = [60 + (i * 37) % 141 for i in range(45)]
    sent: list[tuple[float, int]] = []

    async def call(cost: int) -> None:
        await limiter.acquire(cost)
        sent.append((time.monotonic(), cost))

    # When 45 calls want to go at once
    await asyncio.gather(*(call(c) for c in costs))
    # Then no window of 0.5 s (half-open, as the provider's) holds more than the limits
    for t, _ in sent:
        inside = [cost for u, cost in sent if t <= u < t + window - 1e-6]
        assert len(inside) <= 20
        assert sum(inside) <= 2000
    # and the first window is nearly full: the buckets hold back only what they must.
    first = sent[0][0]
    assert sum(cost for u, cost in sent if u < first + window) >= 0.8 * 2000


@pytest.mark.slow
async def test_aiolimiter_variant_runs_every_job_once(redis: Redis, redis_url: str, tmp_path: Path) -> None:
    # Given 60 calls, 2 worker processes of 8, and a provider allowing 60 requests per second
    # (30 per process: one call every 33 ms) and tokens to spare
    spec = GoodputSpec(
        jobs=60,
        processes=2,
        concurrency=8,
        requests=60,
        tokens=60_000,
        latency=0.02,
        latency_per_token=0.0,
        backoff_base=0.02,
        backoff_max=0.5,
        timeout=60.0,
    )
    result = await run_variant(redis, redis_url, spec, CLIENT_LIMITED, tmp_path)
    # Then every job ran exactly once, and none was refused: 60 calls fit the one window
    assert result["warnings"] == []
    assert (result["completed"], result["duplicates"], result["lost_or_failed"], result["dead"]) == (
        60,
        0,
        0,
        0,
    )
    assert result["calls"] == result["accepted_calls"] == 60 and result["rate_limited"] == 0
    # and the limiter spaced the calls: 30 per process, 33 ms apart, span about a second (unlimited
    # 16 slots would send them all within a tenth of one).
    assert result["accepted_span_s"] >= 0.8
    buckets = result["queue_limits"]["client_limiter"]
    assert buckets["processes"] == 2 and buckets["request_bucket"]["time_period"] == pytest.approx(1 / 30)
    # Dispatch is when the limiter let the call go, so arrival follows within the way there.
    assert result["dispatch_to_arrival"]["samples"] == 60
    assert result["dispatch_to_arrival"]["p50_ms"] < 100
