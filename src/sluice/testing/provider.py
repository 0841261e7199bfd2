"""A simulated LLM provider: a real HTTP server on loopback that rate-limits like OpenAI.

The goodput benchmark needs a provider that says no the way real ones do,
on a clock short enough for a benchmark to finish in seconds. This one
speaks the small part of the OpenAI protocol a queue's handler needs
(``POST /v1/chat/completions`` with ``model``, ``messages`` and
``max_tokens``, or ``max_completion_tokens`` as OpenAI's reasoning models
want it; the reply has ``choices`` and ``usage``; and
``POST /v1/embeddings``) and enforces two limits per window:

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
else took the room first. Answers and 429s also carry OpenAI's
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (the reset is the
time until the window is empty, as a duration like ``1.5s`` or ``6m0s``), and
completions ``openai-processing-ms`` (the time spent from the arrival).
A request larger than the token limit itself can never pass and gets 400
instead of a 429 that would be retried forever.

Accepted requests then take ``latency + latency_per_token * max_tokens``
seconds, and the simulated model always writes ``max_tokens`` tokens, so
``usage.total_tokens`` equals what the limiter counted. A prompt whose
leading messages were seen before reports them as
``usage.prompt_tokens_details.cached_tokens`` (a prefix cache, as OpenAI's).
Embeddings are a hashed bag of words, normalized: deterministic, and texts
sharing words are close. ``network_delay`` puts a network's distance between
client and provider, each way (:mod:`sluice.testing.network`).

What a client must survive is scripted, from another process:
``POST /_control/faults`` with a JSON list such as ``[{"status": 500},
{"status": 429, "retry_after_ms": 300}, {"delay": 2.0}, {"status": 401}]``
makes the next API requests fail (or wait) that way, in order, each answer
in the provider's own error shape and headers (see :class:`Fault`);
``{"status": 200, "omit_usage": true}`` serves the next request with no usage
in its answer.
``GET /_control/requests`` shows the last requests received (paths, bodies,
headers without the key). With an ``api_key`` the server checks the key
header as the provider does; with ``models`` it knows only those models.

``GET /stats`` returns the counters (JSON). Limits are per window:
``rpm=6000`` is ``requests=6000, window=60``, and a benchmark uses
``requests=100, window=1`` to see the same behaviour sixty times faster.
The servers speaking Anthropic's and Gemini's protocols share all of this:
:mod:`sluice.testing.llm_servers`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from sluice.errors import MissingExtra
from sluice.settings import environment
from sluice.testing.network import NetworkDelay, check_network_delay

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import BaseRoute, Route
    from starlette.types import ASGIApp
except ImportError as exc:
    raise MissingExtra("testing", "the simulated LLM provider", exc.name or "starlette") from None

#: Characters per token of the simulated tokenizer (OpenAI's rule of thumb for English).
CHARS_PER_TOKEN = 4
COMPLETIONS_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
STATS_PATH = "/stats"
ARRIVALS_PATH = "/arrivals"
#: POST a JSON list of faults for the next API requests (replacing any pending); GET, DELETE.
FAULTS_PATH = "/_control/faults"
#: GET the last requests received: path, body and headers (never the key).
REQUESTS_PATH = "/_control/requests"
#: The ms the provider spent on a request from its arrival to its answer (OpenAI's header).
PROCESSING_HEADER = "openai-processing-ms"
#: A client's own id for a request (OpenAI's header); the provider logs when accepted ones arrived.
REQUEST_ID_HEADER = "x-client-request-id"
#: The key a server expects, passed in its environment (a command line is visible to every user).
API_KEY_ENV = "SLUICE_TESTING_PROVIDER_KEY"
#: Headers that carry a key in one of the protocols: never recorded.
KEY_HEADERS = frozenset({"authorization", "x-api-key", "x-goog-api-key"})
DEFAULT_EMBEDDING_DIMENSIONS = 64
#: Requests kept for ``GET /_control/requests``.
REQUESTS_KEPT = 100
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


def count_text_tokens(texts: Sequence[str]) -> int:
    """Tokens of plain texts (a system prompt and message bodies) by the same rule."""
    return count_prompt_tokens([{"content": t} for t in texts])


def format_duration(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


_WORD = re.compile(r"\w+")


def hashed_embedding(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for ``text``: its words hashed into ``dimensions`` signed buckets.

    The same text always gives the same vector (in any process: blake2b, not ``hash``), and
    texts sharing words have a high cosine similarity, which is what a semantic cache's tests need.
    """
    vector = [0.0] * dimensions
    for word in _WORD.findall(text.lower()):
        digest = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
        vector[digest % dimensions] += 1.0 if digest >> 63 else -1.0
    norm = math.sqrt(sum(v * v for v in vector))
    if norm == 0.0:
        vector[0] = 1.0
        return vector
    return [v / norm for v in vector]


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


