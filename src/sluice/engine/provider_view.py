"""What the provider says of its own limits, carried to the queue's gates: the provider's view wins.

OpenAI's and Anthropic's answers carry their limiter's state (``x-ratelimit-*``,
``anthropic-ratelimit-*``: limit and remaining, for requests and tokens). The
queue's windows count what *this queue* started; the provider counts
everything sent with the key: other programs on the same key, a count of its
own that differs from ours. So each answer's figures go to the queue
(``observe.lua``), which compares the provider's use at the call's arrival
(limit - remaining) with its own window at the call's dispatch, and takes
the difference as use it did not see, counted in its windows until they
turn (docs/architecture.md, "The provider's view"). A limit the provider
states lower than the queue's lowers the queue's.

A handler reports with :meth:`JobContext.note_provider_limits` (Sluice's
providers do it for every completion); the worker gathers the reports and
sends the latest :data:`MAX_BATCH` about every quarter of a second, in one
script call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Reports sent in one script call at most (bounded work): the latest ones.
MAX_BATCH = 32
#: The most a call is taken to be late (ms; lag.lua's bound on the measured headroom too).
MAX_LATE_MS = 500


@dataclass(frozen=True, slots=True)
class LimitReport:
    """One answer's figures for one dispatched attempt (None: the answer did not say)."""

    #: when the attempt was dispatched (ms, Redis's clock)
    dispatched_ms: int
    limit_requests: int | None = None
    remaining_requests: int | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    #: the attempt's start in the request log and its reservation id (``<job id>:<token>``)
    member: str = ""
    #: its token estimate (what its reservation charged the token window)
    tokens: int = 0
    #: how much later than the quickest it reached the provider (ms; LagMeter.lateness)
    late_ms: int = 0

    def args(self) -> list[int | str]:
        """The report as observe.lua's eight arguments ('' for a figure not said)."""
        said = (self.limit_requests, self.remaining_requests, self.limit_tokens, self.remaining_tokens)
        return [
            self.dispatched_ms,
            *("" if v is None else v for v in said),
            self.member,
            self.tokens,
            self.late_ms,
        ]


def _count(what: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0 or None, got {value!r}")
    return value


class ProviderView:
    """The reports of one worker's handlers, waiting to be sent.

    Appends come from the event loop or a sync handler's thread: a deque's
    append and popleft are atomic, and a report lost to a race only waits for
    the next answer.
    """

    def __init__(self) -> None:
        self._reports: deque[LimitReport] = deque(maxlen=MAX_BATCH)

    def add(
        self,
        dispatched_ms: int,
        *,
        limit_requests: int | None = None,
        remaining_requests: int | None = None,
        limit_tokens: int | None = None,
        remaining_tokens: int | None = None,
        member: str = "",
        tokens: int = 0,
        late_ms: int = 0,
    ) -> None:
        """Keep one answer's figures (ValueError for a figure that is not a count)."""
        report = LimitReport(
            dispatched_ms,
            _count("limit_requests", limit_requests),
            _count("remaining_requests", remaining_requests),
            _count("limit_tokens", limit_tokens),
            _count("remaining_tokens", remaining_tokens),
            member,
            _count("tokens", tokens) or 0,
            min(_count("late_ms", late_ms) or 0, MAX_LATE_MS),
        )
        if report.args()[1:5] != ["", "", "", ""] or (report.late_ms > 0 and member):
            self._reports.append(report)

    def take(self) -> list[LimitReport]:
        """Every report waiting, oldest first, and forget them."""
        out: list[LimitReport] = []
        while self._reports:
            out.append(self._reports.popleft())
        return out
