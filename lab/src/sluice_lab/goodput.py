"""Goodput: how much of a provider's rate limit a queue turns into answered calls.

An LLM provider allows so many requests and so many tokens per window and
answers 429 beyond that. The usual client retries a 429 with backoff: the
calls that got 429 are wasted, and the backoff leaves windows half used. A
queue that knows the limits starts only what the provider will accept.

The benchmark runs one workload (``jobs`` calls of varied, deterministic
token cost; see :func:`workload`) through worker processes against the
simulated provider of :mod:`sluice.testing.provider`, a fresh one per variant:

* ``sluice-limited``: the queue holds the provider's limits
  (``set_rate_limit`` and ``set_token_rate_limit``), every job carries its
  token estimate, a 429 raises ``Throttled`` (the queue pauses as long as
  the provider says; the job goes back uncounted) and a success records its
  usage;
* ``no-limiter``: the same queue and workers without limits; a 429 is an
  ordinary failure, retried with exponential backoff and full jitter up to
  ``max_attempts`` times, as retry-on-429 clients do;
* ``aiolimiter``: the same queue without limits, and in each worker process
  a client-side limiter from the maintained ``aiolimiter`` package holding
  that process's share of the provider's limits (configured as
  :mod:`sluice_lab.goodput_limiter` says); a 429 is retried as the
  no-limiter's is.

``network_delay`` puts that many seconds between the workers and the
provider, each way (:class:`sluice.testing.network.NetworkDelay`); the
dispatch-to-arrival times include it once.

Figures per variant:

* completion time: from the add of all jobs (the workers already serving) to
  the last job finished, next to the theoretical minimum,
  ``max(jobs / requests, tokens / token limit)`` windows;
* goodput: accepted calls (and tokens) per window as a share of the
  provider's limit, for the limit that binds (the higher share), over the
  complete windows from the first accepted call while jobs were waiting
  (see :func:`goodput`); at most 100 %;
* calls, 429s (the provider's count: what one pays for), wasted calls (every
  call that was not accepted), end-to-end latency (add to finish) p50/p95/p99;
* exactly once: each job counts its own successful runs (see
  :mod:`sluice_lab.goodput_worker`), so a lost or twice-run job shows;
* dispatch to arrival: from the job's start in the queue (aiolimiter: from
  the moment its limiter let the call go) to its accepted call's arrival at
  the provider (matched by request id).

Before the workload, every worker slot runs one ``warm_up`` job (its client
built, a connection open), and only then are the limits set and the jobs
added, all at once, with every worker serving.

Dispatch versus arrival. The queue counts a call when it *starts* it, the
provider when it *arrives*: a call that reaches the provider faster than
the one whose place in the window it takes arrives one too many, and gets a
429. Three settings, all stated in the output, absorb that (the first two
are the queue's own defaults unless the spec sets them: :class:`GoodputSpec`):

* the queue's pacer (``tolerance_ms``; None turns it off): a sliding window
  alone admits a whole window's worth at once, so the first burst (as many
  calls as the workers have slots) comes back at every window turn; on a
  small machine a burst reaches the provider spread over far longer than
  calls started evenly (HTTP clients and the provider share the CPUs). The
  pacer starts them evenly (see Queue.set_pacing);
* ``headroom``: the queue's headroom (Queue.set_pacing): ms added to the
  windows its logs count, about the spread of dispatch-to-arrival times; it
  costs ``headroom / window`` of the limit (3 % for 30 ms here, 0.05 % on a
  real 60-second window);
* ``pace``: the request limit set as one pace-th of it per pace-th of the
  window (10 per 0.1 s for 100 per 1 s), the hand-made pacing from before
  the pacer (1: the provider's limit as it is).

The figures of runs are in benchmarks/results (HISTORY.md and
docs/decisions/0006, 0007).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from sluice.engine.backoff import Backoff
from sluice.engine.clock import now_ms
from sluice.engine.job import JobSpec
from sluice.engine.queue import Queue
from sluice.testing.network import check_network_delay
from sluice.testing.provider import serve_provider
from sluice.testing.simulated_model import count_prompt_tokens
from sluice.testing.simulated_server import ARRIVALS_PATH, STATS_PATH, ProviderLimits
from sluice_lab.common import drop_queue, new_queue_name
from sluice_lab.goodput_limiter import ClientLimits
from sluice_lab.goodput_worker import (
    CLIENTS,
    ENV_CLIENT,
    ENV_CLIENT_LIMITS,
    ENV_PROVIDER,
    ENV_REDIS,
    ENV_RUNS_KEY,
    SENT_SUFFIX,
)
from sluice_lab.procs import WorkerGroup
from sluice_lab.stats import summarize_ms

if TYPE_CHECKING:
    from redis.asyncio import Redis

LIMITED = "sluice-limited"
NO_LIMITER = "no-limiter"
CLIENT_LIMITED = "aiolimiter"
VARIANTS = (LIMITED, NO_LIMITER, CLIENT_LIMITED)
#: The job each variant adds (the handlers of sluice_lab.goodput_worker).
HANDLERS = {LIMITED: "call_limited", NO_LIMITER: "call_retry", CLIENT_LIMITED: "call_client_limited"}
WORKER_TARGET = "sluice_lab.goodput_worker:worker"
#: Seconds between two reads of the progress counters (the runs take tens of seconds).
POLL_S = 0.1
#: Seconds to wait after the last job for duplicates to show up.
SETTLE_S = 0.5

#: Called with (jobs done, 429s so far) while a variant runs.
Progress = Callable[[int, int], None]

_PROMPT = (
    "Summarize the following support ticket in three short bullet points and name the product "
    "it is about. The customer writes that the export to CSV stops after the first page. "
)


@dataclass(frozen=True, slots=True)
class Call:
    """One job of the workload: a prompt and its completion budget."""

    prompt: str
    max_tokens: int

    @property
    def tokens(self) -> int:
        """What the provider's token limit counts for this call (prompt + max_tokens)."""
        return count_prompt_tokens([{"role": "user", "content": self.prompt}]) + self.max_tokens


