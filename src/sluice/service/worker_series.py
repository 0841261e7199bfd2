"""The worker series themselves (see worker_metrics.py, which imports this module only once
prometheus-client's mode is chosen: the objects made here take it at import)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sluice.probes import CACHE_RESULTS, PROVIDER_OUTCOMES, TOKEN_KINDS

#: The process's registry when it serves its own port (one process). In multiprocess mode
#: the values are in files and the supervisor's collector reads those instead.
REGISTRY = CollectorRegistry(auto_describe=True)

PROCESSES = Gauge(
    "sluice_worker_processes",
    "Worker processes alive (each sets 1; an ended process's value is dropped).",
    multiprocess_mode="livesum",
    registry=REGISTRY,
)
BUSY = Gauge(
    "sluice_worker_busy_slots",
    "Handlers running now (slots taken), over the live worker processes.",
    multiprocess_mode="livesum",
    registry=REGISTRY,
)
HANDLER = Histogram(
    "sluice_worker_handler_duration_seconds",
    "Time from a handler's start to the end of its attempt, by job type (unregistered: a name "
    "with no handler) and outcome: completed, failed, dead, timed_out, released, cancelled, "
    "throttled, lease_lost.",
    ["job_type", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
    registry=REGISTRY,
)
CALLS = Counter(
    "sluice_provider_calls",
    "Chat calls to LLM providers, by provider, model and outcome: "
    + ", ".join(PROVIDER_OUTCOMES)
    + " (error: anything else, a bug or a missing key).",
    ["provider", "model", "outcome"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "sluice_provider_tokens",
    "Tokens providers reported, by kind: " + ", ".join(TOKEN_KINDS) + " (prompt excludes the cached "
    "part; the three add up to the total).",
    ["provider", "model", "kind"],
    registry=REGISTRY,
)
COST = Counter(
    "sluice_provider_cost_usd",
    "What the answers cost in US dollars, at the pricing table's prices (SLUICE_PRICING_FILE).",
    ["provider", "model"],
    registry=REGISTRY,
)
CACHE = Counter(
    "sluice_cache_lookups",
    "llm-inference requests meeting the semantic cache, by result: " + ", ".join(CACHE_RESULTS) + ".",
    ["result"],
    registry=REGISTRY,
)
