"""How late a worker's calls leave after their dispatch: what the pacer's headroom must cover.

A rate limit counts a start when the dispatch script leases the job; the
provider counts it when the request arrives. A delay that is the same for
every call changes nothing (the arrivals keep the starts' spacing); what
breaks a window is its *spread*: a call that leaves faster than the one
whose place it takes arrives one too many. So the pacer counts its windows
over W plus a headroom at least that spread (docs/architecture.md, "The
pacer"), and every worker measures it instead of a person guessing it.

For each attempt the worker takes one sample: from the dispatch (Redis's
clock, the leasing call's ``now``) to the moment the handler sends its
request (:meth:`JobContext.note_sent`, which Sluice's providers call), or,
for a handler that never says, to the moment it starts. The two clocks are
brought together by the dispatch replies themselves: the smallest
``received - now`` seen lately is this host's offset from Redis's clock plus
the quickest reply, a constant that the spread does not see. Every
:data:`REPORT_INTERVAL_S` or so a worker reports the lowest and highest
sample of the last :data:`WINDOW_S` seconds (``lag.lua``), and the queue's
measured headroom is the highest over all workers less the lowest.

What it cannot see: a difference in network delay between hosts (each host's
own delay is constant to it), which the least headroom set with
``Queue.set_pacing`` covers.
"""

from __future__ import annotations

import time
from collections import deque

#: Seconds of samples a report covers.
WINDOW_S = 20.0
#: Seconds of dispatch replies the clock offset is the least of.
OFFSET_WINDOW_S = 30.0
#: Seconds between two reports at most while samples come in; a report can come sooner
#: once MIN_SAMPLES new samples are in (the first seconds of a run matter most).
REPORT_INTERVAL_S = 2.0
SOON_INTERVAL_S = 0.25
MIN_SAMPLES = 16
#: Samples kept at most (a busy worker's last ones).
MAX_SAMPLES = 4096
#: How long a report holds without another (ms): a worker that stops reporting drops out.
REPORT_TTL_MS = 10_000


def wall_ms() -> float:
    """This host's wall clock, in ms (fractional: samples are a few ms apart)."""
    return time.time() * 1000


class LagMeter:
    """One worker's samples of dispatch-to-send delay, and when to report them.

    A sync handler notes its send from its own thread: appending to a deque is
    atomic, and a sample counted twice or not at all in ``_new`` only moves a
    report a little.
    """

    def __init__(self) -> None:
        #: (received at, received - dispatch now) of dispatch replies: the clock offset's samples
        self._offsets: deque[tuple[float, float]] = deque()
        #: (taken at, delay ms) of calls sent, and of handler starts (used when no call says)
        self._sent: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._started: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._new = 0
        self._reported_at = 0.0

    def reply(self, dispatch_now_ms: int, received_ms: float | None = None) -> None:
        """A dispatch reply that leased jobs came back: a sample of the clock offset."""
        at = wall_ms() if received_ms is None else received_ms
        self._offsets.append((at, at - dispatch_now_ms))
        while self._offsets and self._offsets[0][0] < at - OFFSET_WINDOW_S * 1000:
            self._offsets.popleft()

    def _offset(self) -> float | None:
        return min((o for _, o in self._offsets), default=None)

    def started(self, dispatched_ms: int, at_ms: float | None = None) -> None:
        """A handler started on a job dispatched at ``dispatched_ms`` (Redis's clock)."""
        self._sample(self._started, dispatched_ms, at_ms)

    def sent(self, dispatched_ms: int, at_ms: float | None = None) -> None:
        """A handler sent the call its job was dispatched for (the first one of the attempt)."""
        self._sample(self._sent, dispatched_ms, at_ms)

    def _sample(self, into: deque[tuple[float, float]], dispatched_ms: int, at_ms: float | None) -> None:
        offset = self._offset()
        if offset is None:
            return
        at = wall_ms() if at_ms is None else at_ms
        into.append((at, at - dispatched_ms - offset))
        self._new += 1

    def spread(self, now_ms: float | None = None) -> tuple[float, float] | None:
        """(lowest, highest) delay of the last WINDOW_S seconds, in ms: of the calls sent if any
        said so lately, else of the handlers' starts; None without a sample."""
        now = wall_ms() if now_ms is None else now_ms
        since = now - WINDOW_S * 1000
        for samples in (self._sent, self._started):
            while samples and samples[0][0] < since:
                samples.popleft()
            if samples:
                delays = [d for _, d in samples]
                return min(delays), max(delays)
        return None

    def report_due(self, now_s: float | None = None) -> tuple[float, float] | None:
        """The (lowest, highest) to report now, or None when no report is due.

        Due every REPORT_INTERVAL_S while samples come in, and sooner once
        MIN_SAMPLES new ones are in; marks it reported.
        """
        now = time.monotonic() if now_s is None else now_s
        if self._new == 0:
            return None
        elapsed = now - self._reported_at
        if elapsed < SOON_INTERVAL_S or (self._new < MIN_SAMPLES and elapsed < REPORT_INTERVAL_S):
            return None
        found = self.spread()
        if found is None:
            return None
        self._new = 0
        self._reported_at = now
        return found
