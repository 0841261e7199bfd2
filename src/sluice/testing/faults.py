"""Scripted faults: what a client of a simulated provider must survive, in order.

``POST /_control/faults`` with a JSON list such as ``[{"status": 500}, {"status": 429,
"retry_after_ms": 300}, {"delay": 2.0}, {"status": 401}]`` makes the next API requests fail
(or wait) that way, each answer in the provider's own error shape and headers (see
:class:`Fault`); ``{"status": 200, "omit_usage": true}`` serves the next request with no usage
in its answer.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sluice.errors import MissingExtra

try:
    from starlette.responses import JSONResponse, Response
except ImportError as exc:
    raise MissingExtra("testing", "the simulated LLM provider", exc.name or "starlette") from None


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
