"""A simulated LLM provider: a real HTTP server on loopback that rate-limits like OpenAI.

The goodput benchmark needs a provider that says no the way real ones do,
on a clock short enough for a benchmark to finish in seconds. This one
speaks the small part of the OpenAI chat-completions protocol a queue's
handler needs (``POST /v1/chat/completions`` with ``model``, ``messages``
and ``max_tokens``; the reply has ``choices`` and ``usage``) and enforces
two limits per window:

* requests: at most ``requests`` accepted requests in any window;
* tokens: at most ``tokens`` accepted tokens in any window, where a request
  counts what it *may* use, ``prompt tokens + max_tokens``, as OpenAI counts
  it for rate limiting (it cannot know the completion's length in advance).
  Prompt tokens are :func:`count_prompt_tokens`: a quarter of the characters
  of every message's content, rounded up (the usual rule of thumb; clients
  import the same function, as they would use the provider's tokenizer).

Both limits are an exact sliding window (a log of accepted requests, not
fixed buckets): any interval of ``window`` seconds holds at most the limit,
so a client that starts a burst right after a window boundary gains nothing.
Rejected requests cost nothing. A request over a limit gets 429 at once
with ``retry-after-ms`` (milliseconds, rounded up) and ``retry-after``
(whole seconds, rounded up) saying when the window will have room for *that
request*, as OpenAI's headers do; retrying then succeeds unless someone
else took the room first. A request larger than the token limit itself can
never pass and gets 400 instead of a 429 that would be retried forever.

Accepted requests then take ``latency + latency_per_token * max_tokens``
seconds, and the simulated model always writes ``max_tokens`` tokens, so
``usage.total_tokens`` equals what the limiter counted. ``GET /stats``
returns the counters (JSON). Limits are per window: ``rpm=6000`` is
``requests=6000, window=60``, and a benchmark uses ``requests=100,
window=1`` to see the same behaviour sixty times faster.
"""

from __future__ import annotations

import asyncio
import json
import math
import select
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from sluice.errors import MissingExtra

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
except ImportError as exc:
    raise MissingExtra("testing", "the simulated LLM provider", exc.name or "starlette") from None

#: Characters per token of the simulated tokenizer (OpenAI's rule of thumb for English).
CHARS_PER_TOKEN = 4
COMPLETIONS_PATH = "/v1/chat/completions"
STATS_PATH = "/stats"
ARRIVALS_PATH = "/arrivals"
#: A client's own id for a request (OpenAI's header); the provider logs when accepted ones arrived.
REQUEST_ID_HEADER = "x-client-request-id"
#: Seconds the provider's process may take to start (Python and its imports) and to stop.
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


