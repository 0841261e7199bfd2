"""One embedded PostgreSQL per folder, shared by every command that uses it; the last one out stops it.

What :mod:`sluice.local.shared` does for Redis, for the PostgreSQL that
holds the service's records (``sluice dev`` with no SLUICE_DATABASE_URL), with
the same rules and the same ``flock`` machinery (see that module: a killed
user never keeps the server alive, a killed starter's server is adopted, two
commands starting at once start one server). The folder
``<home>/postgres/`` holds:

``data/``           the cluster (initdb'd by the first command, kept after:
                    the next command on the folder finds its data again),
                    with the unix socket in it
``postgres.log``    the server's log
``server.json``     url, pid, version and binary of the running server (mode 600)
``start.lock``      held around "find a live server or start one" and around
                    "leave, and stop the server if I was the last user"
``users/``          one file per process using the server, locked by it

The server listens on its unix socket only (no password: only its owner, and
root, may open the socket), or with ``port=`` on a loopback port too, with a
random password set at every start (a port is open to every local user).
Its URL names the database ``sluice``, created on first start.

A server counts as live when its recorded pid runs the recorded binary and
the cluster's own ``postmaster.pid`` names that pid as ready; PostgreSQL
refuses a second server on the same cluster anyway, so a stale record can at
worst cost a clear error, never the data.
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

from sluice.errors import ConfigurationError
from sluice.local.embedded import pid_alive
from sluice.local.postgres import ROOT_OS_USER, EmbeddedPostgres
from sluice.local.postgres_binaries import PostgresBinaries, find_binaries
from sluice.local.postmaster import ready
from sluice.local.server_folder import LOCK_TIMEOUT, ServerFolder, User, _wait_gone
from sluice.settings import ENV_DATABASE_URL

#: The database the shared server's URL names (created on first start).
DATABASE = "sluice"
#: How long a stopping server may take (a fast shutdown ends with a checkpoint).
STOP_TIMEOUT = 30.0


@dataclass(frozen=True)
class PostgresRecord:
    """What ``server.json`` says about the folder's server (written by its starter)."""

    url: str  # SQLAlchemy's postgresql+asyncpg:// URL of the database
    dsn: str  # the same as postgresql://, for psql and asyncpg
    pid: int
    version: str
    binary: str  # the postgres program, checked against /proc/<pid>/exe
    pgdata: str
    socket_dir: str
    port: int | None  # the loopback TCP port, None: the socket only
    database: str
    started_by: int
    started_at: float
    password: str | None = None
    #: False until the starter has created the database and set the password
    complete: bool = False

    @classmethod
    def parse(cls, raw: str) -> PostgresRecord | None:
        """The record in ``raw``, or None if it is not one (a torn or foreign file)."""
        try:
            data = json.loads(raw)
            return cls(**data) if isinstance(data, dict) else None
        except (ValueError, TypeError):
            return None


@dataclass(frozen=True)
class PostgresStatus:
    """The folder's running server and the processes that use it."""

    folder: Path
    record: PostgresRecord
    users: tuple[User, ...]


