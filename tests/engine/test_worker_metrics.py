"""Worker metrics: ``sluice worker --metrics-port`` in real processes (one, and a supervisor
adding up two), refusals by gate counted in the dispatch script, and the latency histograms
the API builds from the workers' cumulative bins."""

from __future__ import annotations

import asyncio
import glob
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from sluice import AttemptEnd, Backoff, JobContext, JobState, Queue, Worker
from sluice.engine.clock import queue_now_ms
from sluice.engine.sketch import GAMMA, HISTOGRAM_EDGES, LatencyRecorder, histogram
from sluice.local.embedded import free_port
from sluice.testing.provider import serve_provider
from sluice.testing.simulated_server import ProviderLimits
from tests.conftest import eventually, running
from tests.harness.proc_harness import REPO, WorkerProcs, open_gate
from tests.harness.service_harness import Running, running_service
from tests.harness.stepping import step

PROMETHEUS = "text/plain;version=0.0.4"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(found: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and want <= ls)


async def scrape(port: int) -> Samples:
    async with httpx.AsyncClient() as client:
        resp = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert resp.status_code == 200
    return samples(resp.text)


async def scraped(port: int, check: Any, timeout: float = 20.0) -> Samples:
    """Scrape until ``check(samples)`` holds (the server may not be up yet)."""

    async def once() -> Samples | None:
        try:
            found = await scrape(port)
        except httpx.HTTPError:
            return None
        return found if check(found) else None

    result: Samples = await eventually(once, timeout=timeout, interval=0.1)
    return result


@pytest.fixture
async def api(redis_url: str, sluice_database_url: str, prefix: str) -> AsyncIterator[Running]:
    async with running_service(redis_url, sluice_database_url, prefix) as svc:
        yield svc


async def _api_samples(api: Running) -> Samples:
    resp = await api.client.get("/metrics", headers={"accept": PROMETHEUS})
    assert resp.status_code == 200, resp.text
    return samples(resp.text)


# ---- two worker processes behind one port ----------------------------------------------------------


@pytest.mark.timeout(120)
async def test_a_supervisor_serves_its_children_added_up_and_drops_a_killed_ones_live_gauges(
    redis_url: str, prefix: str, tmp_path: Path, redis: Any
) -> None:
    port = free_port()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    q = Queue("q", redis=redis, prefix=prefix)
    gate = tmp_path / "gate"
    with WorkerProcs(redis_url, prefix, tmp_path) as procs:
        sup = procs.launch(
            "w",
            "tests.harness.proc_workers:worker",
            "--processes",
            "2",
            "--concurrency",
            "2",
            "--metrics-port",
            str(port),
            env={"TMPDIR": str(scratch)},
        )
        found = await scraped(port, lambda s: total(s, "sluice_worker_processes") == 2)
        (metrics_dir,) = glob.glob(str(scratch / "sluice-worker-metrics-*"))
        # Four jobs held at a gate fill both processes' two slots: both must count.
        held = [await q.add("task", {"gate": str(gate)}) for _ in range(4)]
        found = await scraped(port, lambda s: total(s, "sluice_worker_busy_slots") == 4)
        await open_gate(gate)
        await eventually(lambda: _completed(q, 4), timeout=20)
        found = await scraped(
            port,
            lambda s: total(s, "sluice_worker_handler_duration_seconds_count", outcome="completed") == 4,
        )
        assert total(found, "sluice_worker_busy_slots") == 0
        assert total(found, "sluice_worker_handler_duration_seconds_count", job_type="task") == 4
        writers = {Path(p).stem.split("_")[-1] for p in glob.glob(os.path.join(metrics_dir, "histogram_*"))}
        assert len(writers) == 2  # each child timed its two jobs; the port showed their sum

        # Two more held jobs; the process that runs one is killed: its busy slots and its
        # "alive" leave the sums, its finished jobs stay counted.
        gate2 = tmp_path / "gate2"
        more = [await q.add("task", {"gate": str(gate2)}) for _ in range(2)]
        await scraped(port, lambda s: total(s, "sluice_worker_busy_slots") == 2)
        records = [await q.get_job(job.id) for job in more]
        runners = [r.worker if r is not None else None for r in records]
        assert set(runners) <= {"w-1", "w-2"}, runners
        victim_id = runners[0]
        assert victim_id is not None
        others = sum(1 for w in runners if w != victim_id)
        (victim,) = [c for c in sup.children() if victim_id in c.cmdline()]
        victim.send_signal(signal.SIGKILL)
        found = await scraped(port, lambda s: total(s, "sluice_worker_processes") == 1)
        assert total(found, "sluice_worker_busy_slots") == others
        assert total(found, "sluice_worker_handler_duration_seconds_count", outcome="completed") == 4
        assert not glob.glob(os.path.join(metrics_dir, f"gauge_live*_{victim.pid}.db"))
        await open_gate(gate2)
        sup.send(signal.SIGTERM)
        await sup.wait_exit(timeout=30)
        assert held  # (the jobs were added)
    assert glob.glob(str(scratch / "sluice-worker-metrics-*")) == []  # removed at exit


