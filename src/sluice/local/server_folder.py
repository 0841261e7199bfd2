"""The files of one folder's shared server, and the locked operations on them, for any server.

A folder holds the server's record (``server.json``), ``start.lock`` (held around "find a live
server or start one" and around "leave, and stop the server if I was the last user") and
``users/``, one file per process using the server, locked by that process for as long as it
uses it. Everything rests on ``flock``, because the kernel releases a process's locks when it
dies, however it dies (see :mod:`sluice.local.shared`). The shared Redis
(:class:`~sluice.local.shared.RedisFolder`) and the shared PostgreSQL
(``shared_postgres.PostgresFolder``) add how to probe and stop theirs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from sluice.errors import ConfigurationError
from sluice.local.embedded import pid_alive
from sluice.settings import ENV_HOME, ENV_REDIS_URL

#: How long to wait for another process's start or stop, or for a server to finish loading.
LOCK_TIMEOUT = 60.0


@dataclass(frozen=True)
class User:
    """A live process using the folder's server; ``label`` says which command it is."""

    pid: int
    label: str


class ServerFolder:
    """The files of one folder's shared server (its record, the start lock, one file per user)
    and the locked operations on them, for any server; :class:`~sluice.local.shared.RedisFolder` and
    ``shared_postgres.PostgresFolder`` add how to probe and stop theirs."""

    #: the server's name in messages, and the variable that names one the user runs instead
    what = "server"
    url_variable = ENV_REDIS_URL

    def __init__(self, home: str | Path, subdir: str, log_name: str) -> None:
        self.path = Path(home).resolve() / subdir
        self.record_path = self.path / "server.json"
        self.lock_path = self.path / "start.lock"
        self.users_path = self.path / "users"
        self.log_path = self.path / log_name

    @contextlib.contextmanager
    def locked(self, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
        """Hold ``start.lock``: one process at a time starts, adopts, leaves or stops."""
        try:
            self.users_path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot keep the embedded {self.what} in {self.path} ({exc.strerror}); set {ENV_HOME} to "
                f"a folder you can write, or {self.url_variable} to a {self.what} you run"
            ) from exc
        try:
            deadline = time.monotonic() + timeout
            while not _try_lock(fd):
                if time.monotonic() > deadline:
                    raise ConfigurationError(
                        f"waited {timeout:g}s for {self.lock_path}: another sluice command is starting "
                        f"or stopping this folder's {self.what} and has not finished; see {self.log_path}"
                    )
                time.sleep(0.02)
            yield
        finally:
            os.close(fd)  # releases the lock

    def write_record(self, record: object) -> None:
        """Replace ``server.json`` at once: a reader sees the old record or the new, never half."""
        tmp = self.record_path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold a password
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(record), indent=1) + "\n")  # type: ignore[call-overload]
        tmp.replace(self.record_path)

    def forget_record(self) -> None:
        self.record_path.unlink(missing_ok=True)

    def register(self, label: str) -> tuple[int, Path]:
        """A new user file, locked by this process until :meth:`unregister` (or its death)."""
        path = self.users_path / f"{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"pid": os.getpid(), "label": label}).encode())
        return fd, path

    @staticmethod
    def unregister(fd: int, path: Path) -> None:
        path.unlink(missing_ok=True)
        os.close(fd)

    def live_users(self, exclude: Path | None = None) -> list[User]:
        """The users whose process still holds its lock; files of dead ones are deleted.

        Call it under :meth:`locked`: the test takes each file's lock for a
        moment, and two processes testing at once could each see the other's
        test as a live user.
        """
        users: list[User] = []
        for path in sorted(self.users_path.iterdir()):
            if path == exclude:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                if _try_lock(fd):
                    path.unlink(missing_ok=True)  # its process is gone, and so is its lock
                else:
                    users.append(_read_user(fd, path))
            finally:
                os.close(fd)
        return users


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_user(fd: int, path: Path) -> User:
    try:
        data = json.loads(os.pread(fd, 4096, 0))
        return User(int(data["pid"]), str(data["label"]))
    except (ValueError, KeyError, TypeError):
        pid = path.name.partition("-")[0]
        return User(int(pid) if pid.isdigit() else 0, "?")


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