def count_prompt_tokens(messages: Sequence[Any]) -> int:
    """Prompt tokens of ``messages`` as the provider counts them: ceil(characters / 4), at least 1.

    Only string ``content`` counts; roles and message framing are free here.
    """
    chars = sum(
        len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
    )
    return max(1, -(-chars // CHARS_PER_TOKEN))


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """What the provider allows and how slow it is.

    ``requests`` / ``tokens``: accepted per ``window`` seconds (None: no
    such limit). ``latency``: seconds every accepted request takes, plus
    ``latency_per_token`` per completion token. ``count_rejected``: a
    refused request still takes a place in the request window, as OpenAI
    documents ("unsuccessful requests contribute to your per-minute limit"),
    so that resending at once keeps the window full; by default only
    accepted requests count.
    """

    requests: int | None = None
    tokens: int | None = None
    window: float = 60.0
    latency: float = 0.0
    latency_per_token: float = 0.0
    count_rejected: bool = False

    def __post_init__(self) -> None:
        for name, limit in (("requests", self.requests), ("tokens", self.tokens)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {limit!r}")
        if not (math.isfinite(self.window) and self.window > 0):
            raise ValueError(f"window must be > 0 seconds, got {self.window!r}")
        for name, value in (("latency", self.latency), ("latency_per_token", self.latency_per_token)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")

    def duration(self, completion_tokens: int) -> float:
        """Seconds an accepted request with this many completion tokens takes."""
        return self.latency + self.latency_per_token * completion_tokens


class Admission(NamedTuple):
    """The window's answer to one request."""

    accepted: bool
    #: seconds until the window has room for this request (0 when accepted)
    retry_after: float
    #: the limit that refused it: "requests" or "tokens" (the one with the longer wait)
    reason: str | None
    remaining_requests: int | None
    remaining_tokens: int | None


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
            return Admission(False, max(wait_r, wait_t), reason, *self._remaining())
        self._log.append((now, cost))
        self._tokens_in_window += cost
        return Admission(True, 0.0, None, *self._remaining())

    def _remaining(self) -> tuple[int | None, int | None]:
        requests = None if self.requests is None else max(0, self.requests - len(self._log))
        tokens = None if self.tokens is None else max(0, self.tokens - self._tokens_in_window)
        return requests, tokens


@dataclass(slots=True)
class ProviderStats:
    """What the provider saw. Times are Unix seconds of arrival (None before the first)."""

    requests: int = 0
    accepted: int = 0
    rate_limited: int = 0
    rate_limited_requests: int = 0
    rate_limited_tokens: int = 0
    bad_requests: int = 0
    #: prompt + max_tokens of accepted requests: what the token limit counted
    accepted_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    #: the most requests / tokens the window ever held: never above the limits
    peak_window_requests: int = 0
    peak_window_tokens: int = 0
    first_accepted_at: float | None = None
    last_accepted_at: float | None = None
    last_completed_at: float | None = None


class _BadRequest(Exception):
    pass


def _parse(body: Any) -> tuple[str, list[Any], int]:
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    model, messages, max_tokens = body.get("model"), body.get("messages"), body.get("max_tokens")
    if not isinstance(model, str) or not model:
        raise _BadRequest("'model' must be a non-empty string")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise _BadRequest("every message needs a string 'role' and 'content'")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _BadRequest("'max_tokens' must be an integer >= 1 (the simulator counts it against the limit)")
    return model, messages, max_tokens


def _error(
    status: int, message: str, kind: str, code: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class SimulatedProvider:
    """The provider's state and its ASGI app; serve it with :func:`serve_provider`.

    It runs on one event loop: admission has no await between its check and
    its record, so concurrent requests are decided one at a time, in arrival order.
    """

    def __init__(self, limits: ProviderLimits) -> None:
        self.limits = limits
        self._window = SlidingWindow(limits.requests, limits.tokens, limits.window, limits.count_rejected)
        self._stats = ProviderStats()
        self._ids = 0
        self._arrivals: dict[str, float] = {}
        self.app = Starlette(
            routes=[
                Route(COMPLETIONS_PATH, self._completions, methods=["POST"]),
                Route(STATS_PATH, self._stats_endpoint, methods=["GET"]),
                Route(ARRIVALS_PATH, self._arrivals_endpoint, methods=["GET"]),
            ]
        )

    def stats(self) -> dict[str, Any]:
        return {**asdict(self._stats), "limits": asdict(self.limits)}

    async def _stats_endpoint(self, _request: Request) -> JSONResponse:
        return JSONResponse(self.stats())

    def arrivals(self) -> dict[str, float]:
        """Request id -> Unix time its accepted call arrived, for calls that sent an id.

        With the time the client dispatched each call, this shows how long the
        way to the provider takes, and how much it varies.
        """
        return dict(self._arrivals)

    async def _arrivals_endpoint(self, _request: Request) -> JSONResponse:
        return JSONResponse(self.arrivals())

    def _limit_headers(self, admission: Admission) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.limits.requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limits.requests)
            headers["x-ratelimit-remaining-requests"] = str(admission.remaining_requests)
        if self.limits.tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limits.tokens)
            headers["x-ratelimit-remaining-tokens"] = str(admission.remaining_tokens)
        return headers

    async def _completions(self, request: Request) -> JSONResponse:
        try:
            model, messages, max_tokens = _parse(await request.json())
        except (ValueError, _BadRequest) as exc:
            self._stats.requests += 1
            self._stats.bad_requests += 1
            return _error(400, f"invalid request: {exc}", "invalid_request_error", "invalid_request")
        prompt = count_prompt_tokens(messages)
        cost = prompt + max_tokens
        if self.limits.tokens is not None and cost > self.limits.tokens:
            self._stats.requests += 1
            self._stats.bad_requests += 1
            return _error(
                400,
                f"request too large: {cost} tokens (prompt {prompt} + max_tokens {max_tokens}) can never "
                f"fit the limit of {self.limits.tokens} tokens per {self.limits.window:g} s; send less",
                "invalid_request_error",
                "request_too_large",
            )
        admission = self._admit(prompt, max_tokens, request.headers.get(REQUEST_ID_HEADER))
        if not admission.accepted:
            return self._too_many(admission, cost)
        try:
            await asyncio.sleep(self.limits.duration(max_tokens))
        finally:
            self._stats.in_flight -= 1
            self._stats.last_completed_at = time.time()
        self._ids += 1
        body = {
            "id": f"chatcmpl-sim-{self._ids}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"({max_tokens} simulated tokens)"},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": max_tokens, "total_tokens": cost},
        }
        return JSONResponse(body, headers=self._limit_headers(admission))

    def _admit(self, prompt: int, max_tokens: int, request_id: str | None) -> Admission:
        """Decide on one request at the moment it is complete (its body read): its arrival."""
        cost = prompt + max_tokens
        arrived = time.time()
        s = self._stats
        s.requests += 1
        admission = self._window.admit(cost, time.monotonic())
        if not admission.accepted:
            s.rate_limited += 1
            if admission.reason == "requests":
                s.rate_limited_requests += 1
            else:
                s.rate_limited_tokens += 1
            return admission
        s.accepted += 1
        s.accepted_tokens += cost
        s.prompt_tokens += prompt
        s.completion_tokens += max_tokens
        s.in_flight += 1
        s.max_in_flight = max(s.max_in_flight, s.in_flight)
        requests, tokens = self._window.in_window
        s.peak_window_requests = max(s.peak_window_requests, requests)
        s.peak_window_tokens = max(s.peak_window_tokens, tokens)
        if s.first_accepted_at is None:
            s.first_accepted_at = arrived
        s.last_accepted_at = arrived
        if request_id is not None:
            self._arrivals[request_id] = arrived
        return admission

    def _too_many(self, admission: Admission, cost: int) -> JSONResponse:
        wait_ms = max(1, math.ceil(admission.retry_after * 1000))
        limit = self.limits.requests if admission.reason == "requests" else self.limits.tokens
        headers = {
            **self._limit_headers(admission),
            "retry-after-ms": str(wait_ms),
            "retry-after": str(math.ceil(wait_ms / 1000)),
        }
        return _error(
            429,
            f"Rate limit reached for {admission.reason} per {self.limits.window:g} s: limit {limit}, "
            f"this request counts {cost if admission.reason == 'tokens' else 1}. "
            f"Please try again in {wait_ms} ms.",
            admission.reason or "requests",
            "rate_limit_exceeded",
            headers,
        )


@contextmanager
def serve_provider(limits: ProviderLimits, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve a :class:`SimulatedProvider` on a free port of ``host``; yield its base URL.

    It runs in a process of its own, as a remote provider would: in a thread
    of the caller's process it shared the caller's GIL and garbage collector,
    and a collection in a test run (a large heap) held calls up for 100-250 ms,
    which showed as network jitter. Leaving the block stops it (SIGTERM, then
    SIGKILL after a few seconds).
    """
    argv = [sys.executable, "-m", "sluice.testing.provider", json.dumps(asdict(limits)), host]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if not line.startswith("http://"):
            raise RuntimeError(
                f"the simulated provider did not start within {START_TIMEOUT_S:g} s "
                f"(exit code {proc.poll()}); run `python -m sluice.testing.provider '{{}}'` to see why"
            )
        yield line
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _serve(limits: ProviderLimits, host: str) -> None:
    """Bind a free port, print the base URL (the parent reads it), serve until SIGTERM."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    # Listening before the URL is printed: a client that connects at once finds the backlog,
    # not a refusal (uvicorn listens again on the given socket, which changes nothing).
    sock.listen(128)
    config = uvicorn.Config(
        SimulatedProvider(limits).app,
        lifespan="off",
        http="h11",
        ws="none",
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    print(f"http://{host}:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    _serve(ProviderLimits(**json.loads(sys.argv[1])), sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1")