async def _completed(q: Queue, n: int) -> bool:
    return (await q.counts())["completed"] >= n


# ---- refusals by gate ------------------------------------------------------------------------------


async def test_each_gate_that_refuses_is_counted_once_per_dispatch_call(api: Running) -> None:
    queue = api.svc.queue
    now = await queue_now_ms(queue)
    assert await queue.refusals() == dict.fromkeys(
        ("paused", "throttled", "concurrency", "rate", "token_rate", "budget"), 0
    )
    for _ in range(3):
        await queue.add("generic", {})
    await queue.pause()
    await step(queue, now, want=10)
    await step(queue, now, want=0)  # asked for nothing: refused nothing
    await queue.resume()
    await queue.set_global_concurrency(1)
    assert len((await step(queue, now, want=10)).jobs) > 0  # one taken, two refused: counted once
    await queue.set_global_concurrency(None)
    await queue.set_rate_limit(1, per=60)
    await step(queue, now, want=10)  # one more taken, the last refused
    await queue.set_rate_limit(None)
    await queue.set_token_rate_limit(100, per=60)
    await queue.add("generic", {}, tokens=80)
    await queue.add("generic", {}, tokens=80)
    await step(queue, now, want=10)  # the waiting job and the first 80 run; the second does not fit
    await queue.set_token_rate_limit(None)
    await queue.budgets.create("small", 10)
    for _ in range(5):
        await queue.add("generic", {}, tokens=50, budget="small")
    await step(queue, now, want=10)  # the budget rejects five jobs in one call: one refusal
    await queue.throttle(60)
    await step(queue, now, want=10)  # nothing waits: a closed gate refuses nobody
    await queue.add("generic", {})
    await step(queue, now, want=10)
    await queue.throttle(0)

    expected = {"paused": 1, "throttled": 1, "concurrency": 1, "rate": 1, "token_rate": 1, "budget": 1}
    assert await queue.refusals() == expected
    assert (await queue.counts())["rejected"] == 5
    found = await _api_samples(api)
    for gate, n in expected.items():
        assert found[("sluice_queue_refusals_total", frozenset({("queue", queue.name), ("gate", gate)}))] == n


# ---- latency histograms ----------------------------------------------------------------------------