_FAULT_FIELDS = frozenset(
    {"status", "delay", "retry_after_ms", "code", "message", "headers", "body", "omit_usage"}
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One scripted misbehaviour, for one API request.

    ``delay``: seconds to wait first; alone, a slow answer that then succeeds (past a
    client's timeout, the client gives up first). ``status``: answer with that HTTP status,
    in the provider's error shape; a 429 carries the provider's retry headers saying
    ``retry_after_ms``, or none when it is None (the client must fall back). ``code``: the
    provider's error code (OpenAI's ``code``, Anthropic's ``type``, Gemini's ``status``)
    instead of the status's usual one, e.g. ``insufficient_quota``. ``message``: instead of
    the default message. ``headers``: added to the answer; None removes one the server sends.
    ``body``: with a status of 300 or more, the answer's whole body instead of the provider's
    error shape (a JSON value; a string is sent as plain text), for the odd bodies clients must
    read (a proxy's page, a message that is not a string).

    A fault with status 200 (or none) and ``omit_usage`` is a success whose answer carries no
    usage, as some proxies and compatible servers answer: ``true`` leaves the usage field out
    (OpenAI's ``usage``, Anthropic's ``usage``, Gemini's ``usageMetadata``), ``"null"`` writes
    it as null.
    """

    status: int | None = None
    delay: float = 0.0
    retry_after_ms: int | None = None
    code: str | None = None
    message: str | None = None
    headers: Mapping[str, str | None] = field(default_factory=dict)
    body: Any = None
    omit_usage: bool | str = False

    @property
    def refuses(self) -> bool:
        """Whether the request is answered by this fault (an error status), not served."""
        return self.status is not None and self.status >= 300

    @classmethod
    def parse(cls, raw: Any) -> Fault:
        """A fault from its JSON form; ValueError saying what is wrong."""
        if not isinstance(raw, dict) or not set(raw) <= _FAULT_FIELDS:
            raise ValueError(f"a fault is a JSON object with some of {sorted(_FAULT_FIELDS)}, got {raw!r}")
        fault = cls(**raw)
        status, delay, retry, headers = fault.status, fault.delay, fault.retry_after_ms, fault.headers
        if status is not None and (
            isinstance(status, bool)
            or not isinstance(status, int)
            or not (status == 200 or 300 <= status <= 599)
        ):
            raise ValueError(f"status must be 200 or an HTTP status 300-599, got {status!r}")
        if fault.omit_usage not in (False, True, "null"):
            raise ValueError(f'omit_usage must be true, false or "null", got {fault.omit_usage!r}')
        if fault.omit_usage and fault.refuses:
            raise ValueError("omit_usage shapes a success: use it with status 200 (or none)")
        if fault.body is not None and not fault.refuses:
            raise ValueError("body replaces an error answer: use it with a status of 300 or more")
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= 600:
            raise ValueError(f"delay must be 0 to 600 seconds, got {delay!r}")
        if retry is not None and (isinstance(retry, bool) or not isinstance(retry, int) or retry < 0):
            raise ValueError(f"retry_after_ms must be an integer >= 0, got {retry!r}")
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in headers.items()
        ):
            raise ValueError("headers must map header names to strings (or null to remove one)")
        return fault

    def raw_answer(self) -> Response | None:
        """The answer of a fault with a ``body`` (JSON, or plain text for a string); else None."""
        if self.body is None:
            return None
        assert self.status is not None
        if isinstance(self.body, str):
            return Response(self.body, self.status, self.apply_headers({}), media_type="text/plain")
        return JSONResponse(self.body, self.status, self.apply_headers({}))

    def shape_usage(self, reply: dict[str, Any], name: str) -> dict[str, Any]:
        """``reply`` (a success answer) without its usage field ``name`` as ``omit_usage`` says."""
        if self.omit_usage == "null":
            reply[name] = None
        elif self.omit_usage:
            reply.pop(name, None)
        return reply

    def apply_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with this fault's additions and removals."""
        out = dict(headers)
        for name, value in self.headers.items():
            if value is None:
                out.pop(name.lower(), None)
            else:
                out[name.lower()] = value
        return out


class FaultScript:
    """The faults waiting for the next API requests, in order."""

    def __init__(self) -> None:
        self._pending: deque[Fault] = deque()

    def replace(self, faults: Sequence[Fault]) -> None:
        self._pending = deque(faults)

    def pending(self) -> list[dict[str, Any]]:
        return [asdict(f) for f in self._pending]

    async def take(self) -> Fault | None:
        """The next fault after its delay, if it does more than wait (answers with an error, or
        shapes the success); None when none (or a delay only)."""
        if not self._pending:
            return None
        fault = self._pending.popleft()
        if fault.delay:
            await asyncio.sleep(fault.delay)
        return fault if fault.status is not None or fault.omit_usage else None


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
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise _BadRequest("send 'max_tokens' or 'max_completion_tokens', not both")
    if "max_completion_tokens" in body:  # what OpenAI's reasoning models want instead
        max_tokens = body["max_completion_tokens"]
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _BadRequest(
            "'max_tokens' (or 'max_completion_tokens') must be an integer >= 1 (the simulator counts "
            "it against the limit)"
        )
    return model, messages, max_tokens


def _parse_embeddings(body: Any, default_dimensions: int) -> tuple[str, list[str], int]:
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    model, texts, dimensions = (
        body.get("model"),
        body.get("input"),
        body.get("dimensions", default_dimensions),
    )
    if not isinstance(model, str) or not model:
        raise _BadRequest("'model' must be a non-empty string")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise _BadRequest("'input' must be a non-empty string or a non-empty list of non-empty strings")
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= 8192:
        raise _BadRequest("'dimensions' must be an integer from 1 to 8192")
    if body.get("encoding_format", "float") != "float":
        raise _BadRequest("the simulator only writes 'encoding_format': 'float'")
    return model, texts, dimensions


def _error(
    status: int, message: str, kind: str, code: str | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


#: status -> (type, code, message) of OpenAI's errors, for scripted faults.
_OPENAI_ERRORS: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", "invalid_request", "Invalid request (a scripted fault)."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided (a scripted fault)."),
    403: ("invalid_request_error", "unsupported_country_region_territory", "Country not supported."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist or you have no access."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests (a scripted fault)."),
    500: ("server_error", None, "The server had an error while processing your request. Sorry about that!"),
    503: ("server_error", "service_unavailable", "The engine is currently overloaded, try again later."),
}


class SimulatedProvider(SimulatedServer):
    """The OpenAI-compatible simulated provider and its ASGI app; serve it with :func:`serve_provider`."""

    def api_routes(self) -> list[BaseRoute]:
        return [
            Route(COMPLETIONS_PATH, self._completions, methods=["POST"]),
            Route(EMBEDDINGS_PATH, self._embeddings, methods=["POST"]),
        ]

    def _limit_headers(self, admission: Admission) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.limits.requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limits.requests)
            headers["x-ratelimit-remaining-requests"] = str(admission.remaining_requests)
            headers["x-ratelimit-reset-requests"] = format_duration(admission.reset_requests)
        if self.limits.tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limits.tokens)
            headers["x-ratelimit-remaining-tokens"] = str(admission.remaining_tokens)
            headers["x-ratelimit-reset-tokens"] = format_duration(admission.reset_tokens)
        return headers

    async def _accept(self, request: Request) -> tuple[Any, Fault | None]:
        """The body of an API request that passed the faults and the key check (else Refusal),
        and the fault that shapes its success answer, if any."""
        body, fault = await self.intake(request)
        if fault is not None and fault.refuses:
            raise Refusal(self._fault_answer(fault))
        auth = request.headers.get("authorization", "")
        sent = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        problem = self.key_problem(sent)
        if problem == "missing":
            raise Refusal(
                _error(
                    401,
                    "You didn't provide an API key. You need to provide your API key in an "
                    "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                    "invalid_request_error",
                    None,
                )
            )
        if problem == "wrong":
            # OpenAI masks all but a few characters of the key it echoes; this server echoes all
            # of it, so that a client which repeats the provider's message is caught leaking it.
            message = (
                f"Incorrect API key provided: {sent}. "
                "You can find your API key at https://platform.openai.com/account/api-keys."
            )
            raise Refusal(_error(401, message, "invalid_request_error", "invalid_api_key"))
        return body, fault

    def _check_model(self, model: str) -> None:
        if not self.knows(model):
            self.bad_request()
            message = f"The model `{model}` does not exist or you do not have access to it."
            raise Refusal(_error(404, message, "invalid_request_error", "model_not_found"))

    def _check_size(self, prompt: int, max_tokens: int) -> None:
        problem = self.size_problem(prompt, max_tokens)
        if problem is not None:
            raise Refusal(_error(400, problem, "invalid_request_error", "request_too_large"))

    async def _completions(self, request: Request) -> Response:
        try:
            body, fault = await self._accept(request)
            try:
                model, messages, max_tokens = _parse(body)
            except _BadRequest as exc:
                self.bad_request()
                return _error(400, f"invalid request: {exc}", "invalid_request_error", "invalid_request")
            self._check_model(model)
            prompt = count_prompt_tokens(messages)
            self._check_size(prompt, max_tokens)
            admission = self.admit(prompt, max_tokens, request.headers.get(REQUEST_ID_HEADER))
            if not admission.accepted:
                return self._too_many(admission, prompt + max_tokens)
        except Refusal as refusal:
            return refusal.response
        cached = self.prefix_cache.cached_tokens([(m["role"], m["content"]) for m in messages])
        admitted = time.monotonic()
        await self.work(max_tokens)
        reply = {
            "id": f"chatcmpl-sim-{self.next_id()}",
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
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": max_tokens,
                "total_tokens": prompt + max_tokens,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        if fault is not None:
            fault.shape_usage(reply, "usage")
        headers = self._limit_headers(admission)
        # As OpenAI's answers say it: the time the provider spent on the request, from its arrival.
        headers[PROCESSING_HEADER] = str(round((time.monotonic() - admitted) * 1000))
        return JSONResponse(reply, headers=headers)

    async def _embeddings(self, request: Request) -> Response:
        try:
            body, fault = await self._accept(request)
            try:
                model, texts, dimensions = _parse_embeddings(body, self.options.embedding_dimensions)
            except _BadRequest as exc:
                self.bad_request()
                return _error(400, f"invalid request: {exc}", "invalid_request_error", "invalid_request")
            self._check_model(model)
            tokens = sum(count_text_tokens([t]) for t in texts)
            self._check_size(tokens, 0)
            admission = self.admit(tokens, 0, request.headers.get(REQUEST_ID_HEADER))
            if not admission.accepted:
                return self._too_many(admission, tokens)
        except Refusal as refusal:
            return refusal.response
        await self.work(0)
        reply = {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": hashed_embedding(text, dimensions)}
                for i, text in enumerate(texts)
            ],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        if fault is not None:
            fault.shape_usage(reply, "usage")
        return JSONResponse(reply, headers=self._limit_headers(admission))

    def _too_many(self, admission: Admission, cost: int) -> JSONResponse:
        wait_ms = self.wait_ms(admission)
        headers = {
            **self._limit_headers(admission),
            "retry-after-ms": str(wait_ms),
            "retry-after": str(math.ceil(wait_ms / 1000)),
        }
        return _error(
            429,
            f"Rate limit reached for {admission.reason} per {self.limits.window:g} s: limit "
            f"{self.limit_of(admission)}, this request counts {cost if admission.reason == 'tokens' else 1}. "
            f"Please try again in {wait_ms} ms.",
            admission.reason or "requests",
            "rate_limit_exceeded",
            headers,
        )

    def _fault_answer(self, fault: Fault) -> Response:
        assert fault.status is not None
        raw = fault.raw_answer()
        if raw is not None:
            return raw
        kind, code, message = _OPENAI_ERRORS.get(
            fault.status,
            ("server_error" if fault.status >= 500 else "invalid_request_error", None, "A scripted fault."),
        )
        headers: dict[str, str] = {}
        if fault.status == 429 and fault.retry_after_ms is not None:
            headers = {
                "retry-after-ms": str(fault.retry_after_ms),
                "retry-after": str(math.ceil(fault.retry_after_ms / 1000)),
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": format_duration(fault.retry_after_ms / 1000),
            }
        return _error(
            fault.status, fault.message or message, kind, fault.code or code, fault.apply_headers(headers)
        )


@contextmanager
def serve_app_in_process(module: str, args: Sequence[str], api_key: str | None = None) -> Iterator[str]:
    """Run ``python -m module *args`` (a server printing its base URL first); yield that URL.

    ``api_key`` reaches the child in its environment (:data:`API_KEY_ENV`), not on its command
    line, where ``ps`` shows it to every user. Leaving the block stops the child (SIGTERM,
    then SIGKILL after a few seconds).
    """
    env = {k: v for k, v in environment().items() if k != API_KEY_ENV}
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    argv = [sys.executable, "-m", module, *args]
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if not line.startswith("http://"):
            command = " ".join(["python", "-m", module, *(f"'{a}'" for a in args)])
            raise RuntimeError(
                f"the simulated provider did not start within {START_TIMEOUT_S:g} s "
                f"(exit code {proc.poll()}); run `{command}` to see why"
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


@contextmanager
def serve_provider(
    limits: ProviderLimits,
    host: str = "127.0.0.1",
    *,
    api_key: str | None = None,
    models: Sequence[str] | None = None,
    embedding_dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
) -> Iterator[str]:
    """Serve a :class:`SimulatedProvider` on a free port of ``host``; yield its base URL.

    It runs in a process of its own, as a remote provider would: in a thread
    of the caller's process it shared the caller's GIL and garbage collector,
    and a collection in a test run (a large heap) held calls up for 100-250 ms,
    which showed as network jitter. Leaving the block stops it (SIGTERM, then
    SIGKILL after a few seconds). ``api_key``, ``models``, ``embedding_dimensions``:
    see :class:`ServerOptions`.
    """
    options = ServerOptions(None, None if models is None else tuple(models), embedding_dimensions)
    args = [json.dumps(asdict(limits)), host, options.public_json()]
    with serve_app_in_process("sluice.testing.provider", args, api_key) as url:
        yield url


def run_app(app: ASGIApp, host: str) -> None:
    """Bind a free port, print the base URL (the parent reads it), serve until SIGTERM."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    # Listening before the URL is printed: a client that connects at once finds the backlog,
    # not a refusal (uvicorn listens again on the given socket, which changes nothing).
    sock.listen(128)
    config = uvicorn.Config(
        app,
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


def options_from_argv(argv: Sequence[str]) -> ServerOptions:
    """The options a child was started with: the JSON argument, and the key from its environment."""
    text = argv[0] if argv else ServerOptions().public_json()
    return ServerOptions.from_public_json(text, environment().get(API_KEY_ENV))


if __name__ == "__main__":
    run_app(
        SimulatedProvider(ProviderLimits(**json.loads(sys.argv[1])), options_from_argv(sys.argv[3:])).app,
        sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1",
    )
