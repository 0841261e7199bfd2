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
in the provider's own error shape and headers (see
:class:`~sluice.testing.faults.Fault`);
``{"status": 200, "omit_usage": true}`` serves the next request with no usage
in its answer.
``GET /_control/requests`` shows the last requests received (paths, bodies,
headers without the key). With an ``api_key`` the server checks the key
header as the provider does; with ``models`` it knows only those models.

``GET /stats`` returns the counters (JSON). Limits are per window:
``rpm=6000`` is ``requests=6000, window=60``, and a benchmark uses
``requests=100, window=1`` to see the same behaviour sixty times faster.
The servers speaking Anthropic's and Gemini's protocols share all of this
(:mod:`sluice.testing.simulated_server`, its window
:mod:`sluice.testing.sliding_window`, its faults :mod:`sluice.testing.faults`, the
simulated model :mod:`sluice.testing.simulated_model`, the process
:mod:`sluice.testing.server_process`): :mod:`sluice.testing.llm_servers`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from sluice.errors import MissingExtra
from sluice.testing.faults import Fault
from sluice.testing.server_process import options_from_argv, run_app, serve_app_in_process
from sluice.testing.simulated_model import count_prompt_tokens, count_text_tokens, hashed_embedding
from sluice.testing.simulated_server import (
    DEFAULT_EMBEDDING_DIMENSIONS,
    ProviderLimits,
    Refusal,
    ServerOptions,
    SimulatedServer,
)
from sluice.testing.sliding_window import Admission

try:
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import BaseRoute, Route
except ImportError as exc:
    raise MissingExtra("testing", "the simulated LLM provider", exc.name or "starlette") from None

COMPLETIONS_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
#: The ms the provider spent on a request from its arrival to its answer (OpenAI's header).
PROCESSING_HEADER = "openai-processing-ms"
#: A client's own id for a request (OpenAI's header); the provider logs when accepted ones arrived.
REQUEST_ID_HEADER = "x-client-request-id"


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
    and a collection in a test run (a large heap) held calls up long enough
    to show as network jitter. Leaving the block stops it (SIGTERM, then
    SIGKILL after a few seconds). ``api_key``, ``models``, ``embedding_dimensions``:
    see :class:`ServerOptions`.
    """
    options = ServerOptions(None, None if models is None else tuple(models), embedding_dimensions)
    args = [json.dumps(asdict(limits)), host, options.public_json()]
    with serve_app_in_process("sluice.testing.provider", args, api_key) as url:
        yield url


if __name__ == "__main__":
    run_app(
        SimulatedProvider(ProviderLimits(**json.loads(sys.argv[1])), options_from_argv(sys.argv[3:])).app,
        sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1",
    )