async def test_the_histograms_hold_the_sketchs_counts_within_the_bucket_edge_error(api: Running) -> None:
    queue = api.svc.queue
    recorder = LatencyRecorder(queue.core)
    now = await queue_now_ms(queue)
    # Durations on and around the edges (ms, as the workers measure them), and far apart.
    durations = [0.0, 1.0, 2.0, 5.0, 9.9, 10.0, 10.1, 24.6, 25.0, 99.0, 100.0, 250.0, 999.0, 1000.0]
    durations += [1500.0, 30_000.0, 3_600_000.0, 7_200_000.0] + [37.0 * i for i in range(1, 200)]
    for d in durations:
        recorder.add("processing", d, now, priority=5)
    recorder.add("queue_wait", 3.0, now, priority=5)
    recorder.add("queue_wait", 4.0, now, priority=-2)  # another priority: a series of its own
    await recorder.flush()

    window = (await queue.latency(60, now=now)).metrics
    found = await _api_samples(api)
    q = queue.name

    def series(name: str, **labels: str) -> float:
        return found[
            (name, frozenset({("queue", q), ("priority", labels.pop("priority", "5")), *labels.items()}))
        ]

    # The histogram counts what the sketch counts, per priority
    assert series("sluice_job_processing_seconds_count") == window["processing"].count == len(durations)
    assert series("sluice_job_queue_wait_seconds_count") == 1
    assert series("sluice_job_queue_wait_seconds_count", priority="-2") == 1
    assert window["queue_wait"].count == 2
    assert not any(name.startswith("sluice_job_end_to_end_seconds") for name, _ in found)
    # Each bucket is within the edge error of the exact count: nothing above the edge, and
    # everything at or below edge / GAMMA (2 % under it).
    previous = 0.0
    for edge in HISTOGRAM_EDGES:
        got = series("sluice_job_processing_seconds_bucket", le=_le(edge))
        exact_ms = edge * 1000
        assert sum(d <= exact_ms / GAMMA for d in durations) <= got <= sum(d <= exact_ms for d in durations)
        assert got >= previous
        previous = got
    assert series("sluice_job_processing_seconds_bucket", le="+Inf") == len(durations)
    exact_sum = sum(durations) / 1000
    assert series("sluice_job_processing_seconds_sum") == pytest.approx(exact_sum, rel=0.01)
    # The exposition is the engine's own fold of the cumulative bins
    folded = histogram((await queue.latency_totals())["processing"]["5"])
    assert [c for _, c in folded.buckets] == [
        series("sluice_job_processing_seconds_bucket", le=_le(e)) for e in [*HISTOGRAM_EDGES, math.inf]
    ]


def _le(edge: float) -> str:
    return "+Inf" if math.isinf(edge) else repr(float(edge))


# ---- provider calls, tokens, cost and cache lookups from a real worker -----------------------------

KEY = "sk-sim-metrics"


