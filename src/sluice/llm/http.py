"""What the HTTP providers share: the client, one ``post`` that reads an answer or raises one of
the three failure kinds of :mod:`sluice.llm.provider`, and what an answer cost.

Reading an answer's rate limits and a 429's wait is :mod:`sluice.llm.limit_headers`, turning
a failed answer into an exception :mod:`sluice.llm.http_errors`, and keeping the key out of
every message :mod:`sluice.llm.keys`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import httpx

from sluice.engine.context import current_job
from sluice.errors import ConfigurationError
from sluice.llm import pricing
from sluice.llm.http_errors import error_from_response, error_from_transport
from sluice.llm.keys import Secret, safe_url
from sluice.llm.limit_headers import rate_limits, transit_ms
from sluice.llm.provider import ProviderUnavailable, RateLimits, Usage

#: LLM answers can take minutes (long outputs, reasoning models); connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
DEFAULT_MAX_CONNECTIONS = 100


def check_base_url(provider: str, base_url: str, setting: str = "base_url") -> str:
    """``base_url`` without a trailing slash; ConfigurationError unless it is an http(s) URL."""
    url = base_url.strip().rstrip("/")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ConfigurationError(f"{provider}: {setting} {safe_url(url)!r} is not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigurationError(
            f"{provider}: {setting} {safe_url(url)!r} must start with http:// or https:// and name a host, "
            "e.g. http://localhost:11434/v1"
        )
    return url


def make_client(
    base_url: str,
    headers: Mapping[str, str],
    *,
    timeout: float | httpx.Timeout | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> httpx.AsyncClient:
    """An AsyncClient for one provider: its base URL and headers, a timeout (seconds for every
    phase but connecting, which gets at most 10 s; default :data:`DEFAULT_TIMEOUT`), and at most
    ``max_connections`` connections (a worker's concurrent calls beyond that wait for one).
    Redirects are not followed: a moved API is a configuration to fix, not to guess."""
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, httpx.Timeout):
        timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(base_url=base_url, headers=dict(headers), timeout=timeout, limits=limits)


def _count_or_none(value: int | None) -> int | None:
    return value if value is not None and value >= 0 else None


def cost_of(provider: str, reported_model: str | None, model: str, usage: Usage) -> float | None:
    """What ``usage`` cost: the price of the model the answer names (a dated version, say), else
    of the model asked for; None when the pricing table knows neither, or when the answer
    reported no usage (its zeros are unknown, and a price of zero would say "free")."""
    if not usage.reported:
        return None
    price = pricing.cost(provider, reported_model, usage) if reported_model else None
    return price if price is not None else pricing.cost(provider, model, usage)


class HTTPProvider:
    """What the HTTP providers share: a name, a client, the key's whereabouts, one ``post``.

    Use one per event loop (the client's connections belong to it) and close it with
    :meth:`aclose` (or ``async with``).
    """

    def __init__(
        self,
        *,
        name: str,
        base_url: str,
        headers: Mapping[str, str],
        key: Secret | None,
        key_env: str | None,
        default_model: str | None,
        timeout: float | httpx.Timeout | None,
        max_connections: int,
    ) -> None:
        self.name = name
        self.base_url = base_url
        #: the model to use when the caller has no preference (``provider_from_env`` sets it)
        self.default_model = default_model
        self._key = key
        self._key_env = key_env
        self._client = make_client(base_url, headers, timeout=timeout, max_connections=max_connections)

    def __repr__(self) -> str:
        key = f"from {self._key_env}" if self._key is not None else "none"
        return f"{type(self).__name__}(name={self.name!r}, base_url={self.base_url!r}, key={key})"

    async def post(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        headers: Mapping[str, str] | None = None,
        model: str,
        paced: bool = True,
    ) -> tuple[dict[str, Any], RateLimits]:
        """POST ``body`` as JSON to ``path``; the answer's JSON object and rate limits, or one of
        the three provider errors. ``paced``: the call a job was dispatched for (a completion, not
        an embedding on the way): the running job notes it leaving (JobContext.note_sent)."""
        secrets = [self._key] if self._key is not None else []
        request = self._client.build_request("POST", path, json=body, headers=headers)
        job = current_job() if paced else None
        # Only the attempt's first call is the one its dispatch counted: it alone is reported
        # (the pacer's measured headroom, engine/lag.py; the provider's view, provider_view.py).
        if job is not None and not job.note_sent():
            job = None
        sent = time.monotonic()
        try:
            response = await self._client.send(request)
        except httpx.HTTPError as exc:
            raise error_from_transport(self.name, exc, request, secrets) from None
        if not response.is_success:
            raise error_from_response(
                self.name, response, secrets=secrets, key_env=self._key_env, model=model
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise self.unexpected(path, "the body is not a JSON object")
        limits = rate_limits(response.headers)
        if job is not None:
            # (a negative figure, which some servers send, is taken as not said: reporting
            # must never fail a call that was served)
            job.note_provider_limits(
                limit_requests=_count_or_none(limits.limit_requests),
                remaining_requests=_count_or_none(limits.remaining_requests),
                limit_tokens=_count_or_none(limits.limit_tokens),
                remaining_tokens=_count_or_none(limits.remaining_tokens),
                transit_ms=transit_ms(response.headers, (time.monotonic() - sent) * 1000),
            )
        return data, limits

    def unexpected(self, path: str, what: str) -> ProviderUnavailable:
        """A success answer we cannot read (a proxy's page, an incompatible server): retried."""
        return ProviderUnavailable(
            self.name,
            f"the answer to POST {safe_url(self.base_url + path)} is a success, but {what}; is "
            f"{safe_url(self.base_url)} the API of {self.name}?",
            200,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
