"""Latency percentiles from a mergeable sketch: DDSketch's bins, kept in Redis hashes.

A duration (ms) is put in the bin ``ceil(log_gamma(v))`` with ``gamma =
(1 + a) / (1 - a)`` and ``a = 1 %``: DDSketch's logarithmic mapping, computed
here exactly as the ``ddsketch`` package does (tests/engine/test_latency_stats.py
checks the keys against it). A bin is reported by the value ``2 gamma^k /
(gamma + 1)``, which is within ``a`` (relative) of every value in it, so a
percentile read from the bins is within 1 % of the exact value at the same
rank, ``floor(q * (n - 1))``, however many sketches were merged: merging is
adding counts per bin, exact, which Redis does itself with HINCRBY.

Each worker process adds the durations of its finished attempts to a local
dict of bin counts (:class:`LatencyRecorder`) and flushes it about once a
second (``lua/latency.lua``, at most :data:`FLUSH_PAIRS` fields per call) into
time-bucketed hashes, one per (queue, metric, bucket): 10 s buckets kept
:data:`KEEP_10S_MS`, 1 min buckets kept :data:`KEEP_1M_MS`, each expiring by
itself. A worker that crashes loses what it had not flushed (at most about a
second of samples). :func:`summarize` merges the buckets a window covers.

The same flush adds the counts to one cumulative hash per (queue, metric,
priority) that never expires (the first 32 priorities a queue sees; later ones
share ``other``): the API exports them as Prometheus histograms
(:func:`histogram`, fixed edges :data:`HISTOGRAM_EDGES`), so ``rate()`` and
``histogram_quantile`` work over any range Prometheus keeps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.errors import ConfigurationError

if TYPE_CHECKING:
    from sluice.engine.core import QueueCore
    from sluice.engine.keys import QueueKeys

#: The relative accuracy of every percentile reported.
RELATIVE_ACCURACY = 0.01
_MANTISSA = 2 * RELATIVE_ACCURACY / (1 - RELATIVE_ACCURACY)
GAMMA = 1 + _MANTISSA
# As ddsketch.mapping.LogarithmicMapping computes it, so the keys agree to the last bit.
_MULTIPLIER = (1 / math.log1p(_MANTISSA)) * math.log(2)
_VALUE_FACTOR = 2.0 / (1 + GAMMA)
#: The field of durations of 0 ms (the clock's resolution is 1 ms), and below the bins.
ZERO = "z"
#: Smaller durations count as 0.
MIN_MS = 1e-3

#: The three durations of a finished attempt (ms, Redis's clock).
METRICS = ("queue_wait", "processing", "end_to_end")
#: How the metrics are named in keys.
_SHORT = {"queue_wait": "w", "processing": "p", "end_to_end": "e"}

BUCKET_10S_MS = 10_000
BUCKET_1M_MS = 60_000
#: How long a bucket lives after its last write: past the longest window it serves (5 min, 1 h).
KEEP_10S_MS = 400_000
KEEP_1M_MS = 3_900_000
#: The longest window each resolution answers (a window covers up to one bucket more).
MAX_WINDOW_10S_MS = 360_000
MAX_WINDOW_1M_MS = 3_780_000
#: (bin, count) pairs per flush script call: bounded work (a short call, whatever was seen).
FLUSH_PAIRS = 256
#: How often a worker flushes.
FLUSH_INTERVAL = 1.0
#: The percentiles reported.
QUANTILES = (0.5, 0.95, 0.99)


def bin_of(value_ms: float) -> str:
    """The hash field (bin) of a duration: its DDSketch key, or :data:`ZERO`."""
    if value_ms < MIN_MS:
        return ZERO
    return str(key_of(value_ms))


def key_of(value_ms: float) -> int:
    """The DDSketch key of a positive duration."""
    return math.ceil(math.log(value_ms, 2) * _MULTIPLIER)


def value_of(key: int) -> float:
    """The value a bin stands for: within :data:`RELATIVE_ACCURACY` of all its values."""
    return math.pow(2.0, key / _MULTIPLIER) * _VALUE_FACTOR


def upper_bound(key: int) -> float:
    """The largest value the bin holds."""
    return math.pow(2.0, key / _MULTIPLIER)


@dataclass(frozen=True, slots=True)
class Percentiles:
    """One metric over one window, in ms; None where there were no samples."""

    count: int
    p50: float | None
    p95: float | None
    p99: float | None
    #: the upper bound of the highest bin that holds a sample (the max is at most this)
    max: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "p50": self.p50, "p95": self.p95, "p99": self.p99, "max": self.max}


def quantiles(bins: Mapping[str, int], qs: Iterable[float] = QUANTILES) -> list[float | None]:
    """The values at ranks ``floor(q * (n - 1))`` of merged bins (field -> count)."""
    zero = max(int(bins.get(ZERO, 0)), 0)
    keyed = sorted((int(k), int(c)) for k, c in bins.items() if k != ZERO and int(c) > 0)
    n = zero + sum(c for _, c in keyed)
    out: list[float | None] = []
    for q in qs:
        if n == 0:
            out.append(None)
            continue
        rank = math.floor(q * (n - 1))
        if rank < zero:
            out.append(0.0)
            continue
        seen = zero
        for key, count in keyed:
            seen += count
            if seen > rank:
                out.append(value_of(key))
                break
    return out


def summarize(bins: Mapping[str, int]) -> Percentiles:
    """Count, p50, p95, p99 and an upper bound of the max of merged bins."""
    zero = max(int(bins.get(ZERO, 0)), 0)
    keyed = [int(k) for k, c in bins.items() if k != ZERO and int(c) > 0]
    n = zero + sum(max(int(c), 0) for k, c in bins.items() if k != ZERO)
    p50, p95, p99 = quantiles(bins)
    top = upper_bound(max(keyed)) if keyed else (0.0 if zero else None)
    return Percentiles(n, p50, p95, p99, top)


def merge(hashes: Iterable[Mapping[bytes, bytes]]) -> dict[str, int]:
    """Add up bucket hashes as HGETALL returns them."""
    out: dict[str, int] = {}
    for h in hashes:
        for field, count in h.items():
            name = field.decode()
            out[name] = out.get(name, 0) + int(count)
    return out


def buckets(now_ms: int, window_ms: int) -> tuple[str, int, range]:
    """The resolution ("10s" or "1m"), bucket size (ms) and bucket numbers that cover the
    last ``window_ms`` up to ``now_ms`` (the window and at most one bucket more): 10 s
    buckets up to 6 min, 1 min buckets up to 63 min."""
    if window_ms <= 0:
        raise ConfigurationError(f"a window must be positive, got {window_ms} ms")
    if window_ms <= MAX_WINDOW_10S_MS:
        size, res = BUCKET_10S_MS, "10s"
    elif window_ms <= MAX_WINDOW_1M_MS:
        size, res = BUCKET_1M_MS, "1m"
    else:
        raise ConfigurationError(f"windows longer than {MAX_WINDOW_1M_MS // 1000} s are not kept")
    return res, size, range((now_ms - window_ms) // size, now_ms // size + 1)


def bucket_keys(keys: QueueKeys, metric: str, now_ms: int, window_ms: int) -> list[str]:
    """The keys of the buckets that cover the last ``window_ms`` up to ``now_ms``."""
    res, _, numbers = buckets(now_ms, window_ms)
    return [keys.latency(_SHORT[metric], res, i) for i in numbers]


class LatencyRecorder:
    """A worker process's bins, by (metric, 10 s bucket, priority), until they are flushed."""

    def __init__(self, core: QueueCore) -> None:
        self._core = core
        self._bins: dict[tuple[str, int, str], dict[str, int]] = {}
        #: the priorities given labels of their own here: past MAX_PRIORITIES the rest are
        #: 'other', so a flush makes a bounded number of calls whatever producers send
        self._priorities: set[int] = set()
        #: samples flushed, and flush script calls made, since the start
        self.flushed = 0
        self.calls = 0

    def add(self, metric: str, value_ms: float, at_ms: int, priority: int = 0) -> None:
        """Count one duration that ended at ``at_ms`` (Redis's clock), of a job of ``priority``."""
        slot = (metric, at_ms // BUCKET_10S_MS, self._label(priority))
        bins = self._bins.get(slot)
        if bins is None:
            bins = self._bins[slot] = {}
        field = bin_of(value_ms)
        bins[field] = bins.get(field, 0) + 1

    def _label(self, priority: int) -> str:
        if priority not in self._priorities:
            if len(self._priorities) >= MAX_PRIORITIES:
                return OTHER_PRIORITIES
            self._priorities.add(priority)
        return str(priority)

    @property
    def pending(self) -> int:
        """Samples not flushed yet."""
        return sum(sum(b.values()) for b in self._bins.values())

    async def flush(self) -> int:
        """Send the bins to Redis, :data:`FLUSH_PAIRS` at most per script call; returns the
        number of calls. Bins whose call failed are dropped (the call may have been
        applied: sending it again could count twice)."""
        taken, self._bins = self._bins, {}
        calls = 0
        commands = self._core.commands
        for (metric, index, priority), bins in taken.items():
            pairs = list(bins.items())
            for start in range(0, len(pairs), FLUSH_PAIRS):
                chunk = pairs[start : start + FLUSH_PAIRS]
                call = commands.latency(
                    _SHORT[metric],
                    bucket_10s=index,
                    bucket_1m=index * BUCKET_10S_MS // BUCKET_1M_MS,
                    priority=priority,
                    other=OTHER_PRIORITIES,
                    keep_ms=(KEEP_10S_MS, KEEP_1M_MS),
                    bins=chunk,
                )
                await self._core.run(call)
                calls += 1
                self.flushed += sum(c for _, c in chunk)
        self.calls += calls
        return calls


#: The label of the cumulative bins of every priority past the first 32 a queue saw.
OTHER_PRIORITIES = "other"
#: Priorities with cumulative bins of their own, per queue (lua/latency.lua says the same)
#: and per worker process (:class:`LatencyRecorder`).
MAX_PRIORITIES = 32

#: The ``le`` edges (seconds) of the exported histograms, below +Inf.
HISTOGRAM_EDGES = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip


def short_name(metric: str) -> str:
    """How a metric (queue_wait, processing, end_to_end) is named in keys."""
    return _SHORT[metric]


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bins as a Prometheus histogram: ``buckets`` pairs each edge (seconds;
    the last is +Inf) with the samples counted at or below it."""

    buckets: list[tuple[float, int]]
    count: int
    #: seconds; each sample counted at its bin's value, so within 1 % of the exact sum
    sum: float


def histogram(bins: Mapping[str, int], edges: Iterable[float] = HISTOGRAM_EDGES) -> Histogram:
    """Fold DDSketch bins (field -> count, ms) into fixed edges (seconds).

    A bin counts under edge ``E`` when its upper bound is at most ``E``: every sample
    in ``le=E`` is at most ``E``, and every sample at most ``E / GAMMA`` (2 % below
    it) is in it. Only samples within 2 % below an edge may land one bucket late.
    """
    zero = 0
    per_key: list[tuple[float, int]] = []
    total_ms = 0.0
    for field, raw in bins.items():
        count = int(raw)
        if count <= 0:
            continue
        if field == ZERO:
            zero += count
            continue
        key = int(field)
        per_key.append((upper_bound(key), count))
        total_ms += value_of(key) * count
    per_key.sort()
    out: list[tuple[float, int]] = []
    seen, i = zero, 0
    for edge in edges:
        limit = edge * 1000 * (1 + 1e-12)  # an upper bound computed a hair above the edge
        while i < len(per_key) and per_key[i][0] <= limit:
            seen += per_key[i][1]
            i += 1
        out.append((edge, seen))
    n = zero + sum(c for _, c in per_key)
    out.append((math.inf, n))
    return Histogram(out, n, total_ms / 1000)
