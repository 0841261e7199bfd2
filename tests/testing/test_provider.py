"""The simulated provider: its sliding window on a stepped clock, then the real HTTP server."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import httpx
import pytest

from sluice.testing.provider import COMPLETIONS_PATH, REQUEST_ID_HEADER, serve_provider
from sluice.testing.simulated_model import count_prompt_tokens
from sluice.testing.simulated_server import ARRIVALS_PATH, STATS_PATH, ProviderLimits
from sluice.testing.sliding_window import SlidingWindow


def body(max_tokens: int, content: str = "abcd" * 10) -> dict[str, Any]:
    """A request that counts ``count_prompt_tokens`` (10 for the default content) + max_tokens."""
    return {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


# ---- the window alone, time passed in ------------------------------------------------------


def test_prompt_tokens_are_a_quarter_of_the_characters_rounded_up() -> None:
    assert count_prompt_tokens([{"role": "user", "content": "abcd" * 10}]) == 10
    assert count_prompt_tokens([{"role": "system", "content": "abc"}, {"role": "user", "content": "de"}]) == 2
    assert count_prompt_tokens([{"role": "user", "content": ""}]) == 1


def test_request_limit_slides_and_says_when_a_slot_frees() -> None:
    w = SlidingWindow(requests=3, tokens=None, window=1.0)
    assert [w.admit(1, t).accepted for t in (0.0, 0.2, 0.4)] == [True, True, True]
    refused = w.admit(1, 0.5)
    assert not refused.accepted and refused.reason == "requests"
    assert refused.retry_after == pytest.approx(0.5)  # the entry of t=0 leaves at t=1
    # A sliding window, not fixed buckets: right after t=1 only one slot is free.
    assert w.admit(1, 1.0).accepted
    again = w.admit(1, 1.0)
    assert not again.accepted and again.retry_after == pytest.approx(0.2)


def test_token_limit_waits_for_enough_tokens_to_leave() -> None:
    w = SlidingWindow(requests=None, tokens=100, window=10.0)
    assert w.admit(30, 0.0).accepted
    assert w.admit(30, 1.0).accepted
    assert w.admit(30, 2.0).accepted
    # 90 in the window: 50 more needs the entries of t=0 and t=1 to leave (at t=11).
    refused = w.admit(50, 3.0)
    assert not refused.accepted and refused.reason == "tokens"
    assert refused.retry_after == pytest.approx(8.0)
    assert refused.remaining_tokens == 10
    assert w.admit(10, 3.0).accepted  # a smaller one still fits
    assert not w.admit(50, 10.999).accepted
    assert w.admit(50, 11.0).accepted
    with pytest.raises(ValueError, match="never fit"):
        w.admit(101, 20.0)


def test_counted_refusals_keep_the_request_window_full() -> None:
    w = SlidingWindow(requests=2, tokens=100, window=1.0, count_rejected=True)
    assert w.admit(10, 0.0).accepted and w.admit(10, 0.1).accepted
    assert not w.admit(10, 0.5).accepted  # logged: a place in the window, no tokens
    assert w.in_window == (3, 20)
    # At t=1.15 the first two have left, but the refusal of t=0.5 still holds a place.
    assert w.admit(10, 1.15).accepted
    refused = w.admit(10, 1.15)
    assert not refused.accepted and refused.retry_after == pytest.approx(0.35)
    # Without counting, a refusal leaves no trace.
    free = SlidingWindow(requests=1, tokens=None, window=1.0)
    assert free.admit(1, 0.0).accepted and not free.admit(1, 0.5).accepted
    assert free.admit(1, 1.0).accepted


def test_the_longer_wait_of_both_limits_is_the_answer() -> None:
    w = SlidingWindow(requests=2, tokens=100, window=1.0)
    assert w.admit(90, 0.0).accepted
    assert w.admit(5, 0.5).accepted
    refused = w.admit(50, 0.6)  # requests free at t=1.0, tokens too: both wait 0.4
    assert refused.retry_after == pytest.approx(0.4)
    refused = w.admit(99, 0.6)  # 99 tokens need both entries gone: t=1.5
    assert refused.reason == "tokens" and refused.retry_after == pytest.approx(0.9)


# ---- the HTTP server ---------------------------------------------------------------------------


async def post_all(client: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    return list(await asyncio.gather(*(client.post(COMPLETIONS_PATH, json=b) for b in bodies)))


async def test_under_the_limit_every_call_succeeds_with_openai_shaped_replies() -> None:
    with serve_provider(ProviderLimits(requests=20, tokens=10_000, window=1.0, latency=0.05)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            t0 = time.monotonic()
            replies = await post_all(client, [body(40) for _ in range(20)])
            elapsed = time.monotonic() - t0
            stats = (await client.get(STATS_PATH)).json()
    assert [r.status_code for r in replies] == [200] * 20
    assert elapsed >= 0.05  # the simulated latency
    first = replies[0].json()
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["message"]["role"] == "assistant"
    assert first["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 40,
        "total_tokens": 50,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len({r.json()["id"] for r in replies}) == 20
    assert int(replies[-1].headers["x-ratelimit-limit-requests"]) == 20
    assert stats["requests"] == stats["accepted"] == 20
    assert stats["rate_limited"] == 0
    assert stats["accepted_tokens"] == 20 * 50
    assert stats["prompt_tokens"] == 200 and stats["completion_tokens"] == 800
    assert stats["peak_window_requests"] == 20 and stats["peak_window_tokens"] == 1000
    assert stats["in_flight"] == 0 and 1 <= stats["max_in_flight"] <= 20
    assert stats["limits"]["requests"] == 20


async def test_beyond_the_request_limit_429_with_a_retry_after_that_is_right() -> None:
    with serve_provider(ProviderLimits(requests=5, window=1.0)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert [r.status_code for r in await post_all(client, [body(1) for _ in range(5)])] == [200] * 5
            refused = await client.post(COMPLETIONS_PATH, json=body(1))
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
            wait_ms = int(refused.headers["retry-after-ms"])
            assert 500 < wait_ms <= 1000
            assert refused.headers["retry-after"] == "1"
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            # Just before the window frees: still refused, now told the short rest.
            await asyncio.sleep((wait_ms - 150) / 1000)
            early = await client.post(COMPLETIONS_PATH, json=body(1))
            assert early.status_code == 429
            rest_ms = int(early.headers["retry-after-ms"])
            assert 50 < rest_ms <= 200
            # Sleeping what it says is enough.
            await asyncio.sleep(rest_ms / 1000)
            assert (await client.post(COMPLETIONS_PATH, json=body(1))).status_code == 200
            stats = (await client.get(STATS_PATH)).json()
    assert stats["requests"] == 8 and stats["accepted"] == 6
    assert stats["rate_limited"] == stats["rate_limited_requests"] == 2
    assert stats["rate_limited_tokens"] == 0
    assert stats["peak_window_requests"] == 5


async def test_token_limit_separately_counts_prompt_plus_max_tokens() -> None:
    with serve_provider(ProviderLimits(tokens=200, window=1.0)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            # 10 prompt + 90 max_tokens = 100 each: two fit, the third does not.
            replies = [await client.post(COMPLETIONS_PATH, json=body(90)) for _ in range(3)]
            assert [r.status_code for r in replies] == [200, 200, 429]
            assert replies[2].json()["error"]["type"] == "tokens"
            assert "x-ratelimit-limit-requests" not in replies[2].headers
            assert replies[2].headers["x-ratelimit-remaining-tokens"] == "0"
            # Sleeping what it says lets the first entry leave, and the same request in.
            await asyncio.sleep(int(replies[2].headers["retry-after-ms"]) / 1000)
            assert (await client.post(COMPLETIONS_PATH, json=body(90))).status_code == 200
            too_large = await client.post(COMPLETIONS_PATH, json=body(191))
            assert too_large.status_code == 400
            assert too_large.json()["error"]["code"] == "request_too_large"
            stats = (await client.get(STATS_PATH)).json()
    assert stats["accepted"] == 3 and stats["accepted_tokens"] == 300
    assert stats["rate_limited"] == stats["rate_limited_tokens"] == 1
    assert stats["bad_requests"] == 1
    assert stats["peak_window_tokens"] == 200


async def test_malformed_requests_get_400_and_cost_nothing() -> None:
    with serve_provider(ProviderLimits(requests=1, window=60.0)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            for bad in ({"model": "sim", "messages": []}, {**body(1), "max_tokens": 0}, [1, 2]):
                reply = await client.post(COMPLETIONS_PATH, json=bad)
                assert reply.status_code == 400, bad
                assert reply.json()["error"]["type"] == "invalid_request_error"
            assert (await client.post(COMPLETIONS_PATH, content=b"{not json")).status_code == 400
            assert (await client.post(COMPLETIONS_PATH, json=body(1))).status_code == 200
            stats = (await client.get(STATS_PATH)).json()
    assert stats["bad_requests"] == 4 and stats["accepted"] == 1 and stats["rate_limited"] == 0


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="requests"):
        ProviderLimits(requests=0)
    with pytest.raises(ValueError, match="window"):
        ProviderLimits(window=0)
    assert ProviderLimits(latency=0.1, latency_per_token=0.001).duration(100) == pytest.approx(0.2)
    for bad in (-0.001, 10.5, math.nan, math.inf, True, "0.1"):
        with pytest.raises(ValueError, match=r"network_delay must be a number of seconds from 0 to 10"):
            ProviderLimits(network_delay=bad)  # type: ignore[arg-type]
    assert ProviderLimits(network_delay=10).network_delay == 10


# ---- the network's delay -----------------------------------------------------------------------

DELAY_S = 0.08


async def test_network_delay_holds_each_request_and_each_answer_each_way() -> None:
    limits = ProviderLimits(requests=1, window=60.0, network_delay=DELAY_S)
    with serve_provider(limits) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            # Given a connection already open (its set-up is not the network's delay)
            assert (await client.get(STATS_PATH)).status_code == 200
            # When one call is sent, then a second that the request limit refuses
            sent = time.time()
            accepted = await client.post(COMPLETIONS_PATH, json=body(1), headers={REQUEST_ID_HEADER: "one"})
            back = time.time()
            refused_sent = time.monotonic()
            refused = await client.post(COMPLETIONS_PATH, json=body(1))
            refused_took = time.monotonic() - refused_sent
            arrived = (await client.get(ARRIVALS_PATH)).json()["one"]
    assert accepted.status_code == 200 and refused.status_code == 429
    # Then the provider saw the call one delay after it left, and the answer took another delay back
    assert DELAY_S <= arrived - sent < DELAY_S + 0.5
    assert DELAY_S <= back - arrived < DELAY_S + 0.5
    # and a refusal, answered at once by the provider, still takes the way there and back.
    assert 2 * DELAY_S <= refused_took < 2 * DELAY_S + 0.5


async def test_without_network_delay_a_call_is_not_held() -> None:
    with serve_provider(ProviderLimits(requests=10, window=60.0)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get(STATS_PATH)).status_code == 200
            sent = time.monotonic()
            assert (await client.post(COMPLETIONS_PATH, json=body(1))).status_code == 200
            # The two delays of the test above would take 0.16 s; loopback takes a few ms.
            assert time.monotonic() - sent < 2 * DELAY_S
