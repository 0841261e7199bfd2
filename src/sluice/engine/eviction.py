"""The one Redis setting that lets accepted jobs vanish: ``maxmemory-policy``.

With any policy but ``noeviction``, a Redis that reaches ``maxmemory`` deletes
keys to make room, and a job record, a queue set or a budget is as likely to
go as anything else: the job is lost without an error anywhere. With
``noeviction`` a full Redis refuses writes instead, which Sluice reports
(``RedisCommandError``, OOM) and a producer can retry. The queue therefore
checks the policy once per server and process, and warns.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from sluice.engine.transport import server_url

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("sluice.queue")

_checked: set[str] = set()


async def warn_if_evicting(redis: Redis) -> str | None:
    """Log a warning (once per server and process) if Redis may evict keys; the policy
    seen, or None when it could not be read (a managed Redis may refuse CONFIG)."""
    url = server_url(redis)
    if url in _checked:
        return None
    try:
        raw: Any = await redis.config_get("maxmemory-policy")
    except ResponseError:  # CONFIG is often disabled on managed Redis: nothing to check
        _checked.add(url)
        return None
    except Exception:  # noqa: BLE001 - unreachable now: checked on a later call
        return None
    _checked.add(url)
    policy = raw.get("maxmemory-policy") if isinstance(raw, dict) else None
    if isinstance(policy, bytes):
        policy = policy.decode()
    if policy and policy != "noeviction":
        log.warning(
            "Redis at %s may evict keys when it is full (maxmemory-policy %s): accepted jobs "
            "could vanish without an error; set maxmemory-policy noeviction (a full Redis then "
            "refuses writes, which Sluice reports)",
            url,
            policy,
            extra={"redis": url, "maxmemory_policy": policy},
        )
    return policy if isinstance(policy, str) else None
