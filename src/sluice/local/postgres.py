"""A private PostgreSQL 16 server with pgvector, for tests (ours and users') and the command line.

The binaries are the ones bundled in the ``pgserver`` wheel (the ``service``
extra): PostgreSQL 16 with pgvector, nothing downloaded at run time.
:class:`EmbeddedPostgres` runs them itself (``initdb`` once, then
``postgres`` as its own child) rather than through ``pgserver.get_server``,
which listens on a unix socket only, stops the server from an ``atexit`` hook
counted across every process on the machine, and, as root, makes every
folder above its data and its installation readable by all: we need a chosen
TCP port, a server whose lifetime one object owns, and a SIGKILL for crash
tests. The command line shares one server per folder between commands
(:mod:`sluice.local.shared_postgres`, which starts it through this class).

PostgreSQL refuses to run as root. As root, the server therefore runs as an
unprivileged OS user: the owner of an existing data folder, else
:data:`ROOT_OS_USER`, created (``useradd --system``) the first time; the
folders above the data folder and the binaries get the search bit (``x``,
not read) for that user where they lack it. Our own process stays root and
talks to the server as a client (root may open its socket).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import re
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from sluice.errors import ConfigurationError, SluiceError
from sluice.local.embedded import free_port
from sluice.local.postgres_binaries import (
    OsUser,
    PostgresBinaries,
    environment,
    find_binaries,
    let_traverse,
    os_user,
    run_as,
)
from sluice.local.postmaster import group_alive, ready

#: The database superuser that initdb creates (and every URL names).
SUPERUSER = "postgres"
#: The database that every cluster has and that :attr:`EmbeddedPostgres.url` names by default.
DEFAULT_DATABASE = "postgres"
#: The OS user the server runs as when we are root, and no data folder names another owner.
ROOT_OS_USER = "sluice-postgres"
#: The port in the socket's name (``.s.PGSQL.5432``) when the server listens on no TCP port;
#: clients look for this one when they are given no port.
SOCKET_ONLY_PORT = 5432
#: A unix socket path must fit in sockaddr_un (108 bytes with the NUL).
_MAX_SOCKET_PATH = 100
#: Database names we create: no quoting surprises in SQL, URLs or shells.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
#: Settings of a server whose data may be lost in an OS crash (tests): no fsync, much faster writes.
_NOT_DURABLE = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


class PostgresCommandError(SluiceError):
    """The embedded server refused an administrative command (``psql`` printed why)."""


class EmbeddedPostgres:
    """One private PostgreSQL server. Use as a context manager, or start()/stop().

    ``data_dir`` is its own folder: ``data/`` (the cluster, created by
    initdb on first start and reused after), ``postgres.log``, and the unix
    socket inside ``data/`` (in a short folder of the temp dir when that path
    is too long for a socket). ``port=0`` also listens on a free loopback TCP
    port (the default), ``port=N`` on that one, ``port=None`` on the socket
    only. :attr:`url` is the SQLAlchemy URL (``postgresql+asyncpg://``) of
    ``database``, :attr:`dsn` the same for asyncpg and psql
    (``postgresql://``).

    Over the socket, which only the server's OS user and root can open,
    connections need no password. Over TCP, which every local user can
    reach, they need ``password`` if one is given (set at every start), else
    none (fine for tests on a machine of your own). ``durable=False`` turns
    fsync and synchronous commit off: fast, but a killed server may lose its
    last commits, and an OS crash the cluster.
    ``settings`` adds ``-c name=value`` options. ``detached`` starts the
    server in a session of its own, so that a Ctrl-C in the starter's
    terminal or the starter's exit does not reach it (the shared server).
    ``os_user`` is the account the server runs as when we are root.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int | None = 0,
        binaries: PostgresBinaries | None = None,
        database: str = DEFAULT_DATABASE,
        password: str | None = None,
        durable: bool = True,
        settings: dict[str, str] | None = None,
        detached: bool = False,
        os_user: str = ROOT_OS_USER,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.pgdata = self.data_dir / "data"
        self.log_path = self.data_dir / "postgres.log"
        self.requested_port = port
        self.port: int | None = port if port else None  # the TCP port; 0 becomes a free one at start
        self.binaries = binaries
        self.database = _checked_name(database)
        self.password = password
        self.durable = durable
        self.settings = dict(settings or {})
        self.detached = detached
        self.os_user = os_user
        self.process: subprocess.Popen[bytes] | None = None
        self.user: OsUser | None = None  # who the server runs as, if not us (set by start)
        sock = self.pgdata / ".s.PGSQL.65535"
        fits = len(str(sock)) <= _MAX_SOCKET_PATH and "," not in str(self.pgdata)
        digest = hashlib.sha256(str(self.pgdata).encode()).hexdigest()[:12]
        self.socket_dir = self.pgdata if fits else Path(tempfile.gettempdir()) / f"sluice-pg-{digest}"
        self._log_offset = 0

    # ---- addresses --------------------------------------------------------------------------------

    @property
    def server_port(self) -> int:
        """The port setting: the TCP port, else the number in the socket's name."""
        return self.port if self.port is not None else SOCKET_ONLY_PORT

    def dsn_for(self, database: str) -> str:
        """``postgresql://`` URL of ``database`` (asyncpg, psql): TCP if it has a port, else the socket."""
        auth = SUPERUSER + (f":{quote(self.password, safe='')}" if self.password is not None else "")
        if self.port is not None:
            return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"
        return f"postgresql://{auth}@/{database}?host={quote(str(self.socket_dir))}&port={SOCKET_ONLY_PORT}"

    def url_for(self, database: str) -> str:
        """SQLAlchemy's async URL (``postgresql+asyncpg://``) of ``database``."""
        return "postgresql+asyncpg://" + self.dsn_for(database).removeprefix("postgresql://")

    @property
    def dsn(self) -> str:
        return self.dsn_for(self.database)

    @property
    def url(self) -> str:
        return self.url_for(self.database)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    # ---- lifetime ---------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0, on_spawn: Callable[[int], None] | None = None) -> EmbeddedPostgres:
        """Create the cluster if needed, start the server, and return once it accepts connections.

        Also creates :attr:`database` if missing and sets :attr:`password`.
        ``on_spawn(pid)`` runs as soon as the process exists, before it is
        ready (the shared server records its pid there, so that a starter
        killed during startup leaves a record the next command can follow).
        """
        if self.process is not None and self.process.poll() is None:
            return self
        if self.binaries is None:
            self.binaries = find_binaries()
        self._prepare()
        for attempt in range(3):
            if self.requested_port == 0:
                self.port = free_port()
            try:
                self._spawn(timeout, on_spawn)
                break
            except _PortTaken:  # another program took the free port between our look and the bind
                if attempt == 2:
                    raise
        try:
            if self.database != DEFAULT_DATABASE:
                self.create_database(self.database, exist_ok=True)
            if self.password is not None:
                self._set_password()
        except BaseException:
            self.stop()
            raise
        return self

    def _prepare(self) -> None:
        """The folder, who the server runs as, and the cluster (initdb on first use)."""
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot use {self.data_dir} for PostgreSQL ({exc.strerror}); choose a folder you can write"
            ) from exc
        if os.geteuid() == 0:
            self.user = self._root_runs_as()
            assert self.binaries is not None
            let_traverse(self.data_dir, self.user)
            let_traverse(self.binaries.bin_dir.parent, self.user)
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb()
        self._check_version()
        self._prepare_socket_dir()
        self._write_hba()

    def _root_runs_as(self) -> OsUser:
        """As root: the owner of the existing cluster (it must stay its owner), else :attr:`os_user`."""
        if not (self.pgdata / "PG_VERSION").exists():
            return os_user(self.os_user)
        owner = self.pgdata.stat()
        if owner.st_uid == 0:
            raise ConfigurationError(
                f"{self.pgdata} belongs to root, which PostgreSQL refuses to run as; "
                f"chown -R {self.os_user}: {self.pgdata}, or remove it to start afresh"
            )
        try:
            name = pwd.getpwuid(owner.st_uid).pw_name
        except KeyError:
            name = str(owner.st_uid)
        return OsUser(name, owner.st_uid, owner.st_gid)

    def _initdb(self) -> None:
        assert self.binaries is not None
        if self.pgdata.exists() and any(self.pgdata.iterdir()):
            raise ConfigurationError(
                f"{self.pgdata} is not empty and holds no PostgreSQL cluster (no PG_VERSION); "
                "move its files away, or give EmbeddedPostgres another folder"
            )
        self.pgdata.mkdir(mode=0o700, exist_ok=True)
        self._give(self.pgdata)
        argv = [self.binaries.path("initdb"), "-D", str(self.pgdata), "-U", SUPERUSER, "--auth=trust"]
        argv += ["--encoding=UTF8", "--no-locale", "--no-instructions"]
        if not self.durable:
            argv.append("--no-sync")
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=self.pgdata,
            env=environment(),
            **run_as(self.user),
        )
        if out.returncode != 0:
            raise ConfigurationError(
                f"initdb failed for {self.pgdata} (exit {out.returncode}):\n{_tail(out.stdout + out.stderr)}"
            )

    def _check_version(self) -> None:
        assert self.binaries is not None
        found = (self.pgdata / "PG_VERSION").read_text().strip()
        if found != str(self.binaries.major):
            raise ConfigurationError(
                f"{self.pgdata} holds a PostgreSQL {found} cluster and these binaries are "
                f"{self.binaries.version} ({self.binaries.bin_dir}); dump it with PostgreSQL {found} "
                "(pg_dumpall) and load it into a new folder, or use another folder"
            )

    def _prepare_socket_dir(self) -> None:
        """The fallback socket folder (in the temp dir) must be ours: another user could have made it."""
        if self.socket_dir == self.pgdata:
            return
        with contextlib.suppress(FileExistsError):
            self.socket_dir.mkdir(mode=0o700)
            self._give(self.socket_dir)
        mode = self.socket_dir.lstat()
        owner = self.user.uid if self.user is not None else os.geteuid()
        if not stat.S_ISDIR(mode.st_mode) or mode.st_uid != owner or stat.S_IMODE(mode.st_mode) & 0o077:
            raise ConfigurationError(
                f"{self.socket_dir} (the socket folder of {self.pgdata}, whose path is too long for a "
                "socket) is not a private folder of the server's user; remove it, or use a shorter path"
            )

    def _write_hba(self) -> None:
        """Who may connect how, rewritten at every start: the socket trusts, TCP wants the password."""
        method = "scram-sha-256" if self.password is not None else "trust"
        text = (
            "# Written by sluice.local.postgres at every start.\n"
            "local all all trust\n"
            f"host all all 127.0.0.1/32 {method}\n"
        )
        path = self.pgdata / "pg_hba.conf"
        if path.read_text() != text:
            path.write_text(text)
            self._give(path)

    def _give(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.uid, self.user.gid)

    def argv(self) -> list[str]:
        assert self.binaries is not None
        options = {
            "listen_addresses": "127.0.0.1" if self.port is not None else "",
            "port": str(self.server_port),
            "unix_socket_directories": str(self.socket_dir),
            "unix_socket_permissions": "0700",
            **({} if self.durable else _NOT_DURABLE),
            **self.settings,
        }
        argv = [self.binaries.path("postgres"), "-D", str(self.pgdata)]
        for name, value in options.items():
            argv += ["-c", f"{name}={value}"]
        return argv

    def _spawn(self, timeout: float, on_spawn: Callable[[int], None] | None) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._log_offset = self.log_path.stat().st_size
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # it may show SQL
        with os.fdopen(fd, "ab") as log:
            self.process = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.pgdata,
                env=environment(),
                # A group of its own either way, so that kill() reaches every backend at once.
                start_new_session=self.detached,
                process_group=None if self.detached else 0,
                **run_as(self.user),
            )
        assert self.process is not None
        if on_spawn is not None:
            on_spawn(self.process.pid)
        deadline = time.monotonic() + timeout
        while not ready(self.pgdata, self.process.pid):
            if self.process.poll() is not None:
                self.process = None
                tail = self.log_tail()
                if self.requested_port == 0 and "could not bind IPv4 address" in tail:
                    raise _PortTaken(tail)
                raise ConfigurationError(f"PostgreSQL exited at start; the end of {self.log_path}:\n{tail}")
            if time.monotonic() > deadline:
                self.kill()
                raise ConfigurationError(
                    f"PostgreSQL did not accept connections within {timeout:g}s; "
                    f"the end of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.005)
        if self.detached:
            # Reap it when it exits, whoever stops it, so it leaves no zombie while we live.
            threading.Thread(target=self.process.wait, name="sluice-postgres-reaper", daemon=True).start()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of what the server logged since its last start."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                return _tail(f.read().decode(errors="replace"), chars)
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server: a fast shutdown (clients are disconnected, then a checkpoint)."""
        proc = self.process
        self.process = None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGQUIT, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            self.process = proc
            self.kill()
        if self.socket_dir != self.pgdata:
            with contextlib.suppress(OSError):
                self.socket_dir.rmdir()  # the server removed its socket: the folder is empty again

    def kill(self) -> None:
        """SIGKILL the server and all its processes at once, as a crash would (for crash tests).

        Returns once they are gone: a backend still attached to the old
        shared memory would make the next start refuse.
        """
        proc = self.process
        self.process = None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- administration ---------------------------------------------------------------------------

    def psql(self, sql: str, database: str = DEFAULT_DATABASE, timeout: float = 60.0) -> str:
        """Run ``sql`` (one or more statements) as the superuser over the socket; return what it printed.

        Unaligned, tuples only: one row per line, columns separated by ``|``.
        The SQL goes through stdin, never the command line (which ``ps``
        shows to every user).
        """
        assert self.binaries is not None, "start() the server first"
        argv = [self.binaries.path("psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"]
        argv += ["-h", str(self.socket_dir), "-p", str(self.server_port), "-U", SUPERUSER, "-d", database]
        out = subprocess.run(
            argv, input=sql, capture_output=True, text=True, timeout=timeout, check=False, env=environment()
        )
        if out.returncode != 0:
            raise PostgresCommandError(f"psql on {self.data_dir} failed: {out.stderr.strip()}")
        return out.stdout

    def create_database(self, name: str, *, template: str | None = None, exist_ok: bool = False) -> str:
        """Create database ``name`` (a copy of ``template``, default template1); return its URL."""
        exists = f"SELECT 1 FROM pg_database WHERE datname = '{_checked_name(name)}'"  # noqa: S608 (checked)
        if exist_ok and self.psql(exists).strip():
            return self.url_for(name)
        sql = f'CREATE DATABASE "{name}"'
        if template is not None:
            sql += f' TEMPLATE "{_checked_name(template)}"'
        self.psql(sql)
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, disconnecting whoever still uses it."""
        self.psql(f'DROP DATABASE IF EXISTS "{_checked_name(name)}" WITH (FORCE)')

    def _set_password(self) -> None:
        assert self.password is not None
        secret = self.password.replace("'", "''")
        # Not in the server log even if logging of statements is on.
        self.psql(f"SET log_statement = 'none';\nALTER ROLE {SUPERUSER} PASSWORD '{secret}';\n")


class _PortTaken(ConfigurationError):
    """The free port we picked was taken before the server bound it (we pick another)."""


def _checked_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"database name {name!r}: use letters, digits and _ (at most 63), not first a digit")
    return name


def _tail(text: str, chars: int = 3000) -> str:
    text = text.strip()
    return text[-chars:] if text else "(no output)"


def asyncpg_dsn(url: str) -> str:
    """The ``postgresql://`` DSN that asyncpg and psql take, of SQLAlchemy's ``postgresql+asyncpg://`` URL."""
    return re.sub(r"^postgresql\+asyncpg://", "postgresql://", url)
