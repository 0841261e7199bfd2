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
request (:meth:`JobContext.note_sent`, which Sluice's providers call). A
handler that never says gives none: its start is no measure (the first
version took it, and warm-up jobs leased at once before any limit was set
gave a large false "spread", which then slowed the paced calls that
followed). The two clocks are
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

import threading
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
#: The longest wait a 429 may ask and still teach how early a call came (ms).
LEARN_MAX_MS = 50.0


def wall_ms() -> float:
    """This host's clock for the samples, in ms (fractional: samples are a few ms apart).

    Monotonic, so that a step of the wall clock is not taken for a spread; its distance
    from Redis's clock is the offset, the same for every sample.
    """
    return time.monotonic() * 1000


class LagMeter:
    """One worker's samples of dispatch-to-send delay, and when to report them.

    A sync handler notes its send from its own thread while the event loop
    reads the samples: every method holds one lock (a deque changed while
    another thread walks it raises).
    """

    def __init__(self) -> None:
        #: (received at, received - dispatch now) of dispatch replies: the clock offset's samples
        self._offsets: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._lock = threading.RLock()
        #: (taken at, delay ms) of calls sent
        self._sent: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        #: (taken at, ms) of calls' transits: round trip less the provider's own time
        self._transit: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        #: (taken at, ms) of the 429s' asked waits: how early calls came that the samples missed
        self._early: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._new = 0
        self._reported_at = 0.0

    def reply(self, dispatch_now_ms: int, received_ms: float | None = None) -> None:
        """A dispatch reply that leased jobs came back: a sample of the clock offset."""
        with self._lock:
            at = wall_ms() if received_ms is None else received_ms
            self._offsets.append((at, at - dispatch_now_ms))
            while self._offsets and self._offsets[0][0] < at - OFFSET_WINDOW_S * 1000:
                self._offsets.popleft()

    def _offset(self) -> float | None:
        return min((o for _, o in self._offsets), default=None)

    def sent(self, dispatched_ms: int, at_ms: float | None = None) -> float | None:
        """A handler sent the call its job was dispatched for (the first one of the attempt),
        dispatched at ``dispatched_ms`` (Redis's clock); its delay (ms), or None before any
        dispatch reply gave the clocks' offset."""
        with self._lock:
            offset = self._offset()
            if offset is None:
                return None
            at = wall_ms() if at_ms is None else at_ms
            delay = at - dispatched_ms - offset
            self._sent.append((at, delay))
            self._new += 1
            return delay

    def lateness(
        self, sent_delay: float | None, transit_ms: float | None, at_ms: float | None = None
    ) -> float:
        """How much later than the quickest of the last WINDOW_S seconds a call reached the
        provider, as far as this worker can tell (ms): its send's delay beyond the lowest, plus
        its transit (the round trip less the time the provider says it spent, OpenAI's
        ``openai-processing-ms``) beyond the lowest. The transit counts whole, as if it all
        went one way: an answer read late makes a call look later than it was, which costs
        a little throughput, never a 429."""
        with self._lock:
            at = wall_ms() if at_ms is None else at_ms
            late = 0.0
            if sent_delay is not None and self._sent:
                late += max(0.0, sent_delay - min(d for _, d in self._sent))
            if transit_ms is not None and transit_ms >= 0:
                self._transit.append((at, transit_ms))
                while self._transit and self._transit[0][0] < at - WINDOW_S * 1000:
                    self._transit.popleft()
                late += max(0.0, transit_ms - min(t for _, t in self._transit))
            return late

    def throttled(self, early_ms: float, at_ms: float | None = None) -> None:
        """A call got a 429 asking to wait ``early_ms``: it reached the provider about that much
        before the window had room, which the samples did not show (the part of the delay after
        the send: the HTTP client, the network, the provider's own queue). For the next
        WINDOW_S seconds the highest delay reported is that much higher, and a report is due
        at once. A wait over LEARN_MAX_MS teaches nothing: it is a window's turn, or a
        provider's coarse hint, not a call a few ms early."""
        with self._lock:
            if not 0 < early_ms <= LEARN_MAX_MS:
                return  # (a longer wait is a window's turn, not a call a few ms early)
            self._early.append((wall_ms() if at_ms is None else at_ms, early_ms))
            self._new += MIN_SAMPLES

    def spread(self, now_ms: float | None = None) -> tuple[float, float] | None:
        """(lowest, highest) delay of the calls sent in the last WINDOW_S seconds, in ms, the
        highest raised by the 429s of that time (see throttled); None without a sample."""
        with self._lock:
            now = wall_ms() if now_ms is None else now_ms
            since = now - WINDOW_S * 1000
            while self._early and self._early[0][0] < since:
                self._early.popleft()
            while self._sent and self._sent[0][0] < since:
                self._sent.popleft()
            if not self._sent:
                return None
            delays = [d for _, d in self._sent]
            return min(delays), max(delays) + max((e for _, e in self._early), default=0.0)

    def report_due(self, now_s: float | None = None) -> tuple[float, float] | None:
        """The (lowest, highest) to report now, or None when no report is due.

        Due every REPORT_INTERVAL_S while samples come in, and sooner once
        MIN_SAMPLES new ones are in; marks it reported.
        """
        with self._lock:
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
