"""A loopback server that speaks Gemini's API, for testing its client.

:class:`GeminiServer`: ``POST /v1beta/models/{model}:generateContent`` and
``:batchEmbedContents`` (``x-goog-api-key``), errors as ``{"error": {"code", "status",
"message", "details"}}``; a 429 is ``RESOURCE_EXHAUSTED`` with a ``google.rpc.RetryInfo``
``retryDelay``. As Gemini does, a wrong key is a 400 ``INVALID_ARGUMENT`` whose details say
``API_KEY_INVALID``, and no key a 403 ``PERMISSION_DENIED``. It shares the window, faults,
prefix cache and control routes of :mod:`sluice.testing.simulated_server`;
:func:`sluice.testing.llm_servers.serve_gemini` runs it in a process of its own.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from sluice.testing.faults import Fault
from sluice.testing.simulated_model import count_text_tokens, hashed_embedding
from sluice.testing.simulated_server import Refusal, SimulatedServer

GEMINI_MODELS_PATH = "/v1beta/models"
#: Gemini's most texts in one batchEmbedContents call.
GEMINI_MAX_BATCH = 100
#: What the simulated Gemini writes when a request sets no maxOutputTokens.
GEMINI_DEFAULT_MAX_TOKENS = 16


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