def workload(n: int) -> list[Call]:
    """``n`` calls of varied cost, the same on every run: prompts of 60-160 tokens, 120-280 to write.

    The strides are prime to the ranges, so costs spread evenly over the
    run; the mean cost is about 310 tokens.
    """
    text = _PROMPT * 8
    return [Call(text[: 240 + (i * 37) % 400], 120 + (i * 53) % 161) for i in range(n)]


@dataclass(frozen=True, slots=True)
class GoodputSpec:
    """One goodput run: the workload, the workers, the provider and the clients' policies."""

    jobs: int = 2000
    processes: int = 2
    concurrency: int = 32
    #: the provider's window (seconds) and its limits per window
    window: float = 1.0
    requests: int = 100
    tokens: int = 30_000
    #: the provider's latency per accepted call: fixed + per completion token (seconds)
    latency: float = 0.1
    latency_per_token: float = 0.0002
    #: the provider counts refused calls against its request limit, as OpenAI documents
    count_rejected: bool = False
    #: seconds between workers and provider, each way (the simulated network's distance)
    network_delay: float = 0.0
    #: sluice-limited: the request limit as requests // pace per window / pace (see the module's
    #: docstring); a pace that does not divide requests makes the queue's limit a little stricter
    pace: int = 1
    #: sluice-limited: the queue's pacing (Queue.set_pacing): its headroom (ms added to its
    #: windows) for dispatch-to-arrival jitter, its pacer's tolerance (ms), the pacer on or off.
    #: None leaves the queue's own default; set_pacing is called only if one is given.
    headroom_ms: int | None = None
    tolerance_ms: int | None = None
    pacer: bool | None = None
    #: the no-limiter's and the aiolimiter's retry policy: exponential from backoff_base to
    #: backoff_max, full jitter
    max_attempts: int = 50
    backoff_base: float = 0.05
    backoff_max: float = 1.0
    #: seconds one variant may take
    timeout: float = 180.0
    #: how the workers call: "provider" (Sluice's OpenAIProvider) or "raw" (bare httpx)
    client: str = "provider"

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        if not 1 <= self.pace <= self.requests:
            raise ValueError(f"pace must be from 1 to requests ({self.requests}), got {self.pace}")
        if self.pacer is False and self.tolerance_ms is not None:
            raise ValueError("a tolerance is the pacer's: give tolerance_ms or pacer=False, not both")
        check_network_delay(self.network_delay)

    def provider_limits(self) -> ProviderLimits:
        return ProviderLimits(
            self.requests,
            self.tokens,
            self.window,
            self.latency,
            self.latency_per_token,
            self.count_rejected,
            self.network_delay,
        )

    def pacing(self) -> dict[str, Any]:
        """The arguments of Queue.set_pacing that this spec sets (none: the queue's defaults stand)."""
        out: dict[str, Any] = {}
        if self.pacer is False:
            out["tolerance_ms"] = None
        elif self.tolerance_ms is not None:
            out["tolerance_ms"] = self.tolerance_ms
        if self.headroom_ms is not None:
            out["headroom_ms"] = self.headroom_ms
        return out

    def client_limits(self) -> ClientLimits:
        """The aiolimiter variant's share of the provider's limits per process."""
        return ClientLimits(
            self.requests,
            self.tokens,
            self.window,
            self.processes,
            max(c.tokens for c in workload(self.jobs)),
        )

    def backoff(self) -> Backoff:
        return Backoff.exponential(self.backoff_base, self.backoff_max, jitter=1.0)