class PostgresFolder(ServerFolder):
    """The files of one folder's shared PostgreSQL (its cluster in ``data``), and the locked
    operations on them."""

    what = "PostgreSQL"
    url_variable = ENV_DATABASE_URL

    def __init__(self, home: str | Path) -> None:
        super().__init__(home, "postgres", "postgres.log")
        self.pgdata = self.path / "data"

    def read_record(self) -> PostgresRecord | None:
        try:
            return PostgresRecord.parse(self.record_path.read_text())
        except FileNotFoundError:
            return None

    def server(self, wait: float = 0.0) -> PostgresRecord | None:
        """The record of the live server, or None (a stale record is deleted).

        A recorded server that runs but is not ready yet (recovering after a
        crash) is waited for up to ``wait`` seconds.
        """
        record = self.read_record()
        if record is None:
            return None
        deadline = time.monotonic() + wait
        while not ready(Path(record.pgdata), record.pid):
            if not _runs(record):
                self.forget_record()
                return None
            if time.monotonic() > deadline:
                raise ConfigurationError(
                    f"the PostgreSQL of {self.path} (pid {record.pid}) runs but does not accept "
                    f"connections; see {self.log_path}, or stop it (kill -INT {record.pid})"
                )
            time.sleep(0.05)
        return record

    def orphan(self) -> int | None:
        """The pid of a live server of this cluster that ``server.json`` does not name, if any."""
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        record = self.read_record()
        if (record is not None and record.pid == pid) or not pid_alive(pid):
            return None
        try:
            exe = Path(os.readlink(f"/proc/{pid}/exe")).name
        except OSError:
            return None
        return pid if exe == "postgres" else None

    def stop_server(self, pid: int, timeout: float = STOP_TIMEOUT) -> None:
        """A fast shutdown (clients disconnected, then a checkpoint); an immediate one if it hangs."""
        for sig in (signal.SIGINT, signal.SIGQUIT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            if _wait_gone(pid, timeout):
                self.forget_record()
                return
        raise ConfigurationError(
            f"the PostgreSQL of {self.path} (pid {pid}) did not stop within {2 * timeout:g}s; "
            f"see {self.log_path}; `kill -9 {pid}` ends it (it recovers at the next start)"
        )


class SharedPostgres:
    """Use the folder's shared PostgreSQL for a while: start it if none runs, stop it if last to leave.

    ``with SharedPostgres(home) as url:`` attaches (registers this process as
    a user, then adopts the live server or starts one) and detaches at the
    end of the block (the server stops only if no other live process uses
    it). ``url`` is SQLAlchemy's (``postgresql+asyncpg://``); :attr:`dsn` is
    the same for psql and asyncpg. ``port`` listens on a loopback port too
    (0: any free one), with a password. ``binaries``: the PostgreSQL to start
    (default pgserver's), or its ``bin`` folder. ``label`` names this process
    for :func:`status`.

    After attaching, ``record`` describes the server and ``started`` says
    whether this object started it; after detaching, ``others_at_exit`` says
    how many other processes still used it (0: it was stopped).

    ``join``: a URL the caller was given. If it is the folder's running
    server, this process becomes a user of it like any other; otherwise
    nothing happens, and no server is ever started.
    """

    def __init__(
        self,
        home: str | Path,
        *,
        port: int | None = None,
        binaries: PostgresBinaries | str | Path | None = None,
        label: str | None = None,
        timeout: float = LOCK_TIMEOUT,
        join: str | None = None,
        os_user: str = ROOT_OS_USER,
    ) -> None:
        self.folder = PostgresFolder(home)
        self.port = port
        self.binaries = binaries
        self.label = label or Path(sys.argv[0]).name
        self.timeout = timeout
        self.join = join
        self.os_user = os_user
        self.record: PostgresRecord | None = None
        self.started = False
        self.others_at_exit: int | None = None
        self._user: tuple[int, Path] | None = None
        self._server: EmbeddedPostgres | None = None  # the one this object started (its reaper thread)

    @property
    def url(self) -> str:
        if self.record is None:
            raise RuntimeError("not attached: use `with SharedPostgres(home) as url:` or attach()")
        return self.record.url

    @property
    def dsn(self) -> str:
        if self.record is None:
            raise RuntimeError("not attached: use `with SharedPostgres(home) as url:` or attach()")
        return self.record.dsn

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
                if record is not None and not record.complete:
                    # Its starter died before creating the database or setting the password.
                    self.folder.stop_server(record.pid)
                    record = None
                if record is None:
                    record = self._start()
                    self.started = True
                elif self.port is not None and record.port is None:
                    raise ConfigurationError(
                        f"the PostgreSQL of {self.folder.path} already runs on its socket only; use that "
                        "(its URL), or stop it first to start it on a port"
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
        if recorded is None or url not in (recorded.url, recorded.dsn):
            return url
        with self.folder.locked(self.timeout):
            record = self.folder.server()
            if record is not None and url in (record.url, record.dsn):
                self._user = self.folder.register(self.label)
                self.record = record
        return url

    def _start(self) -> PostgresRecord:
        if (orphan := self.folder.orphan()) is not None:
            raise ConfigurationError(
                f"a PostgreSQL (pid {orphan}) runs on {self.folder.pgdata} but {self.folder.record_path} "
                f"does not name it; stop it (kill -INT {orphan}), then run the command again"
            )
        binaries = self.binaries
        if not isinstance(binaries, PostgresBinaries):
            binaries = find_binaries(binaries)
        server = EmbeddedPostgres(
            self.folder.path,
            port=self.port,
            binaries=binaries,
            database=DATABASE,
            password=secrets.token_urlsafe(24) if self.port is not None else None,
            detached=True,
            os_user=self.os_user,
        )

        def record(pid: int, complete: bool) -> PostgresRecord:
            return PostgresRecord(
                url=server.url,
                dsn=server.dsn,
                pid=pid,
                version=binaries.version,
                binary=binaries.path("postgres"),
                pgdata=str(server.pgdata),
                socket_dir=str(server.socket_dir),
                port=server.port,
                database=DATABASE,
                started_by=os.getpid(),
                started_at=time.time(),
                password=server.password,
                complete=complete,
            )

        def spawned(pid: int) -> None:
            self.folder.write_record(record(pid, complete=False))

        try:
            server.start(timeout=self.timeout, on_spawn=spawned)
        except BaseException:
            server.stop()
            self.folder.forget_record()
            raise
        assert server.pid is not None
        self._server = server
        done = record(server.pid, complete=True)
        self.folder.write_record(done)
        return done

    def detach(self) -> int:
        """Leave; stop the server if no other live process uses it. Returns how many still do."""
        if self._user is None:
            return self.others_at_exit or 0
        with self.folder.locked(self.timeout):
            self.folder.unregister(*self._user)
            self._user = None
            others = self.folder.live_users()
            if not others and (record := self.folder.read_record()) is not None:
                if _runs(record):
                    self.folder.stop_server(record.pid)
                else:
                    self.folder.forget_record()
        self.others_at_exit = len(others)
        return len(others)

    def running(self) -> bool:
        """True while the server this object attached to still runs (no connection made)."""
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


def status(home: str | Path) -> PostgresStatus | None:
    """The folder's live server and its users, or None when none runs (a stale record is removed)."""
    folder = PostgresFolder(home)
    if not folder.path.is_dir():
        return None  # nothing to look at, and no reason to create the folder
    with folder.locked():
        record = folder.server()
        if record is None:
            return None
        return PostgresStatus(folder.path, record, tuple(folder.live_users()))


def stop(home: str | Path) -> PostgresStatus | None:
    """Stop the folder's server even if processes still use it; return what was stopped, or None.

    A server of the folder's cluster that ``server.json`` does not name (its
    record was deleted) is stopped too, and reported as None.
    """
    folder = PostgresFolder(home)
    if not folder.path.is_dir():
        return None
    with folder.locked():
        record = folder.read_record()
        if record is None or not _runs(record):
            folder.forget_record()
            if (orphan := folder.orphan()) is not None:
                folder.stop_server(orphan)
            return None
        found = PostgresStatus(folder.path, record, tuple(folder.live_users()))
        folder.stop_server(record.pid)
        return found


def _runs(record: PostgresRecord) -> bool:
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
