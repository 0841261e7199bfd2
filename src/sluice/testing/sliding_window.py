"""The simulated providers' rate limiter: an exact sliding-window log of accepted requests.

Both limits (requests, tokens) are an exact sliding window (a log of accepted requests, not
fixed buckets): any interval of ``window`` seconds holds at most the limit, so a client that
starts a burst right after a window boundary gains nothing. A refused request is told how long
until the window has room for *that request*.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class Admission(NamedTuple):
    """The window's answer to one request."""

    accepted: bool
    #: seconds until the window has room for this request (0 when accepted)
    retry_after: float
    #: the limit that refused it: "requests" or "tokens" (the one with the longer wait)
    reason: str | None
    remaining_requests: int | None
    remaining_tokens: int | None
    #: seconds until the window holds no request / no token (OpenAI's x-ratelimit-reset-*)
    reset_requests: float = 0.0
    reset_tokens: float = 0.0


class SlidingWindow:
    """An exact sliding-window log of accepted requests: (arrival time, tokens).

    With ``count_rejected``, refused requests are logged too, at 0 tokens.
    An entry logged at ``t`` holds its share of both limits until
    ``t + window`` exactly. The caller passes ``now`` (monotonic seconds), so
    tests can step time; the window never reads the clock.
    """

    def __init__(
        self, requests: int | None, tokens: int | None, window: float, count_rejected: bool = False
    ) -> None:
        self.requests = requests
        self.tokens = tokens
        self.window = window
        self.count_rejected = count_rejected
        self._log: deque[tuple[float, int]] = deque()
        self._tokens_in_window = 0

    def _expire(self, now: float) -> None:
        while self._log and now - self._log[0][0] >= self.window:
            self._tokens_in_window -= self._log.popleft()[1]

    @property
    def in_window(self) -> tuple[int, int]:
        """(requests, tokens) accepted within the window at the last call's ``now``."""
        return len(self._log), self._tokens_in_window

    def _wait_for_requests(self, now: float) -> float:
        if self.requests is None or len(self._log) < self.requests:
            return 0.0
        # The oldest entries must leave until one slot is free.
        return self._log[len(self._log) - self.requests][0] + self.window - now

    def _wait_for_tokens(self, cost: int, now: float) -> float:
        if self.tokens is None:
            return 0.0
        excess = self._tokens_in_window + cost - self.tokens
        if excess <= 0:
            return 0.0
        freed = 0
        for t, tokens in self._log:
            freed += tokens
            if freed >= excess:
                return t + self.window - now
        raise AssertionError("a request larger than the token limit reached the window")

    def admit(self, cost: int, now: float) -> Admission:
        """Accept a request of ``cost`` tokens now and record it, or say how long until it fits."""
        if self.tokens is not None and cost > self.tokens:
            raise ValueError(f"a request of {cost} tokens can never fit a limit of {self.tokens}")
        self._expire(now)
        wait_r = self._wait_for_requests(now)
        wait_t = self._wait_for_tokens(cost, now)
        if wait_r > 0 or wait_t > 0:
            reason = "requests" if wait_r >= wait_t else "tokens"
            if self.count_rejected and self.requests is not None:
                self._log.append((now, 0))  # a place in the request window, no tokens
            return Admission(False, max(wait_r, wait_t), reason, *self._remaining(), *self._resets(now))
        self._log.append((now, cost))
        self._tokens_in_window += cost
        return Admission(True, 0.0, None, *self._remaining(), *self._resets(now))

    def _remaining(self) -> tuple[int | None, int | None]:
        requests = None if self.requests is None else max(0, self.requests - len(self._log))
        tokens = None if self.tokens is None else max(0, self.tokens - self._tokens_in_window)
        return requests, tokens

    def _resets(self, now: float) -> tuple[float, float]:
        requests = self._log[-1][0] + self.window - now if self._log else 0.0
        last_tokens = next((t for t, tokens in reversed(self._log) if tokens > 0), None)
        tokens = 0.0 if last_tokens is None else last_tokens + self.window - now
        return max(0.0, requests), max(0.0, tokens)