def theoretical_min_s(spec: GoodputSpec, calls: list[Call]) -> tuple[float, str]:
    """The shortest time the provider's limits allow, and the limit that sets it."""
    by_requests = len(calls) / spec.requests
    by_tokens = sum(c.tokens for c in calls) / spec.tokens
    if by_tokens >= by_requests:
        return by_tokens * spec.window, "tokens"
    return by_requests * spec.window, "requests"


async def run_variant(
    redis: Redis,
    url: str,
    spec: GoodputSpec,
    variant: str,
    log_dir: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the workload once as ``variant`` against a fresh simulated provider."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is unknown; use one of {VARIANTS}")
    client_limits = spec.client_limits() if variant == CLIENT_LIMITED else None
    name = new_queue_name("goodput")
    queue = Queue(name, redis=redis)
    runs_key = queue.keys.base + "bench-runs"
    with serve_provider(spec.provider_limits()) as provider_url:
        env = {ENV_PROVIDER: provider_url, ENV_REDIS: url, ENV_RUNS_KEY: runs_key, ENV_CLIENT: spec.client}
        if client_limits is not None:
            env[ENV_CLIENT_LIMITS] = client_limits.to_json()
        group = WorkerGroup(url, name, spec.concurrency, env=env, log_dir=log_dir, target=WORKER_TARGET)
        try:
            group.start(spec.processes)
            await _wait_for_workers(queue, group)
            await _warm_up(queue, spec)
            limits = await _configure(queue, spec, variant)
            async with httpx.AsyncClient(base_url=provider_url) as http:
                out = await _measure(redis, queue, group, spec, variant, runs_key, http, progress)
            out["queue_limits"] = limits
            out["graceful_exit_s"] = group.stop()
        finally:
            if group.procs:
                group.stop()
            await queue.close()
            await drop_queue(redis, name)
    return out


