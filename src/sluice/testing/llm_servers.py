"""Loopback servers that speak Anthropic's and Gemini's protocols, for testing their clients.

Like the OpenAI-compatible :mod:`sluice.testing.provider` (whose window, faults, prefix cache,
control routes and process plumbing they share), each is a real HTTP server in a process of
its own, answering the small part of its provider's API a queue needs, in that provider's
shapes:

* :class:`AnthropicServer`: ``POST /v1/messages`` (``x-api-key``, ``anthropic-version``,
  top-level ``system``), errors as ``{"type": "error", "error": {"type": "rate_limit_error",
  "message": ...}}``, ``anthropic-ratelimit-*`` headers (resets as RFC 3339 times) and a
  ``retry-after`` in whole seconds on 429s; 529 ``overloaded_error`` as a fault.
* :class:`GeminiServer`: ``POST /v1beta/models/{model}:generateContent`` and
  ``:batchEmbedContents`` (``x-goog-api-key``), errors as ``{"error": {"code", "status",
  "message", "details"}}``; a 429 is ``RESOURCE_EXHAUSTED`` with a ``google.rpc.RetryInfo``
  ``retryDelay``. As Gemini does, a wrong key is a 400 ``INVALID_ARGUMENT`` whose details say
  ``API_KEY_INVALID``, and no key a 403 ``PERMISSION_DENIED``.

Start them with :func:`serve_anthropic` / :func:`serve_gemini`; script faults through
``POST /_control/faults`` (:class:`~sluice.testing.provider.Fault`).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from sluice.testing.provider import (
    DEFAULT_EMBEDDING_DIMENSIONS,
    Admission,
    Fault,
    ProviderLimits,
    Refusal,
    ServerOptions,
    SimulatedServer,
    count_text_tokens,
    hashed_embedding,
    options_from_argv,
    run_app,
    serve_app_in_process,
)

ANTHROPIC_MESSAGES_PATH = "/v1/messages"
ANTHROPIC_VERSION = "2023-06-01"
GEMINI_MODELS_PATH = "/v1beta/models"
#: Gemini's most texts in one batchEmbedContents call.
GEMINI_MAX_BATCH = 100
#: What the simulated Gemini writes when a request sets no maxOutputTokens.
GEMINI_DEFAULT_MAX_TOKENS = 16


def rfc3339_in(seconds: float) -> str:
    """The UTC time ``seconds`` from now as Anthropic's reset headers write it."""
    at = datetime.now(UTC) + timedelta(seconds=seconds)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _text_blocks(value: Any, where: str) -> str:
    """The text of a string or of a list of ``{"type": "text", "text": ...}`` blocks."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        texts = [b.get("text") for b in value if isinstance(b, dict) and b.get("type") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if isinstance(t, str))
    raise ValueError(f"{where}: expected a string or a list of text blocks")


# ---- Anthropic ---------------------------------------------------------------------------------


def _anthropic_error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Response:
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


#: status -> (error type, message) of Anthropic's errors, for scripted faults.
_ANTHROPIC_ERRORS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "A scripted invalid request."),
    401: ("authentication_error", "invalid x-api-key"),
    403: ("permission_error", "Your API key does not have permission to use the specified resource."),
    404: ("not_found_error", "The requested resource could not be found."),
    413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
    429: ("rate_limit_error", "Number of requests has exceeded your rate limit (a scripted fault)."),
    500: ("api_error", "Internal server error"),
    529: ("overloaded_error", "Overloaded"),
}


def _parse_anthropic(body: Any) -> tuple[str, str | None, list[tuple[str, str]], int]:
    """(model, system, [(role, text)], max_tokens) of a Messages request; ValueError if invalid."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    model, max_tokens, messages = body.get("model"), body.get("max_tokens"), body.get("messages")
    if not isinstance(model, str) or not model:
        raise ValueError("model: Field required")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("max_tokens: Field required (an integer >= 1)")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: at least one message is required")
    turns: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "system":
            raise ValueError(
                'messages: Unexpected role "system". The Messages API accepts a top-level `system` '
                'parameter, not "system" as an input message role.'
            )
        if role not in ("user", "assistant"):
            raise ValueError(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        turns.append((role, _text_blocks(m.get("content"), f"messages.{i}.content")))
    system = body.get("system")
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float) or not 0 <= temperature <= 1):
        raise ValueError("temperature: range: 0..1")
    return model, None if system is None else _text_blocks(system, "system"), turns, max_tokens