@pytest.mark.timeout(180)
async def test_llm_inference_jobs_move_the_provider_and_cache_series_and_grafana_names_only_these(
    api: Running, redis_url: str, sluice_database_url: str, prefix: str, tmp_path: Path
) -> None:
    port = free_port()
    # A server of our own has no list price: the pricing file gives it one, so answers cost.
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"openai-compatible/gpt-4o-mini": {"input": 1.5, "output": 6}}))
    with serve_provider(ProviderLimits(), api_key=KEY) as provider_url:
        env = {
            "SLUICE_REDIS_URL": redis_url,
            "SLUICE_DATABASE_URL": sluice_database_url,
            "SLUICE_PREFIX": prefix,
            "SLUICE_LLM_PROVIDER": "openai-compatible",
            "SLUICE_LLM_BASE_URL": f"{provider_url}/v1",
            "SLUICE_LLM_API_KEY": KEY,
            "SLUICE_LLM_MODEL": "gpt-4o-mini",
            "SLUICE_CACHE_EMBEDDER": "local",
            "SLUICE_PRICING_FILE": str(prices),
        }
        with WorkerProcs(redis_url, prefix, tmp_path) as procs:
            procs.launch(
                "llm",
                "sluice.service.handlers:worker",
                "--queue",
                api.svc.queue.name,
                "--prefix",
                prefix,
                "--metrics-port",
                str(port),
                env=env,
            )
            await scraped(port, lambda s: total(s, "sluice_worker_processes") == 1, timeout=60)
            first = await _run(api, {"prompt": "What is the capital of France?"})
            again = await _run(api, {"prompt": "What is the capital of France?"})
            async with httpx.AsyncClient() as client:
                faults = [{"status": 429, "retry_after_ms": 200}]
                await client.post(provider_url + "/_control/faults", json=faults)
            bypass = await _run(api, {"prompt": "Name three prime numbers.", "cache": False})
            async with httpx.AsyncClient() as client:
                await client.post(provider_url + "/_control/faults", json=faults)
            missed = await _run(api, {"prompt": "Name a colour of the rainbow."})  # a miss, twice
            found = await scraped(port, lambda s: total(s, "sluice_provider_calls_total") == 5)
            async with httpx.AsyncClient() as client:
                worker_text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            # Gauges of limits and budgets exist only where some are set.
            await api.svc.queue.set_rate_limit(1000)
            await api.svc.queue.set_token_rate_limit(10**9)
            await api.svc.queue.set_global_concurrency(100)
            made = await api.client.post("/v1/budgets", json={"name": "team", "limit": 1000})
            assert made.status_code == 201, made.text

            async def exposed_with_latency() -> str | None:
                # The latency histograms come from the bins the worker flushes about once a
                # second: wait for the flush of the last jobs' rather than race it.
                text = (await api.client.get("/metrics", headers={"accept": PROMETHEUS})).text
                return text if "sluice_job_end_to_end_seconds_bucket" in text else None

            api_text = await eventually(exposed_with_latency, timeout=10, interval=0.2)
    assert first["cacheHit"] is False and again["cacheHit"] is True
    assert bypass["cacheHit"] is False and missed["cacheHit"] is False
    assert total(found, "sluice_provider_calls_total", outcome="ok") == 3
    assert total(found, "sluice_provider_calls_total", outcome="throttled") == 2
    assert total(found, "sluice_cache_lookups_total", result="miss") == 3  # first; missed: 429, answer
    assert total(found, "sluice_cache_lookups_total", result="exact_hit") == 1
    assert total(found, "sluice_cache_lookups_total", result="bypass") == 2  # the 429, then the answer
    assert total(found, "sluice_cache_lookups_total", result="semantic_hit") == 0
    paid = [first, bypass, missed]
    completion = sum(r["usage"]["completion_tokens"] for r in paid)
    prompt = sum(r["usage"]["prompt_tokens"] - r["usage"]["cached_tokens"] for r in paid)
    assert total(found, "sluice_provider_tokens_total", kind="completion") == completion > 0
    assert total(found, "sluice_provider_tokens_total", kind="prompt") == prompt > 0
    cost = sum(r["cost"] for r in paid)
    assert cost == pytest.approx((prompt * 1.5 + completion * 6) / 1e6)
    assert total(found, "sluice_provider_cost_usd_total", model="gpt-4o-mini") == pytest.approx(cost)
    handled = "sluice_worker_handler_duration_seconds_count"
    assert total(found, handled, job_type="llm-inference") == 6
    assert total(found, handled, job_type="llm-inference", outcome="throttled") == 2

    # Every series the Grafana dashboard names is in one of the two expositions.
    exposed = {name for text in (api_text, worker_text) for name, _ in samples(text)}
    dashboard = json.loads((Path(__file__).parents[2] / "deploy/grafana/sluice.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    named = {n for e in exprs if isinstance(e, str) for n in re.findall(r"\bsluice_[a-z_]+", e)}
    assert named - exposed == set()
    for wanted in (
        "sluice_queue_refusals_total",
        "sluice_provider_calls_total",
        "sluice_provider_tokens_total",
        "sluice_provider_cost_usd_total",
        "sluice_cache_lookups_total",
        "sluice_job_end_to_end_seconds_bucket",
        "sluice_budget_used_tokens",
        "sluice_api_request_duration_seconds_bucket",
    ):
        assert wanted in named, wanted


async def _run(api: Running, payload: dict[str, Any]) -> dict[str, Any]:
    resp = await api.client.post("/v1/jobs", json={"type": "llm-inference", "payload": payload})
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]

    async def done() -> Any:
        await api.drain_events()
        row = await api.svc.store.get(uuid.UUID(job_id))
        return row if row is not None and row.status in ("COMPLETED", "DEAD_LETTER") else None

    row = await eventually(done, timeout=60)
    assert row.status == "COMPLETED", row.error
    result: dict[str, Any] = row.result
    return result


# ---- a port that is taken --------------------------------------------------------------------------


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_taken_metrics_port_is_one_line_that_says_what_to_do(
    redis_url: str, prefix: str, tmp_path: Path, processes: str
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {
        **os.environ,
        "SLUICE_TEST_REDIS": redis_url,
        "SLUICE_TEST_PREFIX": prefix,
        "TMPDIR": str(scratch),
    }
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))  # noqa: S104 - where the worker would listen
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "sluice", "worker", "tests.harness.proc_workers:worker"]
        argv += ["--redis", redis_url, "--processes", processes, "--metrics-port", str(port)]
        done = subprocess.run(
            argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False
        )
    assert done.returncode == 1, done.stderr
    assert f"cannot serve metrics on port {port}" in done.stderr and "--metrics-port" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(scratch.iterdir()) == []  # the supervisor's folder is removed


