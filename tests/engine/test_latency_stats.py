"""Latency percentiles (engine/sketch.py): DDSketch's bins, flushed by workers, merged on read.

The accuracy statement tested here: each reported percentile is within 1 %
(relative) of the exact value at rank ``floor(q * (n - 1))`` of the samples
(numpy's ``method="lower"``; DDSketch's own rank rule), however the samples
were split between workers.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import orjson
import pytest
from ddsketch import DDSketch
from ddsketch.mapping import LogarithmicMapping
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice import Queue
from sluice.engine.clock import queue_now_ms
from sluice.engine.sketch import (
    FLUSH_PAIRS,
    KEEP_1M_MS,
    KEEP_10S_MS,
    MIN_MS,
    RELATIVE_ACCURACY,
    ZERO,
    LatencyRecorder,
    bin_of,
    key_of,
    quantiles,
    value_of,
)
from tests.cli.test_cli import invoke
from tests.conftest import eventually
from tests.harness.proc_harness import WorkerProcs
from tests.harness.service_harness import running_service

QS = (0.5, 0.9, 0.95, 0.99, 0.999)


def _lognormal(rng: random.Random, n: int) -> list[float]:
    return [rng.lognormvariate(math.log(50), 1.0) for _ in range(n)]


def _bimodal(rng: random.Random, n: int) -> list[float]:
    return [rng.gauss(5, 0.5) if rng.random() < 0.8 else rng.gauss(2000, 200) for _ in range(n)]


def _pareto(rng: random.Random, n: int) -> list[float]:
    return [10 * rng.paretovariate(1.2) for _ in range(n)]


def exact(samples: list[float], q: float) -> float:
    return sorted(samples)[math.floor(q * (len(samples) - 1))]


def test_bins_are_ddsketch_keys() -> None:
    mapping = LogarithmicMapping(RELATIVE_ACCURACY)
    rng = random.Random(7)
    values = [rng.lognormvariate(3, 3) for _ in range(100_000)] + [float(i) for i in range(1, 20_000)]
    for v in values:
        assert key_of(v) == mapping.key(v), v
        # Below a microsecond a duration counts as 0 (the clock's resolution is 1 ms).
        assert bin_of(v) == (str(mapping.key(v)) if v >= MIN_MS else ZERO)
    for key in range(-50, 2000, 7):
        assert value_of(key) == pytest.approx(mapping.value(key), rel=1e-12)
    assert bin_of(0) == ZERO


@pytest.mark.parametrize("dist", [_lognormal, _bimodal, _pareto])
def test_percentiles_within_one_percent_of_exact(dist: object) -> None:
    rng = random.Random(11)
    samples = [max(v, 0.01) for v in dist(rng, 60_000)]  # type: ignore[operator]
    # Split over 12 "workers", each binning its share; merging is adding the counts.
    parts = [Counter(bin_of(v) for v in samples[i::12]) for i in range(12)]
    merged: Counter[str] = Counter()
    for part in parts:
        merged.update(part)
    reference = DDSketch(RELATIVE_ACCURACY)
    for v in samples:
        reference.add(v)
    got = quantiles(merged, QS)
    worst = 0.0
    for q, value in zip(QS, got, strict=True):
        assert value is not None
        truth = exact(samples, q)
        error = abs(value - truth) / truth
        worst = max(worst, error)
        assert error <= RELATIVE_ACCURACY, (q, value, truth)
        assert value == pytest.approx(reference.get_quantile_value(q), rel=1e-6)
    print(f"{dist.__name__}: worst relative error {worst:.4%}")  # type: ignore[attr-defined]


async def test_windows_drop_old_buckets(queue: Queue, redis: Redis) -> None:
    recorder = LatencyRecorder(queue.core)
    now = await queue_now_ms(queue)
    recorder.add("processing", 100, now - 10 * 60_000)  # ten minutes ago
    recorder.add("processing", 300, now - 20_000)
    recorder.add("queue_wait", 0, now - 20_000)
    assert recorder.pending == 3
    await recorder.flush()
    assert recorder.pending == 0
    minute = (await queue.latency(60, now=now)).metrics
    assert minute["processing"].count == 1
    assert minute["processing"].p50 == pytest.approx(300, rel=RELATIVE_ACCURACY)
    assert minute["queue_wait"].count == 1 and minute["queue_wait"].p50 == 0
    assert minute["end_to_end"].count == 0 and minute["end_to_end"].p50 is None
    assert (await queue.latency(300, now=now)).metrics["processing"].count == 1
    hour = (await queue.latency(3600, now=now)).metrics["processing"]
    assert hour.count == 2
    assert hour.p50 == pytest.approx(100, rel=RELATIVE_ACCURACY)
    assert hour.max is not None and 300 <= hour.max <= 300 * (1 + 2 * RELATIVE_ACCURACY)
    # Buckets expire by themselves; the cumulative hashes (the Prometheus histograms) do not,
    # and hold every sample.
    keys = [k.decode() async for k in redis.scan_iter(match=queue.keys.latency_prefix + "*")]
    assert keys
    totals = {queue.keys.latency_total(m, "0") for m in ("p", "w")} | {queue.keys.latency_priorities}
    assert totals <= set(keys)
    for key in keys:
        ttl = await redis.pttl(key)
        if key in totals:
            assert ttl == -1
        else:
            assert 0 < ttl <= (KEEP_10S_MS if ":10s:" in key else KEEP_1M_MS)
    cumulative = await queue.latency_totals()
    assert (
        sum(cumulative["processing"]["0"].values()) == 2 and sum(cumulative["queue_wait"]["0"].values()) == 1
    )
    assert cumulative["end_to_end"] == {}


async def test_cumulative_bins_are_kept_per_priority_for_32_priorities_then_shared(
    queue: Queue, redis: Redis
) -> None:
    """Each priority has its own cumulative bins (the per-priority histograms), up to 32;
    the priorities seen after those share 'other', so an exporter reads a bounded number."""
    recorder = LatencyRecorder(queue.core)
    now = await queue_now_ms(queue)
    for p in range(40):
        for _ in range(p % 3 + 1):
            recorder.add("processing", 10.0 * (p + 1), now, priority=p - 20)
    assert await recorder.flush() == 33  # one call per priority label: 32, then 'other'
    assert await redis.scard(queue.keys.latency_priorities) == 32
    # another process that sees other priorities first: Redis's set is full, they go to 'other'
    late = LatencyRecorder(queue.core)
    late.add("processing", 5.0, now, priority=99)
    await late.flush()
    assert await redis.scard(queue.keys.latency_priorities) == 32
    totals = (await queue.latency_totals())["processing"]
    assert len(totals) == 33 and "other" in totals
    assert sum(sum(b.values()) for b in totals.values()) == sum(p % 3 + 1 for p in range(40)) + 1
    own = [label for label in totals if label != "other"]
    assert own == sorted(own, key=int)  # in numeric order
    # the window still has every sample, whatever the priority
    assert (await queue.latency(60, now=now)).metrics["processing"].count == sum(
        p % 3 + 1 for p in range(40)
    ) + 1


async def test_a_flush_is_split_into_bounded_calls(queue: Queue, redis: Redis) -> None:
    recorder = LatencyRecorder(queue.core)
    now = await queue_now_ms(queue)
    distinct = 2 * FLUSH_PAIRS + 100
    for key in range(distinct):
        recorder.add("processing", value_of(key), now)
        recorder.add("processing", value_of(key), now)
    assert await recorder.flush() == 3
    window = await queue.latency(60, now=now)
    assert window.metrics["processing"].count == 2 * distinct
    ten = queue.keys.latency("p", "10s", now // 10_000)
    assert await redis.hlen(ten) == distinct
    # The script itself refuses a call past its bound.
    args: list[str | int] = [1000, 1000, 0]
    for key in range(FLUSH_PAIRS + 1):
        args += [str(key), 1]
    with pytest.raises(ResponseError, match="at most 256"):
        await queue.scripts.latency(keys=[ten, queue.keys.latency("p", "1m", now // 60_000)], args=args)


async def test_two_worker_processes_share_the_bins(
    queue: Queue, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    holds = [0.05] * 10 + [0.2] * 20
    hold_for = {0.05: {"w1": 0.05, "w2": 0.05}, 0.2: {"w1": 0.2, "w2": 0.2}}
    with WorkerProcs(redis_url, prefix, tmp_path) as procs:
        for wid in ("w1", "w2"):
            procs.start(wid, grace=5.0)
        for wid in ("w1", "w2"):
            await procs.procs[["w1", "w2"].index(wid)].wait_log("serving queue q")
        for hold in holds:  # the short jobs first in line (priority 1), the long ones after (5)
            await queue.add("task", {"hold": hold_for[hold]}, priority=1 if hold < 0.1 else 5)

        async def all_counted() -> bool:
            window = await queue.latency(60)
            return all(window.metrics[m].count == len(holds) for m in window.metrics)

        await eventually(all_counted, timeout=30)
        runs = {(await queue.get_job(str(i))).worker for i in range(1, 31)}  # type: ignore[union-attr]
        assert runs == {"w1", "w2"}
        window = await queue.latency(60)
        totals = await queue.latency_totals()
    # The cumulative bins (the Prometheus histograms) know each job's priority, from its lease.
    for metric in ("queue_wait", "processing", "end_to_end"):
        assert {p: sum(b.values()) for p, b in totals[metric].items()} == {"1": 10, "5": 20}, metric
    assert max(int(k) for k in totals["processing"]["1"] if k != "z") < min(
        int(k) for k in totals["processing"]["5"] if k != "z"
    )  # the 50 ms jobs were priority 1, the 200 ms ones 5
    processing = window.metrics["processing"]
    # rank floor(0.5 * 29) = 14: the 15th shortest, a 200 ms job. Processing is the sleep plus
    # the handler's own Redis call and the outcome's trip to Redis: scheduling noise on top.
    assert processing.p50 is not None and 200 * 0.99 <= processing.p50 <= 200 * 1.01 + 20
    assert processing.p99 is not None and 200 * 0.99 <= processing.p99 <= 200 * 1.01 + 60
    assert processing.max is not None and processing.max >= processing.p99
    end = window.metrics["end_to_end"]
    assert end.p50 is not None and end.p50 >= processing.p50 * (1 - 2 * RELATIVE_ACCURACY)
    assert window.accuracy == RELATIVE_ACCURACY


async def test_cli_and_api_answer_the_same(redis_url: str, sluice_database_url: str, prefix: str) -> None:
    async with running_service(redis_url, sluice_database_url, prefix) as api:
        q = api.svc.queue
        recorder = LatencyRecorder(q.core)
        now = await queue_now_ms(q)
        rng = random.Random(3)
        for _ in range(500):
            at = now - rng.randrange(1_000, 30_000)
            recorder.add("processing", rng.lognormvariate(4, 1), at)
            recorder.add("queue_wait", rng.expovariate(1 / 20), at)
            recorder.add("end_to_end", rng.lognormvariate(5, 1), at)
        recorder.add("processing", 5_000, now - 30 * 60_000)  # only in the hour
        await recorder.flush()
        response = await api.client.get("/v1/stats")
        assert response.status_code == 200, response.text
        body = response.json()
        out = await invoke("stats", "--json", "--queue", q.name, "--prefix", prefix, "--redis", redis_url)
        cli = orjson.loads(out.stdout)
        text = await invoke("stats", "--queue", q.name, "--prefix", prefix, "--redis", redis_url)
    assert "processing" in text.stdout and "1h p99" in text.stdout
    for doc in (body, cli):
        doc.pop("now_ms")
    assert body == cli
    assert body["accuracy"] == RELATIVE_ACCURACY
    assert body["windows"]["1m"]["metrics"]["processing"]["count"] == 500
    assert body["windows"]["1h"]["metrics"]["processing"]["count"] == 501
    assert set(body["windows"]) == {"1m", "5m", "1h"}


async def test_cli_says_when_nothing_finished(redis_url: str, prefix: str) -> None:
    out = await invoke("stats", "--queue", "idle", "--prefix", prefix, "--redis", redis_url)
    assert "no attempt" in out.stderr
