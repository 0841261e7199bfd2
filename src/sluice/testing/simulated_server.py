"""What the simulated providers share: their limits and options, the window and its counters,
scripted faults, the prefix cache, the record of requests, and the control routes.

``GET /stats`` returns the counters (JSON); ``GET /arrivals`` when accepted requests that sent
an id arrived; ``POST /_control/faults`` scripts faults (:mod:`sluice.testing.faults`);
``GET /_control/requests`` shows the last requests received (paths, bodies, headers without
the key). With an ``api_key`` a server checks the key header as the provider does; with
``models`` it knows only those models. A protocol is a subclass:
:class:`~sluice.testing.provider.SimulatedProvider` (OpenAI's),
:mod:`sluice.testing.llm_servers` (Anthropic's and Gemini's).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sluice.errors import MissingExtra
from sluice.testing.faults import Fault, FaultScript
from sluice.testing.network import NetworkDelay, check_network_delay
from sluice.testing.simulated_model import CHARS_PER_TOKEN
from sluice.testing.sliding_window import Admission, SlidingWindow

try:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import BaseRoute, Route
    from starlette.types import ASGIApp
except ImportError as exc:
    raise MissingExtra("testing", "the simulated LLM provider", exc.name or "starlette") from None

STATS_PATH = "/stats"
ARRIVALS_PATH = "/arrivals"
#: POST a JSON list of faults for the next API requests (replacing any pending); GET, DELETE.
FAULTS_PATH = "/_control/faults"
#: GET the last requests received: path, body and headers (never the key).
REQUESTS_PATH = "/_control/requests"
#: Headers that carry a key in one of the protocols: never recorded.
KEY_HEADERS = frozenset({"authorization", "x-api-key", "x-goog-api-key"})
DEFAULT_EMBEDDING_DIMENSIONS = 64
#: Requests kept for ``GET /_control/requests``.
REQUESTS_KEPT = 100


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """What the provider allows and how slow it is.

    ``requests`` / ``tokens``: accepted per ``window`` seconds (None: no
    such limit). ``latency``: seconds every accepted request takes, plus
    ``latency_per_token`` per completion token. ``count_rejected``: a
    refused request still takes a place in the request window, as OpenAI
    documents ("unsuccessful requests contribute to your per-minute limit"),
    so that resending at once keeps the window full; by default only
    accepted requests count. ``network_delay``: seconds each way between
    client and provider (:class:`~sluice.testing.network.NetworkDelay`): a
    request reaches the limiter that much after it was sent, and its answer
    (a 429 too) leaves that much before the client has it; 0 to 10.
    """

    requests: int | None = None
    tokens: int | None = None
    window: float = 60.0
    latency: float = 0.0
    latency_per_token: float = 0.0
    count_rejected: bool = False
    network_delay: float = 0.0

    def __post_init__(self) -> None:
        for name, limit in (("requests", self.requests), ("tokens", self.tokens)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {limit!r}")
        if not (math.isfinite(self.window) and self.window > 0):
            raise ValueError(f"window must be > 0 seconds, got {self.window!r}")
        for name, value in (("latency", self.latency), ("latency_per_token", self.latency_per_token)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        check_network_delay(self.network_delay)

    def duration(self, completion_tokens: int) -> float:
        """Seconds an accepted request with this many completion tokens takes."""
        return self.latency + self.latency_per_token * completion_tokens


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What a simulated server checks besides its limits.

    ``api_key``: the key its key header must carry (None: any or none). ``models``: the models
    it knows (None: any name). ``embedding_dimensions``: the vectors' length unless a request
    asks for another.
    """

    api_key: str | None = field(default=None, repr=False)
    models: tuple[str, ...] | None = None
    embedding_dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS

    def __post_init__(self) -> None:
        if isinstance(self.embedding_dimensions, bool) or not (
            isinstance(self.embedding_dimensions, int) and 1 <= self.embedding_dimensions <= 8192
        ):
            raise ValueError(f"embedding_dimensions must be 1 to 8192, got {self.embedding_dimensions!r}")

    def public_json(self) -> str:
        """Everything but the key, for a command line (the key goes in the environment)."""
        return json.dumps({"models": self.models, "embedding_dimensions": self.embedding_dimensions})

    @classmethod
    def from_public_json(cls, text: str, api_key: str | None) -> ServerOptions:
        data = json.loads(text)
        models = data.get("models")
        return cls(api_key, None if models is None else tuple(models), data["embedding_dimensions"])


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
    #: requests answered by a scripted fault (not counted in ``requests``)
    faults: int = 0
    #: requests refused for a missing or wrong key (not counted in ``requests``)
    unauthorized: int = 0


