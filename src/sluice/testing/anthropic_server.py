"""A loopback server that speaks Anthropic's Messages API, for testing its client.

:class:`AnthropicServer`: ``POST /v1/messages`` (``x-api-key``, ``anthropic-version``,
top-level ``system``), errors as ``{"type": "error", "error": {"type": "rate_limit_error",
"message": ...}}``, ``anthropic-ratelimit-*`` headers (resets as RFC 3339 times) and a
``retry-after`` in whole seconds on 429s; 529 ``overloaded_error`` as a fault. It shares the
window, faults, prefix cache and control routes of :mod:`sluice.testing.simulated_server`;
:func:`sluice.testing.llm_servers.serve_anthropic` runs it in a process of its own.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from sluice.testing.faults import Fault
from sluice.testing.simulated_model import count_text_tokens
from sluice.testing.simulated_server import Refusal, SimulatedServer
from sluice.testing.sliding_window import Admission

ANTHROPIC_MESSAGES_PATH = "/v1/messages"
ANTHROPIC_VERSION = "2023-06-01"


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