# ---- the metrics hook in this process -------------------------------------------------------------


def _series() -> ModuleType:
    """The worker series (imported on first use, as worker_metrics does: the mode is chosen)."""
    from sluice.service import worker_series

    return worker_series


def _count(job_type: str, outcome: str) -> float:
    labels = {"job_type": job_type, "outcome": outcome}
    found = _series().REGISTRY.get_sample_value("sluice_worker_handler_duration_seconds_count", labels)
    return found or 0.0


def _busy() -> float:
    return _series().REGISTRY.get_sample_value("sluice_worker_busy_slots") or 0.0


class _Counts:
    """The handler histogram's counts of some (job type, outcome) pairs, from a start."""

    def __init__(self, *pairs: tuple[str, str]) -> None:
        self.start = {pair: _count(*pair) for pair in pairs}

    def added(self) -> dict[tuple[str, str], float]:
        return {pair: _count(*pair) - n for pair, n in self.start.items()}


async def test_a_timeout_and_a_last_failure_are_labelled_as_such(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    """A timed-out attempt is ``timed_out`` (the runner reports it as a failure), a failure
    with no attempt left ``dead``, an earlier one ``failed``: what the outcome was, as the
    trace's attempt span says it too."""
    from sluice.service.worker_metrics import WorkerMetrics

    w = Worker("q", prefix=prefix, lease=5, hard_grace=5, hooks=[WorkerMetrics()])

    @w.handler
    async def sleepy(job: JobContext) -> None:
        await asyncio.sleep(2)

    @w.handler
    async def boom(job: JobContext) -> None:
        raise RuntimeError("no")

    counts = _Counts(("sleepy", "timed_out"), ("boom", "failed"), ("boom", "dead"))
    async with running(w, redis):
        slow = await queue.add("sleepy", timeout=0.2, max_attempts=1)
        failing = await queue.add("boom", max_attempts=2, backoff=Backoff.fixed(0.05))
        for job in (slow, failing):
            await eventually(lambda job=job: _in_state(queue, job.id, JobState.DEAD), timeout=10)
    assert counts.added() == {("sleepy", "timed_out"): 1, ("boom", "failed"): 1, ("boom", "dead"): 1}


async def test_busy_slots_count_running_handlers_and_a_name_without_one_is_unregistered(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    from sluice.service.worker_metrics import WorkerMetrics

    w = Worker("q", prefix=prefix, concurrency=4, hooks=[WorkerMetrics()])
    gate = asyncio.Event()

    @w.handler
    async def held(job: JobContext) -> None:
        await gate.wait()

    @w.handler
    def held_in_a_thread(job: JobContext) -> None:
        while not gate.is_set() and not job.stop_requested:
            time.sleep(0.01)

    name = f"made-up-{uuid.uuid4().hex}"  # a producer's string: never a label
    counts = _Counts(("held", "completed"), ("held_in_a_thread", "completed"), ("unregistered", "dead"))
    idle = _busy()
    async with running(w, redis):
        jobs = [await queue.add("held"), await queue.add("held"), await queue.add("held_in_a_thread")]
        await eventually(lambda: _now(_busy() - idle == 3))
        unknown = await queue.add(name, max_attempts=1)
        await eventually(lambda: _in_state(queue, unknown.id, JobState.DEAD))
        assert _busy() - idle == 3  # the unregistered job came and went
        gate.set()
        for job in jobs:
            await job.result(timeout=10)
    assert _busy() == idle
    assert counts.added() == {
        ("held", "completed"): 2,
        ("held_in_a_thread", "completed"): 1,
        ("unregistered", "dead"): 1,
    }
    assert not any(name in str(labels) for labels in _label_sets())


async def test_an_attempt_stopped_before_its_handler_ran_leaves_no_slot_busy(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    """Two jobs leased in one call; the first handler to run stops the worker at once, which
    cancels the other's task before it ran. The one that ran counts as released; the other
    took no slot, so none is left busy (the engine told its hooks nothing of it)."""
    from sluice.service.worker_metrics import WorkerMetrics

    w = Worker("q", prefix=prefix, concurrency=2, hooks=[WorkerMetrics()])
    ran: list[str] = []

    @w.handler
    async def stopper(job: JobContext) -> None:
        ran.append(job.id)
        w.stop(immediately=True)
        await asyncio.sleep(10)

    jobs = [await queue.add("stopper") for _ in range(2)]
    counts = _Counts(("stopper", "released"))
    idle = _busy()
    async with running(w, redis) as task:
        await asyncio.wait_for(task, timeout=10)
    assert len(ran) == 1
    assert _busy() == idle
    assert counts.added() == {("stopper", "released"): 1}
    for job in jobs:
        await eventually(lambda job=job: _in_state(queue, job.id, JobState.WAITING))


async def test_the_llm_layers_calls_reach_the_probe_the_hook_attached_for_the_attempt(
    redis: Redis, prefix: str, queue: Queue
) -> None:
    from sluice.probes import Probe, probe
    from sluice.service.worker_metrics import WorkerMetrics

    hook = WorkerMetrics()
    w = Worker("q", prefix=prefix, hooks=[hook])
    seen: list[Probe] = []

    @w.handler
    async def reports(job: JobContext) -> None:
        seen.append(probe())
        probe().cache_lookup("bypass")

    @w.handler
    def reports_in_a_thread(job: JobContext) -> None:
        seen.append(probe())
        probe().cache_lookup("bypass")

    def bypassed() -> float:
        return _series().REGISTRY.get_sample_value("sluice_cache_lookups_total", {"result": "bypass"}) or 0

    before = bypassed()
    async with running(w, redis):
        for name in ("reports", "reports_in_a_thread"):
            await (await queue.add(name)).result(timeout=10)
    assert seen == [hook.probe, hook.probe]
    assert bypassed() - before == 2
    assert probe() is not hook.probe  # outside an attempt: the probe that does nothing
    probe().cache_lookup("bypass")
    assert bypassed() - before == 2


def test_an_after_whose_before_failed_gives_back_no_slot() -> None:
    from sluice.service.worker_metrics import WorkerMetrics

    hook = WorkerMetrics()
    job = JobContext("q", "1", "task", {}, 1, 1, 0, "w", b"t")
    idle = _busy()
    hook.after_attempt(job, AttemptEnd("completed", None, 0.1), None)  # before_attempt raised
    assert _busy() == idle


def test_the_handler_histogram_labels_timeouts_and_last_failures() -> None:
    from sluice.service.worker_metrics import outcome_label

    def end(outcome: str, timed_out: bool = False) -> AttemptEnd:
        return AttemptEnd(outcome, None, 0.0, timed_out=timed_out)

    assert outcome_label(end("retry", timed_out=True)) == "timed_out"
    assert outcome_label(end("dead", timed_out=True)) == "timed_out"
    assert outcome_label(end("retry")) == "failed"
    assert outcome_label(end("dead")) == "dead"
    for same in ("completed", "released", "cancelled", "throttled", "lease_lost"):
        assert outcome_label(end(same)) == same
    assert outcome_label(end("something new")) == "other"


def _label_sets() -> list[dict[str, str]]:
    return [sample.labels for metric in _series().REGISTRY.collect() for sample in metric.samples]


async def _now(value: bool) -> bool:
    return value


async def _in_state(queue: Queue, job_id: str, state: JobState) -> bool:
    record = await queue.get_job(job_id)
    return record is not None and record.state == state