async def _configure(queue: Queue, spec: GoodputSpec, variant: str) -> dict[str, Any]:
    """Set the queue's limits (sluice-limited only); returns the limits in force, for the JSON."""
    if variant == CLIENT_LIMITED:
        limits = spec.client_limits()
        return {"client_limiter": {**asdict(limits), **limits.settings()}}
    if variant != LIMITED:
        return {}
    starts = spec.requests // spec.pace
    pacing = spec.pacing()
    if pacing:
        await queue.set_pacing(**pacing)
    await queue.set_rate_limit(starts, per=spec.window / spec.pace)
    await queue.set_token_rate_limit(spec.tokens, per=spec.window)
    # As the queue has them: its own defaults for what the spec left alone.
    flow = asdict(await queue.flow())
    return {
        "max_starts": starts,
        "starts_window_s": spec.window / spec.pace,
        "tokens": spec.tokens,
        "tokens_window_s": spec.window,
        "pace": spec.pace,
        "pacing_set": pacing,
        "pacing": {k: v for k, v in flow.items() if "pace" in k or "headroom" in k},
    }


async def _wait_for_workers(queue: Queue, group: WorkerGroup, timeout: float = 60.0) -> None:
    """Every worker process serves (its heartbeat is in) before the first job is added."""
    deadline = time.monotonic() + timeout
    while await queue.redis.hlen(queue.keys.workers) < len(group.ids):
        if group.exited():
            raise RuntimeError(f"a goodput worker exited at start: {group.log_tail(group.exited()[0])}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the goodput workers did not start within {timeout:g} s")
        await asyncio.sleep(0.05)


async def _warm_up(queue: Queue, spec: GoodputSpec, timeout: float = 60.0) -> None:
    """One ``warm_up`` job per slot, before any limit is set: warm clients, open connections."""
    jobs = await queue.add_bulk(JobSpec("warm_up") for _ in range(spec.processes * spec.concurrency))
    for job in jobs:
        await job.result(timeout=timeout)


def _specs(spec: GoodputSpec, variant: str, calls: list[Call]) -> list[JobSpec]:
    if variant == LIMITED:
        return [
            JobSpec(HANDLERS[variant], {"prompt": c.prompt, "max_tokens": c.max_tokens}, tokens=c.tokens)
            for c in calls
        ]
    return [
        JobSpec(
            HANDLERS[variant],
            {"prompt": c.prompt, "max_tokens": c.max_tokens},
            max_attempts=spec.max_attempts,
            backoff=spec.backoff(),
        )
        for c in calls
    ]


async def _measure(
    redis: Redis,
    queue: Queue,
    group: WorkerGroup,
    spec: GoodputSpec,
    variant: str,
    runs_key: str,
    http: httpx.AsyncClient,
    progress: Progress | None,
) -> dict[str, Any]:
    calls = workload(spec.jobs)
    t0 = now_ms()
    jobs = await queue.add_bulk(_specs(spec, variant, calls))
    warnings = await _wait(redis, queue, group, spec, runs_key, http, progress)
    stopped = time.time()
    await asyncio.sleep(SETTLE_S)
    raw_runs: Any = await redis.hgetall(runs_key)
    runs = {k.decode(): int(v) for k, v in raw_runs.items()}
    raw_sent: Any = await redis.hgetall(runs_key + SENT_SUFFIX)
    sent_ms = {k.decode(): float(v) * 1000 for k, v in raw_sent.items()}
    provider = (await http.get(STATS_PATH)).json()
    arrivals: dict[str, float] = (await http.get(ARRIVALS_PATH)).json()
    records = [r for r in await queue.get_jobs([j.id for j in jobs]) if r is not None]
    finished = [r for r in records if r.finished_ms is not None and r.id in runs]
    e2e_ms = [float(r.finished_ms - r.created_ms) for r in finished if r.finished_ms is not None]
    # The call's dispatch: when the client-side limiter let it go (aiolimiter), else the job's start.
    dispatched = {r.id: sent_ms.get(r.id, r.started_ms) for r in finished if r.started_ms}
    lag_ms = [arrivals[i] * 1000 - t for i, t in dispatched.items() if i in arrivals]
    complete = len(runs) == spec.jobs
    end_ms = max((r.finished_ms for r in finished if r.finished_ms is not None), default=now_ms())
    accepted = [(arrivals[j.id], c.tokens) for j, c in zip(jobs, calls, strict=True) if j.id in arrivals]
    minimum, binds = theoretical_min_s(spec, calls)
    completion_s = (end_ms - t0) / 1000
    counts = await queue.counts()
    return {
        "variant": variant,
        "jobs": spec.jobs,
        "completed": len(runs),
        "duplicates": sum(v - 1 for v in runs.values() if v > 1),
        "lost_or_failed": spec.jobs - len(runs),
        "dead": counts["dead"],
        "complete": complete,
        #: None unless every job succeeded: the time of the last success says nothing then
        "completion_s": round(completion_s, 3) if complete else None,
        "theoretical_min_s": round(minimum, 3),
        "theoretical_binding": binds,
        "completion_vs_min": round(completion_s / minimum, 3) if minimum and complete else None,
        # Jobs that never succeeded waited until the measurement stopped.
        **goodput(spec, accepted, None if complete else stopped),
        "calls": provider["requests"],
        "accepted_calls": provider["accepted"],
        "rate_limited": provider["rate_limited"],
        "wasted_calls": provider["requests"] - provider["accepted"],
        "calls_per_job": round(provider["requests"] / spec.jobs, 3),
        "max_attempt": max((r.attempt for r in records), default=0),
        # Percentiles over the jobs that succeeded (all of them, unless the run is incomplete).
        "e2e": summarize_ms(e2e_ms),
        "dispatch_to_arrival": summarize_ms(lag_ms),
        "provider": provider,
        "engine_counts": counts,
        "warnings": warnings,
    }