class PrefixCache:
    """Which leading messages of a prompt were seen before: the part a provider's cache serves.

    Keyed by a running hash of the turns; the last never counts (a cache serves a
    prefix, and the last message is the new part). Bounded: forgets all past ``size`` entries.
    """

    def __init__(self, size: int = 100_000) -> None:
        self._seen: set[bytes] = set()
        self._size = size

    def cached_tokens(self, turns: Sequence[tuple[str, str]]) -> int:
        """Tokens of the longest prefix of ``turns[:-1]`` (role, text) seen before, rounded down (never
        more than the prompt's tokens: only the texts count), then remember those prefixes."""
        running = hashlib.blake2b(digest_size=16)
        keys: list[bytes] = []
        chars = cached_chars = 0
        for role, text in turns[:-1]:
            running.update(f"{len(role)}:{role}{len(text)}:".encode() + text.encode())
            chars += len(text)
            keys.append(running.digest())
            if keys[-1] in self._seen:
                cached_chars = chars
        if len(self._seen) + len(keys) > self._size:
            self._seen.clear()
        self._seen.update(keys)
        return cached_chars // CHARS_PER_TOKEN


class Refusal(Exception):
    """Raised inside a handler to answer at once with ``response`` (an error in the protocol's shape)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class SimulatedServer:
    """What the simulated providers share: the sliding window and its counters, scripted faults,
    the prefix cache, the record of requests, and the control routes.

    A subclass speaks one protocol: it lists its routes (:meth:`api_routes`) and answers in
    its shapes. Everything runs on one event loop: admission has no await between its check
    and its record, so concurrent requests are decided one at a time, in arrival order.
    """

    def __init__(self, limits: ProviderLimits, options: ServerOptions | None = None) -> None:
        self.limits = limits
        self.options = options or ServerOptions()
        self.faults = FaultScript()
        self.prefix_cache = PrefixCache()
        self._window = SlidingWindow(limits.requests, limits.tokens, limits.window, limits.count_rejected)
        self._stats = ProviderStats()
        self._ids = 0
        self._arrivals: dict[str, float] = {}
        self._requests: deque[dict[str, Any]] = deque(maxlen=REQUESTS_KEPT)
        routes = Starlette(
            routes=[
                *self.api_routes(),
                Route(STATS_PATH, self._stats_endpoint, methods=["GET"]),
                Route(ARRIVALS_PATH, self._arrivals_endpoint, methods=["GET"]),
                Route(FAULTS_PATH, self._faults_endpoint, methods=["GET", "POST", "DELETE"]),
                Route(REQUESTS_PATH, self._requests_endpoint, methods=["GET"]),
            ]
        )
        #: the server as a client reaches it: through the network's delay, if any
        self.app: ASGIApp = NetworkDelay(routes, limits.network_delay) if limits.network_delay else routes

    def api_routes(self) -> list[BaseRoute]:
        """The protocol's routes."""
        raise NotImplementedError

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

    async def _faults_endpoint(self, request: Request) -> JSONResponse:
        if request.method == "POST":
            try:
                raw = await request.json()
                if not isinstance(raw, list):
                    raise ValueError("the body must be a JSON list of faults")
                self.faults.replace([Fault.parse(f) for f in raw])
            except (ValueError, TypeError) as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
        elif request.method == "DELETE":
            self.faults.replace([])
        return JSONResponse({"pending": self.faults.pending()})

    async def _requests_endpoint(self, _request: Request) -> JSONResponse:
        return JSONResponse(list(self._requests))

    async def intake(self, request: Request) -> tuple[Any, Fault | None]:
        """Read the JSON body (None if it is not JSON), record the request, take the next fault
        (one that refuses, :attr:`Fault.refuses`, or one that shapes the success answer)."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        self._requests.append(
            {
                "method": request.method,
                "path": request.url.path,
                "headers": {k: v for k, v in request.headers.items() if k not in KEY_HEADERS},
                "body": body,
            }
        )
        fault = await self.faults.take()
        if fault is not None and fault.refuses:
            self._stats.faults += 1
        return body, fault

    def key_problem(self, sent: str | None) -> str | None:
        """None when the key sent is right (or none is expected); else "missing" or "wrong"."""
        expected = self.options.api_key
        if expected is None or sent == expected:
            return None
        self._stats.unauthorized += 1
        return "missing" if not sent else "wrong"

    def knows(self, model: str) -> bool:
        return self.options.models is None or model in self.options.models

    def bad_request(self) -> None:
        """Count a request refused for its content."""
        self._stats.requests += 1
        self._stats.bad_requests += 1

    def size_problem(self, prompt: int, max_tokens: int) -> str | None:
        """Why a request can never fit the token limit, or None."""
        cost = prompt + max_tokens
        if self.limits.tokens is None or cost <= self.limits.tokens:
            return None
        self.bad_request()
        return (
            f"request too large: {cost} tokens (prompt {prompt} + max_tokens {max_tokens}) can never "
            f"fit the limit of {self.limits.tokens} tokens per {self.limits.window:g} s; send less"
        )

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def admit(self, prompt: int, max_tokens: int, request_id: str | None) -> Admission:
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

    async def work(self, completion_tokens: int) -> None:
        """Take the time an accepted request takes; it is in flight until then."""
        try:
            await asyncio.sleep(self.limits.duration(completion_tokens))
        finally:
            self._stats.in_flight -= 1
            self._stats.last_completed_at = time.time()

    @staticmethod
    def wait_ms(admission: Admission) -> int:
        """The refusal's wait in whole milliseconds, rounded up, at least 1."""
        return max(1, math.ceil(admission.retry_after * 1000))

    def limit_of(self, admission: Admission) -> int | None:
        return self.limits.requests if admission.reason == "requests" else self.limits.tokens
