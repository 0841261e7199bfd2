"""A private Redis Cluster: N masters (and optional replicas) on free loopback ports.

For tests and benchmarks that must see what a cluster changes: keys spread
over several servers by hash slot, commands sent to the wrong server answered
with MOVED, blocking reads that must wait on the server that owns their key.
Every node is an :class:`~sluice.local.embedded.EmbeddedRedis` started with
``--cluster-enabled yes``; the nodes are joined from Python (CLUSTER
ADDSLOTSRANGE/ADDSLOTS, SET-CONFIG-EPOCH, MEET, REPLICATE), so the only
binary needed is ``redis-server`` (the 6.2 one of the ``embedded`` extra
works too; ``redis-cli`` is not needed).

A node's cluster bus listens on its port + 10000, so both ports must be free;
ports are picked below the kernel's ephemeral range, where nothing else is
handed out, and a start that loses a race for one is retried with others.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from sluice.errors import ConfigurationError
from sluice.local.embedded import EmbeddedRedis, RedisBinary, find_binary

#: Slots of a Redis Cluster (CRC16 of the key's hash tag, mod 16384).
SLOTS = 16384
#: The cluster bus of a node listens on its port + this.
BUS_OFFSET = 10000
#: Ports are picked here: below Linux's ephemeral range (32768-60999), so no
#: socket the kernel hands out takes them, and so that port + 10000 is too.
_PORT_RANGE = (20000, 22700)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(taken: set[int] | None = None) -> int:
    """A loopback port that is free, and whose cluster bus port (+10000) is free too."""
    taken = taken or set()
    for _ in range(200):
        port = random.randrange(*_PORT_RANGE)
        if port in taken or port + BUS_OFFSET in taken:
            continue
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            return port
    raise ConfigurationError(
        f"found no free pair of loopback ports (port and port+{BUS_OFFSET}) in {_PORT_RANGE}; "
        "free some, or run fewer clusters at once"
    )


class ClusterNode(EmbeddedRedis):
    """One node of an :class:`EmbeddedCluster`: an EmbeddedRedis in cluster mode."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        binary: RedisBinary,
        port: int,
        password: str | None,
        node_timeout_ms: int,
    ) -> None:
        super().__init__(data_dir, binary=binary, port=port, persist=False, password=password)
        self.node_timeout_ms = node_timeout_ms

    def argv(self) -> list[str]:
        return [
            *super().argv(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(self.data_dir / "nodes.conf"),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
        ]

    def _secret_config(self) -> Path:
        # A replica authenticates to its master with the same password.
        path = super()._secret_config()
        with path.open("a") as f:
            f.write(f'masterauth "{self.password}"\n')
        return path

    def client(self) -> redis.Redis:
        """A synchronous client of this node alone (for setting the cluster up)."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10, protocol=2
        )


class EmbeddedCluster:
    """A Redis Cluster of private redis-server processes. Use as a context manager, or start()/stop().

    ``masters`` nodes share the 16384 slots evenly; ``replicas`` more nodes
    per master follow them. ``password`` makes every node require it (and
    puts it in the URLs). :attr:`url` is the first master's URL: any node's
    URL is enough for a cluster client to find the rest.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        masters: int = 3,
        replicas: int = 0,
        binary: RedisBinary | None = None,
        password: str | None = None,
        node_timeout_ms: int = 3000,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ConfigurationError("a cluster needs at least 1 master and 0 or more replicas per master")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="sluice-cluster-")).resolve()
        self.masters = masters
        self.replicas = replicas
        self.binary = binary or find_binary()
        self.password = password
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[ClusterNode] = []

    @property
    def url(self) -> str:
        """The first master's URL; a cluster client finds the other nodes from it."""
        if not self.nodes:
            raise ConfigurationError("the cluster is not started")
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def master_nodes(self) -> list[ClusterNode]:
        return self.nodes[: self.masters]

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        """Start every node, join them, and return once every node says ``cluster_state:ok``."""
        try:
            self._start_nodes()
            self._join()
            self.wait_ok(timeout)
        except BaseException:
            self._stop_nodes()  # the folder stays: its logs say what went wrong
            raise
        return self

    def _start_nodes(self) -> None:
        taken: set[int] = set()
        for i in range(self.masters * (1 + self.replicas)):
            for attempt in range(5):
                port = free_cluster_port(taken)
                node = ClusterNode(
                    self.data_dir / f"node-{i}",
                    binary=self.binary,
                    port=port,
                    password=self.password,
                    node_timeout_ms=self.node_timeout_ms,
                )
                try:
                    node.start()
                except ConfigurationError:
                    # Another process took the port (or its bus port) between the check and
                    # the bind: try another pair; a server that fails for any other reason
                    # fails five times and says why.
                    if attempt == 4:
                        raise
                    continue
                taken.update({port, port + BUS_OFFSET})
                self.nodes.append(node)
                break

    def _join(self) -> None:
        """Assign slots, give each node its own epoch, meet, then attach the replicas."""
        masters = self.master_nodes
        share = SLOTS // len(masters)
        for i, node in enumerate(masters):
            first = i * share
            last = SLOTS - 1 if i == len(masters) - 1 else first + share - 1
            with node.client() as c:
                if self.binary.major_minor >= (7, 0):
                    c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                else:
                    c.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
        for epoch, node in enumerate(self.nodes, start=1):
            with node.client() as c:
                # Distinct epochs from the start: no collision to resolve, as redis-cli does.
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        first_node = self.nodes[0]
        for node in self.nodes[1:]:
            with node.client() as c:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", first_node.port)
        if self.replicas:
            self._attach_replicas()

    def _attach_replicas(self, timeout: float = 15.0) -> None:
        ids = []
        for node in self.master_nodes:
            with node.client() as c:
                ids.append(c.execute_command("CLUSTER", "MYID").decode())
        replicas = self.nodes[self.masters :]
        deadline = time.monotonic() + timeout
        for i, node in enumerate(replicas):
            master_id = ids[i % self.masters]
            with node.client() as c:
                while True:
                    # The replica must have heard of its master through the gossip first.
                    try:
                        c.execute_command("CLUSTER", "REPLICATE", master_id)
                        break
                    except redis.ResponseError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Return once every node knows every other one and has all slots covered."""
        deadline = time.monotonic() + timeout
        pending = list(self.nodes)
        while pending:
            node = pending[0]
            with contextlib.suppress(redis.RedisError), node.client() as c:
                info = c.execute_command("CLUSTER", "INFO").decode()
                fields = dict(line.split(":", 1) for line in info.split("\r\n") if ":" in line)
                if fields.get("cluster_state") == "ok" and int(fields.get("cluster_known_nodes", 0)) == len(
                    self.nodes
                ):
                    pending.pop(0)
                    continue
            if time.monotonic() > deadline:
                raise ConfigurationError(
                    f"the cluster did not reach cluster_state:ok within {timeout}s "
                    f"(node at port {node.port}); see {node.log_path}"
                )
            time.sleep(0.05)

    def _live(self) -> ClusterNode:
        """A node whose process runs (a test may have killed some)."""
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                return node
        raise ConfigurationError("no node of the cluster is running")

    def node_for_slot(self, slot: int) -> ClusterNode:
        """The master that serves ``slot`` (as the cluster says now)."""
        with self._live().client() as c:
            for first, last, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(first) <= slot <= int(last):
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise ConfigurationError(f"slot {slot} is not served by this cluster")

    def node_for_key(self, key: str) -> ClusterNode:
        """The master that serves ``key``'s slot."""
        with self._live().client() as c:
            return self.node_for_slot(int(c.execute_command("CLUSTER", "KEYSLOT", key)))

    def move_slot(self, slot: int, to: ClusterNode) -> None:
        """Move ``slot`` and its keys to the master ``to``, as ``redis-cli --cluster reshard`` does.

        While the keys move, the old master answers ASK (or TRYAGAIN) for
        them; once the slot is handed over, MOVED. For tests of clients that
        must follow a slot to its new master.
        """
        source = self.node_for_slot(slot)
        if source is to:
            return
        with source.client() as src, to.client() as dst:
            src_id = src.execute_command("CLUSTER", "MYID").decode()
            dst_id = dst.execute_command("CLUSTER", "MYID").decode()
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            auth = ["AUTH", self.password] if self.password is not None else []
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 10_000, *auth, "KEYS", *keys)
            # The new owner first, then the old one, then the rest (the order redis-cli uses).
            for node in [to, source, *(n for n in self.master_nodes if n not in (to, source))]:
                with node.client() as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    def _stop_nodes(self) -> None:
        nodes, self.nodes = self.nodes, []
        for node in nodes:
            node.stop()

    def stop(self) -> None:
        """Stop every node and remove the folder when this object made it."""
        self._stop_nodes()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