async def _wait(
    redis: Redis,
    queue: Queue,
    group: WorkerGroup,
    spec: GoodputSpec,
    runs_key: str,
    http: httpx.AsyncClient,
    progress: Progress | None,
) -> list[str]:
    """Until every job has succeeded or died; returns what went wrong (nothing, normally)."""
    deadline = time.monotonic() + spec.timeout
    while True:
        done: int = await redis.hlen(runs_key)
        dead = (await queue.counts())["dead"]
        if progress is not None:
            progress(done, (await http.get(STATS_PATH)).json()["rate_limited"])
        if done + dead >= spec.jobs:
            return []
        if time.monotonic() > deadline:
            return [f"time limit of {spec.timeout:g} s reached with {done}/{spec.jobs} jobs done"]
        if len(group.exited()) == len(group.ids):
            return [f"all workers exited early: {[group.log_tail(w) for w in group.ids]}"]
        await asyncio.sleep(POLL_S)


def goodput(
    spec: GoodputSpec, accepted: list[tuple[float, int]], until: float | None = None
) -> dict[str, Any]:
    """Accepted calls and tokens as a share of the provider's limits, in the windows jobs waited.

    ``accepted``: (arrival time, tokens) of every accepted call. The windows
    are the complete ones from the first arrival on; the last, partial one,
    in which the queue ran dry, is left out (with none complete, the one
    window from the first arrival stands). ``until``: when jobs last waited,
    for a run that stopped with jobs left. Any interval of one window holds
    at most the limit, so the share is at most 100 %.
    """
    if not accepted:
        return {
            "goodput_pct": None,
            "goodput_requests_pct": None,
            "goodput_tokens_pct": None,
            "binding": None,
        }
    first = min(t for t, _ in accepted)
    last = until if until is not None else max(t for t, _ in accepted)
    windows = max(1, int((last - first) / spec.window))
    end = first + windows * spec.window
    inside = [tokens for t, tokens in accepted if t < end]
    by_requests = 100.0 * len(inside) / (spec.requests * windows)
    by_tokens = 100.0 * sum(inside) / (spec.tokens * windows)
    return {
        "goodput_pct": round(max(by_requests, by_tokens), 2),
        "goodput_requests_pct": round(by_requests, 2),
        "goodput_tokens_pct": round(by_tokens, 2),
        "binding": "tokens" if by_tokens >= by_requests else "requests",
        "goodput_windows": windows,
        "accepted_span_s": round(last - first, 3),
    }
