"""Local servers and processes that the commands run: no mocks, nothing for tests only.

``sluice redis``, ``sluice dev`` and every command that finds no
``SLUICE_REDIS_URL`` use the folder's embedded Redis (:class:`SharedRedis`,
one per folder, shared by several processes, stopped by the last one out);
``sluice dev`` also the folder's embedded PostgreSQL
(:mod:`sluice.local.shared_postgres`); ``sluice demo`` starts worker
processes as users start them (:mod:`sluice.local.processes`).
:class:`EmbeddedRedis` is one private redis-server owned by one object.

What tests use on top of these (the pytest plugin, a worker in the test's
event loop, a Redis Cluster, the simulated LLM provider) is
:mod:`sluice.testing`.
"""

from sluice.local.embedded import EmbeddedRedis, RedisBinary, find_binary, free_port
from sluice.local.shared import SharedRedis

__all__ = ["EmbeddedRedis", "RedisBinary", "SharedRedis", "find_binary", "free_port"]