class AnthropicServer(SimulatedServer):
    """A simulated Anthropic Messages API: its shapes, headers, key check and errors."""

    def api_routes(self) -> list[BaseRoute]:
        return [Route(ANTHROPIC_MESSAGES_PATH, self._messages, methods=["POST"])]

    def _limit_headers(self, admission: Admission) -> dict[str, str]:
        headers: dict[str, str] = {}
        for name, limit, remaining, reset in (
            ("requests", self.limits.requests, admission.remaining_requests, admission.reset_requests),
            ("tokens", self.limits.tokens, admission.remaining_tokens, admission.reset_tokens),
        ):
            if limit is not None:
                headers[f"anthropic-ratelimit-{name}-limit"] = str(limit)
                headers[f"anthropic-ratelimit-{name}-remaining"] = str(remaining)
                headers[f"anthropic-ratelimit-{name}-reset"] = rfc3339_in(reset)
        return headers

    async def _accept(self, request: Request) -> tuple[Any, Fault | None]:
        body, fault = await self.intake(request)
        if fault is not None and fault.refuses:
            raise Refusal(self._fault_answer(fault))
        problem = self.key_problem(request.headers.get("x-api-key"))
        if problem is not None:
            message = "x-api-key header is required" if problem == "missing" else "invalid x-api-key"
            raise Refusal(_anthropic_error(401, "authentication_error", message))
        if "anthropic-version" not in request.headers:
            raise Refusal(
                _anthropic_error(400, "invalid_request_error", "anthropic-version: header is required")
            )
        return body, fault

    async def _messages(self, request: Request) -> Response:
        try:
            body, fault = await self._accept(request)
            try:
                model, system, turns, max_tokens = _parse_anthropic(body)
            except ValueError as exc:
                self.bad_request()
                return _anthropic_error(400, "invalid_request_error", str(exc))
            if not self.knows(model):
                self.bad_request()
                return _anthropic_error(404, "not_found_error", f"model: {model}")
            texts = ([system] if system else []) + [text for _, text in turns]
            prompt = count_text_tokens(texts)
            too_large = self.size_problem(prompt, max_tokens)
            if too_large is not None:
                return _anthropic_error(400, "invalid_request_error", too_large)
            admission = self.admit(prompt, max_tokens, None)
            if not admission.accepted:
                return self._too_many(admission)
        except Refusal as refusal:
            return refusal.response
        parts = ([("system", system)] if system else []) + turns
        cached = self.prefix_cache.cached_tokens(parts)
        await self.work(max_tokens)
        reply = {
            "id": f"msg_sim_{self.next_id()}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": f"({max_tokens} simulated tokens)"}],
            "stop_reason": "max_tokens",
            "stop_sequence": None,
            # Anthropic's input_tokens leaves out what the cache read (and wrote).
            "usage": {
                "input_tokens": prompt - cached,
                "output_tokens": max_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
            },
        }
        if fault is not None:
            fault.shape_usage(reply, "usage")
        return JSONResponse(reply, headers=self._limit_headers(admission))

    def _too_many(self, admission: Admission) -> Response:
        wait_ms = self.wait_ms(admission)
        headers = {**self._limit_headers(admission), "retry-after": str(math.ceil(wait_ms / 1000))}
        message = (
            f"This request would exceed the rate limit for your organization of {self.limit_of(admission)} "
            f"{admission.reason} per {self.limits.window:g} s."
        )
        return _anthropic_error(429, "rate_limit_error", message, headers)

    def _fault_answer(self, fault: Fault) -> Response:
        assert fault.status is not None
        raw = fault.raw_answer()
        if raw is not None:
            return raw
        kind, message = _ANTHROPIC_ERRORS.get(
            fault.status,
            ("api_error" if fault.status >= 500 else "invalid_request_error", "A scripted fault."),
        )
        headers: dict[str, str] = {}
        if fault.status == 429 and fault.retry_after_ms is not None:
            reset = rfc3339_in(fault.retry_after_ms / 1000)
            headers = {
                "retry-after": str(math.ceil(fault.retry_after_ms / 1000)),
                "anthropic-ratelimit-requests-remaining": "0",
                "anthropic-ratelimit-requests-reset": reset,
            }
        return _anthropic_error(
            fault.status, fault.code or kind, fault.message or message, fault.apply_headers(headers)
        )


