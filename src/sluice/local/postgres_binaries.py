"""Where the PostgreSQL programs are, and who runs them: pgserver's binaries, and a non-root OS user.

The programs come from the ``pgserver`` wheel (the ``service`` extra):
PostgreSQL 16 with pgvector, nothing downloaded at run time. PostgreSQL
refuses to run as root, so as root :mod:`sluice.local.postgres` runs them
as an unprivileged OS user (:func:`os_user`, created once if needed) and
gives that user the search bit on the folders it must reach
(:func:`let_traverse`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pwd
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from sluice.errors import ConfigurationError, MissingExtra
from sluice.settings import ENV_DATABASE_URL


@dataclass(frozen=True)
class PostgresBinaries:
    """A folder with ``initdb``, ``postgres`` and ``psql``, and the server's version."""

    bin_dir: Path
    version: str
    origin: str  # "pgserver" or "explicit"

    def path(self, program: str) -> str:
        return str(self.bin_dir / program)

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


@dataclass(frozen=True)
class OsUser:
    """The OS account the server runs as, when it is not our own (we are root)."""

    name: str
    uid: int
    gid: int


def pgserver_bin_dir() -> Path:
    """The ``bin`` folder of the pgserver wheel, found without importing pgserver.

    Importing it would import psutil, platformdirs and fasteners and define
    its machine-wide lock; we only need its files.
    """
    try:
        spec = importlib.util.find_spec("pgserver")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra(
            "service",
            "the embedded PostgreSQL",
            "pgserver",
            f"or set {ENV_DATABASE_URL} to a PostgreSQL 16 you run (with the pgvector extension)",
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def find_binaries(bin_dir: str | Path | None = None) -> PostgresBinaries:
    """The PostgreSQL programs of ``bin_dir``, else of the pgserver wheel."""
    origin = "explicit" if bin_dir is not None else "pgserver"
    folder = Path(bin_dir if bin_dir is not None else pgserver_bin_dir()).resolve()
    missing = [p for p in ("initdb", "postgres", "psql") if not os.access(folder / p, os.X_OK)]
    if missing:
        advice = (
            "reinstall it: pip install --force-reinstall 'pgserver>=0.1.4'"
            if origin == "pgserver"
            else "pass the bin folder of a PostgreSQL 16 installation"
        )
        raise ConfigurationError(f"no executable {', '.join(missing)} in {folder}; {advice}")
    return PostgresBinaries(folder, _version(folder / "postgres"), origin)


@functools.cache
def _version(postgres: Path) -> str:
    out = subprocess.run(
        [str(postgres), "--version"], capture_output=True, text=True, timeout=10, check=False
    )
    match = re.search(r"\(PostgreSQL\) (\d+(?:\.\d+)*)", out.stdout)
    if out.returncode != 0 or match is None:
        raise ConfigurationError(
            f"{postgres} --version failed (exit {out.returncode}): {(out.stdout + out.stderr).strip()[-500:]}"
        )
    return match.group(1)


def os_user(name: str) -> OsUser:
    """The OS user ``name``, created as a system account without home or shell if it does not exist.

    Two processes creating it at once are fine: the loser's ``useradd``
    fails, and it finds the winner's account.
    """
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        useradd = shutil.which("useradd") or shutil.which("useradd", path="/usr/sbin:/sbin")
        if useradd is None:
            raise ConfigurationError(
                f"PostgreSQL refuses to run as root, and there is no useradd to create the OS user {name!r} "
                f"it should run as: create it (adduser --system {name}), or run as another user"
            ) from None
        shell = next((s for s in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(s)), "/bin/false")
        argv = [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"]
        out = subprocess.run([*argv, "--shell", shell, name], capture_output=True, text=True, check=False)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise ConfigurationError(
                f"PostgreSQL refuses to run as root, and creating the OS user {name!r} for it failed: "
                f"{out.stderr.strip() or out.returncode}"
            ) from None
    if entry.pw_uid == 0:
        raise ConfigurationError(f"the OS user {name!r} is root, which PostgreSQL refuses to run as")
    return OsUser(name, entry.pw_uid, entry.pw_gid)


def let_traverse(path: Path, user: OsUser) -> None:
    """Give ``user`` the search permission (``x``, not read) on ``path`` and every folder above it.

    Only where it lacks it (pytest's ``/tmp/pytest-of-root`` is 0700, so is
    ``/root``): the server must reach its data folder and its own binaries.
    """
    for folder in (path, *path.parents):
        mode = folder.stat()
        if mode.st_uid == user.uid:
            bit = stat.S_IXUSR
        elif mode.st_gid == user.gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not mode.st_mode & bit:
            folder.chmod(stat.S_IMODE(mode.st_mode) | bit)


def environment() -> dict[str, str]:
    """The environment of the programs we run: a fixed one, not ours.

    Every path is absolute and every setting is an argument, so they need no
    variable; one of the user's (PGOPTIONS, PGPASSWORD, PGDATA, a psqlrc)
    must not change what they do, and messages are in English, to be read in
    errors.
    """
    return {"LC_ALL": "C", "LANG": "C"}


class RunAs(TypedDict, total=False):
    user: int
    group: int
    extra_groups: list[int]


def run_as(user: OsUser | None) -> RunAs:
    """subprocess arguments that run a program as ``user`` (none when we run it as ourselves)."""
    return {} if user is None else {"user": user.uid, "group": user.gid, "extra_groups": []}
