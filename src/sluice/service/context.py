"""What every route needs: the engine queue, the store, the caller; as FastAPI dependencies."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from sluice.service.burn import BurnTracker
from sluice.service.errors import ApiError
from sluice.service.pressure import PressureGauge
from sluice.service.ratelimit import RateLimiter
from sluice.store.keys import ApiKey, KeyStore, digest

if TYPE_CHECKING:
    from sluice.engine.queue import Queue
    from sluice.service.config import ServiceSettings
    from sluice.service.submit import Intake
    from sluice.store.database import Database
    from sluice.store.jobs import JobStore
    from sluice.store.ledger import BudgetLedger

#: The tenant of every caller when the service runs without authentication (``sluice dev``).
DEFAULT_TENANT = "default"


@dataclass
class Services:
    """The service's parts, made once at start (``create_app``'s lifespan)."""

    settings: ServiceSettings
    #: False only under ``sluice dev``: every caller is then the default tenant's admin
    auth: bool
    queue: Queue
    db: Database
    store: JobStore
    keys: KeyStore
    pressure: PressureGauge
    limiter: RateLimiter
    ledger: BudgetLedger
    intake: Intake
    #: digest -> (key or None, when the answer was read): a revoked key works for at most
    #: KEY_CACHE_SECONDS more, and a request costs no database read
    key_cache: dict[str, tuple[ApiKey | None, float]] = field(default_factory=dict)
    #: what ``metrics.py`` keeps between scrapes (the budgets' names)
    metrics_cache: dict[str, Any] = field(default_factory=dict)
    #: budgets' charged counters sampled over time: their burn rates (``burn.py``)
    burn: BurnTracker = field(default_factory=BurnTracker)
    #: live streams open now (``routes_live.py``)
    live_streams: int = 0


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the tenant whose jobs they see, and whether they may administer."""

    tenant: str
    admin: bool


async def services(request: Request) -> Services:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop per use
    found: Services | None = getattr(request.app.state, "services", None)
    if found is None:
        raise ApiError(503, "the service is starting; try again shortly")
    return found


#: The scope-state key set on a request its key's rate limit refused (``metrics.py`` tells
#: that 429 from backpressure's).
REFUSED = "sluice_refused"

#: How long a key's lookup is remembered.
KEY_CACHE_SECONDS = 30.0
_KEY_CACHE_MAX = 10_000


# Declared as security schemes, so /openapi.json tells clients how to authenticate; read
# without auto_error, so that a missing key is our own 401 in the one error shape.
_bearer = HTTPBearer(auto_error=False, description="An API key: sluice keys create --tenant T")
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="The same key, in this header")


async def caller(
    request: Request,
    svc: Annotated[Services, Depends(services)],
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header_key: Annotated[str | None, Depends(_api_key)],
) -> Caller:
    """The caller, from ``Authorization: Bearer <key>`` (or ``X-API-Key``); 401 without a
    live key. Without authentication (``sluice dev``), the default tenant's admin."""
    if not svc.auth:
        return Caller(DEFAULT_TENANT, admin=True)
    key = bearer.credentials.strip() if bearer is not None and bearer.credentials.strip() else header_key
    if not key:
        raise ApiError(401, "send an API key: Authorization: Bearer <key> (make one with sluice keys create)")
    hashed = digest(key)
    known, found = cached_key(svc, hashed)
    if not known:
        found = await svc.keys.lookup(key)
        if len(svc.key_cache) >= _KEY_CACHE_MAX:
            svc.key_cache.clear()
        svc.key_cache[hashed] = (found, time.monotonic())
    return await authorize(svc, hashed, found, request.scope.setdefault("state", {}))


async def caller_again(request: Request, svc: Services) -> Caller:
    """The caller of a long request again, from its headers: a key revoked (401), or past its
    rate limit (429), since the request began raises ApiError."""
    return await caller(request, svc, await _bearer(request), await _api_key(request))


def cached_key(svc: Services, hashed: str) -> tuple[bool, ApiKey | None]:
    """``(True, key)`` for the key of this digest as last looked up (``None``: no such key);
    ``(False, None)`` when that answer is older than ``KEY_CACHE_SECONDS`` or was never read."""
    cached = svc.key_cache.get(hashed)
    if cached is not None and time.monotonic() - cached[1] < KEY_CACHE_SECONDS:
        return True, cached[0]
    return False, None


async def authorize(svc: Services, hashed: str, found: ApiKey | None, state: dict[str, Any]) -> Caller:
    """A looked-up key made a caller: 401 if it is unknown or revoked, 429 past its rate
    limit (counted here, once per request; the middleware adds the ``RateLimit-*`` headers
    from ``state``)."""
    if found is None:
        raise ApiError(401, "this API key is unknown or revoked")
    verdict = await svc.limiter.check(hashed)
    if svc.limiter.enabled:
        state["rate_limit"] = (svc.limiter.burst, verdict.remaining, svc.limiter.rate)
    if not verdict.allowed:
        state[REFUSED] = "rate_limit"
        raise ApiError(
            429,
            f"this API key made more than {svc.limiter.rate:g} requests per second; "
            f"try again in {verdict.retry_after} s",
            headers={"Retry-After": str(verdict.retry_after)},
            code="rate_limited",
        )
    return Caller(found.tenant, admin=found.admin)


async def admin(who: Annotated[Caller, Depends(caller)]) -> Caller:
    if not who.admin:
        raise ApiError(403, "this needs an admin key (sluice keys create --tenant T --admin)")
    return who


async def admitted(svc: Annotated[Services, Depends(services)]) -> None:
    """Backpressure: 429 with Retry-After while the queue is too far behind."""
    await admit(svc)


async def admit(svc: Services) -> None:
    """429 with Retry-After while the queue is too far behind (``admitted``, as a function)."""
    p = await svc.pressure.read()
    if p.refusing:
        behind = f"{p.backlog_seconds:.0f} s of work" if p.backlog_seconds is not None else f"{p.depth} jobs"
        raise ApiError(
            429,
            f"the queue is {behind} behind (pressure {p.score:.2f}); try again in {p.retry_after} s",
            headers={"Retry-After": str(p.retry_after)},
        )


ServicesDep = Annotated[Services, Depends(services)]
AdmittedDep = Annotated[None, Depends(admitted)]
CallerDep = Annotated[Caller, Depends(caller)]
AdminDep = Annotated[Caller, Depends(admin)]