# ---- Gemini ------------------------------------------------------------------------------------


def _gemini_error(
    code: int,
    status: str,
    message: str,
    details: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    error: dict[str, Any] = {"code": code, "message": message, "status": status}
    if details:
        error["details"] = details
    return JSONResponse({"error": error}, status_code=code, headers=headers)


def _retry_info(ms: int) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": f"{ms / 1000:g}s"}


#: status -> (status name, message) of Google's errors, for scripted faults.
_GEMINI_ERRORS: dict[int, tuple[str, str]] = {
    400: ("INVALID_ARGUMENT", "Request contains an invalid argument."),
    401: ("UNAUTHENTICATED", "Request had invalid authentication credentials."),
    403: ("PERMISSION_DENIED", "The caller does not have permission"),
    404: ("NOT_FOUND", "Requested entity was not found."),
    429: ("RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota)."),
    500: ("INTERNAL", "An internal error has occurred. Please retry or report the problem."),
    503: ("UNAVAILABLE", "The model is overloaded. Please try again later."),
    504: ("DEADLINE_EXCEEDED", "Deadline expired before operation could complete."),
}
_GENERATE_FIELDS = frozenset(
    {"contents", "systemInstruction", "generationConfig", "safetySettings", "tools", "toolConfig"}
)
_GENERATION_CONFIG_FIELDS = frozenset(
    {"maxOutputTokens", "temperature", "topP", "topK", "stopSequences", "candidateCount", "seed"}
)


def _parts_text(content: Any, where: str) -> str:
    parts = content.get("parts") if isinstance(content, dict) else None
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
        raise ValueError(f"* {where}.parts: must be a non-empty list")
    texts = [p.get("text") for p in parts]
    if not all(isinstance(t, str) for t in texts):
        raise ValueError(f"* {where}.parts: the simulator reads text parts only")
    return "".join(t for t in texts if isinstance(t, str))


def _parse_generation_config(config: Any) -> int:
    if not isinstance(config, dict):
        raise ValueError("* GenerateContentRequest.generation_config: must be an object")
    unknown = sorted(set(config) - _GENERATION_CONFIG_FIELDS)
    if unknown:
        raise ValueError(f'Invalid JSON payload received. Unknown name "{unknown[0]}": Cannot find field.')
    max_tokens = config.get("maxOutputTokens", GEMINI_DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("* GenerateContentRequest.generation_config.max_output_tokens: must be >= 1")
    return max_tokens


def _parse_generate(body: Any) -> tuple[str | None, list[tuple[str, str]], int]:
    """(system, [(role, text)], max output tokens) of a generateContent request; ValueError."""
    if not isinstance(body, dict):
        raise ValueError("Invalid JSON payload received: the body must be an object.")
    unknown = sorted(set(body) - _GENERATE_FIELDS)
    if unknown:
        raise ValueError(f'Invalid JSON payload received. Unknown name "{unknown[0]}": Cannot find field.')
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise ValueError("* GenerateContentRequest.contents: contents is not specified")
    turns: list[tuple[str, str]] = []
    for i, content in enumerate(contents):
        role = content.get("role", "user") if isinstance(content, dict) else None
        if role not in ("user", "model"):
            raise ValueError("Please use a valid role: user, model.")
        turns.append((role, _parts_text(content, f"GenerateContentRequest.contents[{i}]")))
    instruction = body.get("systemInstruction")
    system = (
        None if instruction is None else _parts_text(instruction, "GenerateContentRequest.system_instruction")
    )
    return system, turns, _parse_generation_config(body.get("generationConfig", {}))


def _parse_batch_embed(body: Any, model: str, default_dimensions: int) -> list[tuple[str, int]]:
    """[(text, dimensions)] of a batchEmbedContents request for ``model``; ValueError."""
    requests = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(requests, list) or not requests:
        raise ValueError("* BatchEmbedContentsRequest.requests: requests is not specified")
    if len(requests) > GEMINI_MAX_BATCH:
        raise ValueError(
            f"* BatchEmbedContentsRequest.requests: at most {GEMINI_MAX_BATCH} requests can be in one batch"
        )
    out: list[tuple[str, int]] = []
    for i, item in enumerate(requests):
        where = f"BatchEmbedContentsRequest.requests[{i}]"
        if not isinstance(item, dict) or item.get("model") != f"models/{model}":
            raise ValueError(f"* {where}.model: must be models/{model}, the model of the URL")
        dimensions = item.get("outputDimensionality", default_dimensions)
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= 8192:
            raise ValueError(f"* {where}.output_dimensionality: must be 1 to 8192")
        out.append((_parts_text(item.get("content"), f"{where}.content"), dimensions))
    return out


class GeminiServer(SimulatedServer):
    """A simulated Gemini API (generateContent, batchEmbedContents): its shapes, key check, errors."""

    def api_routes(self) -> list[BaseRoute]:
        return [Route(GEMINI_MODELS_PATH + "/{target}", self._models, methods=["POST"])]

    async def _accept(self, request: Request) -> tuple[Any, Fault | None]:
        body, fault = await self.intake(request)
        if fault is not None and fault.refuses:
            raise Refusal(self._fault_answer(fault))
        problem = self.key_problem(request.headers.get("x-goog-api-key") or request.query_params.get("key"))
        if problem == "missing":
            message = (
                "Method doesn't allow unregistered callers (callers without established identity). "
                "Please use API Key or other form of API consumer identity to call this API."
            )
            raise Refusal(_gemini_error(403, "PERMISSION_DENIED", message))
        if problem == "wrong":
            info = {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "API_KEY_INVALID",
                "domain": "googleapis.com",
                "metadata": {"service": "generativelanguage.googleapis.com"},
            }
            message = "API key not valid. Please pass a valid API key."
            raise Refusal(_gemini_error(400, "INVALID_ARGUMENT", message, [info]))
        return body, fault

    async def _models(self, request: Request) -> Response:
        model, _, method = str(request.path_params["target"]).rpartition(":")
        try:
            body, fault = await self._accept(request)
            if method not in ("generateContent", "batchEmbedContents") or not self.knows(model):
                self.bad_request()
                message = (
                    f"models/{model} is not found for API version v1beta, or is not supported for "
                    f"{method}. Call ListModels to see the list of available models and their "
                    "supported methods."
                )
                return _gemini_error(404, "NOT_FOUND", message)
            if method == "generateContent":
                return await self._generate(model, body, fault)
            return await self._embed(model, body)
        except Refusal as refusal:
            return refusal.response

    def _admit_or_refuse(self, prompt: int, max_tokens: int) -> None:
        too_large = self.size_problem(prompt, max_tokens)
        if too_large is not None:
            raise Refusal(_gemini_error(400, "INVALID_ARGUMENT", too_large))
        admission = self.admit(prompt, max_tokens, None)
        if not admission.accepted:
            wait_ms = self.wait_ms(admission)
            quota = {
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [
                    {
                        "quotaMetric": f"generativelanguage.googleapis.com/{admission.reason}",
                        "quotaValue": str(self.limit_of(admission)),
                    }
                ],
            }
            message = (
                f"You exceeded your current quota of {self.limit_of(admission)} {admission.reason} per "
                f"{self.limits.window:g} s. Please retry in {wait_ms / 1000:g}s."
            )
            raise Refusal(_gemini_error(429, "RESOURCE_EXHAUSTED", message, [quota, _retry_info(wait_ms)]))

    async def _generate(self, model: str, body: Any, fault: Fault | None = None) -> Response:
        try:
            system, turns, max_tokens = _parse_generate(body)
        except ValueError as exc:
            self.bad_request()
            return _gemini_error(400, "INVALID_ARGUMENT", str(exc))
        prompt = count_text_tokens(([system] if system else []) + [text for _, text in turns])
        self._admit_or_refuse(prompt, max_tokens)
        parts = ([("system", system)] if system else []) + turns
        cached = self.prefix_cache.cached_tokens(parts)
        await self.work(max_tokens)
        usage = {
            "promptTokenCount": prompt,
            "candidatesTokenCount": max_tokens,
            "totalTokenCount": prompt + max_tokens,
        }
        if cached:
            usage["cachedContentTokenCount"] = cached  # Gemini leaves it out when nothing was cached
        reply = {
            "candidates": [
                {
                    "content": {"parts": [{"text": f"({max_tokens} simulated tokens)"}], "role": "model"},
                    "finishReason": "MAX_TOKENS",
                    "index": 0,
                }
            ],
            "usageMetadata": usage,
            "modelVersion": model,
            "responseId": f"sim-{self.next_id()}",
        }
        if fault is not None:
            fault.shape_usage(reply, "usageMetadata")
        return JSONResponse(reply)

    async def _embed(self, model: str, body: Any) -> Response:
        try:
            items = _parse_batch_embed(body, model, self.options.embedding_dimensions)
        except ValueError as exc:
            self.bad_request()
            return _gemini_error(400, "INVALID_ARGUMENT", str(exc))
        self._admit_or_refuse(sum(count_text_tokens([text]) for text, _ in items), 0)
        await self.work(0)
        # Gemini's batchEmbedContents reports no usage.
        return JSONResponse({"embeddings": [{"values": hashed_embedding(t, d)} for t, d in items]})

    def _fault_answer(self, fault: Fault) -> Response:
        assert fault.status is not None
        raw = fault.raw_answer()
        if raw is not None:
            return raw
        status, message = _GEMINI_ERRORS.get(
            fault.status, ("INTERNAL" if fault.status >= 500 else "FAILED_PRECONDITION", "A scripted fault.")
        )
        details = None
        if fault.status == 429 and fault.retry_after_ms is not None:
            details = [_retry_info(fault.retry_after_ms)]
        return _gemini_error(
            fault.status, fault.code or status, fault.message or message, details, fault.apply_headers({})
        )


# ---- processes ---------------------------------------------------------------------------------

SERVERS: dict[str, type[SimulatedServer]] = {"anthropic": AnthropicServer, "gemini": GeminiServer}


@contextmanager
def _serve(
    kind: str,
    limits: ProviderLimits | None,
    host: str,
    api_key: str | None,
    models: Sequence[str] | None,
    embedding_dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
) -> Iterator[str]:
    options = ServerOptions(None, None if models is None else tuple(models), embedding_dimensions)
    args = [kind, json.dumps(asdict(limits or ProviderLimits())), host, options.public_json()]
    with serve_app_in_process("sluice.testing.llm_servers", args, api_key) as url:
        yield url


@contextmanager
def serve_anthropic(
    limits: ProviderLimits | None = None,
    host: str = "127.0.0.1",
    *,
    api_key: str | None = None,
    models: Sequence[str] | None = None,
) -> Iterator[str]:
    """Serve an :class:`AnthropicServer` in a process of its own; yield its base URL (the API is
    at ``{url}/v1/messages``). ``limits``: none by default; ``api_key``: the ``x-api-key`` it
    wants (None: any); ``models``: the models it knows (None: any)."""
    with _serve("anthropic", limits, host, api_key, models) as url:
        yield url


@contextmanager
def serve_gemini(
    limits: ProviderLimits | None = None,
    host: str = "127.0.0.1",
    *,
    api_key: str | None = None,
    models: Sequence[str] | None = None,
    embedding_dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
) -> Iterator[str]:
    """Serve a :class:`GeminiServer` in a process of its own; yield its base URL (the API is at
    ``{url}/v1beta/models/...``). Options as :func:`serve_anthropic`, and the embeddings'
    length unless a request sets ``outputDimensionality``."""
    with _serve("gemini", limits, host, api_key, models, embedding_dimensions) as url:
        yield url


if __name__ == "__main__":
    server = SERVERS[sys.argv[1]](ProviderLimits(**json.loads(sys.argv[2])), options_from_argv(sys.argv[4:]))
    run_app(server.app, sys.argv[3])
