"""Commands share one embedded Redis per folder; the last one out stops it (sluice.local.shared).

Every test runs real ``sluice`` processes on one SLUICE_HOME, as a user runs
them in several terminals, and looks at the real server: its pid in
server.json, whether that process lives, its socket, its data after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from sluice import Queue
from sluice.local import shared
from sluice.local.embedded import RedisBinary, pid_alive, probe
from sluice.local.shared import ServerRecord, SharedRedis
from tests.conftest import SERVERS

REPO = Path(__file__).resolve().parents[2]
SLUICE = (sys.executable, "-m", "sluice")
WAIT = 20.0


class Command:
    """One process in a session of its own, as if in a terminal of its own; stdout and stderr in files.

    Files, not pipes: a pipe could fill up and block it.
    """

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, logs: Path, name: str) -> None:
        self.argv = argv
        self.name = name
        self.out_path = logs / f"{name}.out"
        self.err_path = logs / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = WAIT) -> re.Match[str]:
        """Wait until stdout matches ``pattern`` (a regular expression)."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.stdout(), re.MULTILINE)):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} printed no {pattern!r}:\n{self.describe()}")
            time.sleep(0.02)
        return found

    def json(self, index: int = 0, timeout: float = WAIT) -> dict[str, Any]:
        """The ``index``-th JSON line it printed (``--json``), once it is complete."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.stdout().split("\n")[:-1]  # the last piece may be a line being written
            lines = [line for line in done if line.startswith("{")]
            if len(lines) > index:
                value: dict[str, Any] = json.loads(lines[index])
                return value
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} printed no JSON line #{index}:\n{self.describe()}")
            time.sleep(0.02)

    def send(self, sig: signal.Signals) -> None:
        self.popen.send_signal(sig)

    def ctrl_c(self) -> None:
        """What Ctrl-C in its terminal does: SIGINT to every process of its foreground group."""
        os.killpg(self.pid, signal.SIGINT)

    def wait(self, timeout: float = WAIT) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still runs after {timeout}s:\n{self.describe()}") from None

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.argv)}  (pid {self.pid}, exit {self.popen.poll()})\n"
            f"--- stdout\n{self.stdout()}--- stderr\n{self.stderr()}"
        )


class Terminals:
    """Commands run as a user runs them in several terminals, on one SLUICE_HOME.

    Closing kills every process still running and stops the folder's server
    if a failed test left it up, then prints every command's output (pytest
    shows it for a failed test).
    """

    def __init__(self, home: Path, logs: Path, cwd: Path = REPO, *, home_in_env: bool = True) -> None:
        self.home = home
        self.home_in_env = home_in_env  # False: the commands find `home` as the default ./.sluice of cwd
        self.folder = shared.RedisFolder(home)
        self.logs = logs
        self.cwd = cwd
        self.commands: list[Command] = []
        logs.mkdir(parents=True, exist_ok=True)

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")} | {"COLUMNS": "200"}
        if self.home_in_env:
            env["SLUICE_HOME"] = str(self.home)
        return env | extra

    def start(self, *args: str, argv: list[str] | None = None, env: dict[str, str] | None = None) -> Command:
        """Start ``sluice ARGS`` (or ``argv``) in the background."""
        argv = argv or [*SLUICE, *args]
        name = "-".join([str(len(self.commands) + 1), *(w for w in argv[1:] if w.isidentifier())][:3])
        command = Command(argv, self.env(env or {}), self.cwd, self.logs, name)
        self.commands.append(command)
        return command

    def run(self, *args: str, timeout: float = 60.0) -> Command:
        """Run ``sluice ARGS`` to its end."""
        command = self.start(*args)
        command.wait(timeout)
        return command

    def server(self) -> ServerRecord | None:
        return self.folder.read_record()

    def close(self) -> None:
        for command in self.commands:
            if command.popen.poll() is None:
                command.popen.kill()
            command.popen.wait(10)
        left = self.server()
        if left is not None and pid_alive(left.pid):
            with contextlib.suppress(Exception):
                shared.stop(self.home)
            if pid_alive(left.pid):
                os.kill(left.pid, signal.SIGKILL)
        for command in self.commands:
            print(command.describe())


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "h"
    # The tests are about the unix socket: a path too long for one would test the port fallback.
    assert len(str(home / "redis" / "redis.sock")) <= 100, "tmp_path is too long for a unix socket"
    return home


@pytest.fixture
def terminals(home: Path, tmp_path: Path) -> Iterator[Terminals]:
    t = Terminals(home, tmp_path / "logs")
    try:
        yield t
    finally:
        t.close()


def gone(record: ServerRecord, timeout: float = WAIT) -> bool:
    """True once the server's process has exited (and stays so); False if it still runs after ``timeout``."""
    deadline = time.monotonic() + timeout
    while pid_alive(record.pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def assert_stopped(terminals: Terminals, record: ServerRecord) -> None:
    assert gone(record), f"redis-server pid {record.pid} still runs"
    assert terminals.server() is None, "server.json outlived its server"
    assert record.socket is not None and not Path(record.socket).exists(), "the socket outlived the server"


async def add_and_wait(url: str, prefix: str, job: str) -> tuple[str, Any]:
    queue = Queue.from_url(url, "q", prefix=prefix)
    try:
        handle = await queue.add("task", {"job": job})
        return handle.id, await handle.result(timeout=WAIT)
    finally:
        await queue.close()


async def workers_seen(url: str, prefix: str, count: int) -> None:
    queue = Queue.from_url(url, "q", prefix=prefix)
    try:
        deadline = time.monotonic() + WAIT
        while await queue.redis.hlen(queue.keys.workers) < count:
            assert time.monotonic() < deadline, f"fewer than {count} worker(s) registered"
            await asyncio.sleep(0.05)
    finally:
        await queue.close()


async def job_state(url: str, prefix: str, job_id: str) -> tuple[str, Any]:
    queue = Queue.from_url(url, "q", prefix=prefix)
    try:
        record = await queue.get_job(job_id)
        assert record is not None, f"job {job_id} is gone after the restart"
        return record.state.value, record.result
    finally:
        await queue.close()


@pytest.mark.slow
@pytest.mark.parametrize("binary", [b for _, b in SERVERS], ids=[n for n, _ in SERVERS])
def test_commands_share_one_server_and_the_last_one_out_stops_it(
    terminals: Terminals, home: Path, prefix: str, binary: RedisBinary
) -> None:
    # Given `sluice redis` in one terminal, and a worker started with no URL in another
    first = terminals.start("redis", "--json", env={"SLUICE_REDIS_SERVER": binary.path})
    started = first.json()
    url, pid = started["url"], started["pid"]
    assert started["started"] is True and started["version"] == binary.version
    assert url.startswith("unix://") and started["export"] == f"export SLUICE_REDIS_URL={url}"
    worker = terminals.start(
        "worker",
        "tests.harness.proc_workers:worker",
        "--queue",
        "q",
        "--worker-id",
        "w1",
        env={"SLUICE_TEST_REDIS": url, "SLUICE_TEST_PREFIX": prefix},
    )
    asyncio.run(workers_seen(url, prefix, 1))
    # Then both use the same server, and status counts both
    status = terminals.run("redis", "status", "--json")
    assert status.popen.returncode == 0, status.describe()
    seen = json.loads(status.stdout())
    assert (seen["pid"], seen["url"]) == (pid, url)
    assert sorted(u["label"] for u in seen["users"]) == ["sluice redis", "sluice worker"]

    # When the first one is stopped with Ctrl-C while the worker still uses the server
    first.ctrl_c()
    assert first.wait() == 0, first.describe()
    assert first.json(1) == {"left": True, "others": 1, "stopped": False}
    # Then the server runs on (the same process), and the worker still completes jobs
    record = terminals.server()
    assert record is not None and record.pid == pid and probe(record.address) == pid
    job_id, result = asyncio.run(add_and_wait(url, prefix, "after the first left"))
    assert result == {"worker": "w1", "attempt": 1}

    # When the last user leaves, the server stops: process, socket and record are gone
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.describe()
    assert_stopped(terminals, record)

    # And its data survives a restart (the append-only file)
    with SharedRedis(home, binary=binary) as again:
        assert again == url
        assert asyncio.run(job_state(url, prefix, job_id)) == ("completed", result)
    assert_stopped(terminals, record)


@pytest.mark.slow
def test_a_killed_user_does_not_keep_the_server_alive(terminals: Terminals, home: Path) -> None:
    # Given a starter and a second user, which is then killed with SIGKILL
    first = terminals.start("redis", "--json")
    pid = first.json()["pid"]
    record = terminals.server()
    assert record is not None and record.pid == pid
    second = terminals.start("redis", "--json")
    assert second.json()["pid"] == pid and second.json()["users"] == 1
    second.send(signal.SIGKILL)
    second.wait()
    # When the starter leaves
    first.send(signal.SIGTERM)
    assert first.wait() == 0, first.describe()
    # Then it counted no live user, stopped the server, and deleted the dead one's file
    assert first.json(1) == {"left": True, "others": 0, "stopped": True}
    assert_stopped(terminals, record)
    assert list((home / "redis" / "users").iterdir()) == []


@pytest.mark.slow
def test_a_killed_starters_server_is_adopted_and_stopped_by_the_last_one_out(
    terminals: Terminals,
) -> None:
    # Given a server whose starter was killed with SIGKILL
    starter = terminals.start("redis", "--json")
    pid = starter.json()["pid"]
    starter.send(signal.SIGKILL)
    starter.wait()
    record = terminals.server()
    assert record is not None and record.pid == pid
    assert probe(record.address) == pid, (
        "the server died with its starter (it must have a session of its own)"
    )

    # When another command comes, it adopts that server (no second one)
    adopter = terminals.start("redis", "--json")
    adopted = adopter.json()
    assert (adopted["pid"], adopted["started"], adopted["users"]) == (pid, False, 0)
    # and a short command in between uses it without starting or stopping anything
    info = terminals.run("info")
    assert info.popen.returncode == 0, info.describe()
    assert "started the embedded Redis" not in info.stderr() + info.stdout()
    assert probe(record.address) == pid

    # Then the last one out stops it
    adopter.send(signal.SIGINT)
    assert adopter.wait() == 0, adopter.describe()
    assert adopter.json(1)["stopped"] is True
    assert_stopped(terminals, record)


@pytest.mark.slow
def test_commands_starting_at_once_start_exactly_one_server(terminals: Terminals, home: Path) -> None:
    # When three commands start at the same moment on an empty folder
    commands = [terminals.start("redis", "--json") for _ in range(3)]
    seen = [c.json() for c in commands]
    # Then they found one server: one of them started it, the others adopted it
    assert len({s["pid"] for s in seen}) == 1, seen
    assert sorted(s["started"] for s in seen) == [False, False, True]
    log = (home / "redis" / "redis.log").read_text()
    assert log.count("Redis is starting") == 1, log
    record = terminals.server()
    assert record is not None
    # And it stops with the last one (whichever order they leave in)
    for left, c in enumerate(reversed(commands), 1):
        c.send(signal.SIGTERM)
        assert c.wait() == 0, c.describe()
        assert c.json(1)["stopped"] is (left == 3)
        assert (probe(record.address) == record.pid) is (left < 3)
    assert_stopped(terminals, record)


#: A process that attaches the moment a gate file appears, and detaches when a second one does.
GATED_ATTACH = """
import json, sys, time
from pathlib import Path
from sluice.local.shared import SharedRedis
start, leave, home = (Path(a) for a in sys.argv[1:4])
print("ready", flush=True)
while not start.exists():
    time.sleep(0.001)
shared = SharedRedis(home)
shared.attach()
print(json.dumps({"pid": shared.record.pid, "started": shared.started}), flush=True)
while not leave.exists():
    time.sleep(0.01)
print(json.dumps({"others": shared.detach()}), flush=True)
"""


@pytest.mark.slow
def test_processes_attaching_at_the_same_instant_start_one_server(
    terminals: Terminals, home: Path, tmp_path: Path
) -> None:
    # Given four processes ready to attach, all at the same instant (within a millisecond)
    start, leave = tmp_path / "start", tmp_path / "leave"
    argv = [sys.executable, "-c", GATED_ATTACH, str(start), str(leave), str(home)]
    procs = [terminals.start(argv=argv) for _ in range(4)]
    for p in procs:
        p.wait_for("^ready$")
    start.touch()
    seen = [p.json() for p in procs]
    # Then exactly one started a server, and all use it
    assert len({s["pid"] for s in seen}) == 1 and sum(s["started"] for s in seen) == 1, seen
    log = (home / "redis" / "redis.log").read_text()
    assert log.count("Redis is starting") == 1, log
    record = terminals.server()
    assert record is not None
    # And when all leave at the same instant, exactly one sees itself last and stops it
    leave.touch()
    assert [p.wait() for p in procs] == [0, 0, 0, 0]
    assert sorted(p.json(1)["others"] for p in procs) == [0, 1, 2, 3]
    assert_stopped(terminals, record)


@pytest.mark.slow
def test_status_and_stop(terminals: Terminals, home: Path) -> None:
    # Nothing runs: status says so with exit code 1, stop has nothing to do
    status = terminals.run("redis", "status")
    assert status.popen.returncode == 1 and "no Redis runs for" in status.stdout()
    nothing = terminals.run("redis", "stop", "--yes")
    assert nothing.popen.returncode == 0 and "nothing to stop" in nothing.stdout()

    user = terminals.start("redis")
    url = user.wait_for(r"^export SLUICE_REDIS_URL=(\S+)$").group(1)
    record = terminals.server()
    assert record is not None and record.url == url
    status = terminals.run("redis", "status")
    assert status.popen.returncode == 0, status.describe()
    out = status.stdout()
    assert url in out and f"pid {record.pid}" in out and record.version in out
    assert f"users   1: pid {user.pid} (sluice redis)" in out

    # stop asks first when commands use it; "no" (or no terminal to answer) leaves it running
    refused = terminals.start("redis", "stop")
    refused.popen.wait(WAIT)
    assert refused.popen.returncode == 1, refused.describe()
    assert "1 command(s) still use it" in refused.stdout()
    assert probe(record.address) == record.pid

    # --yes stops it, says whom it strands, and the stranded command notices
    stopped = terminals.run("redis", "stop", "--yes")
    assert stopped.popen.returncode == 0, stopped.describe()
    assert f"(pid {record.pid}); stranded 1 command(s)" in stopped.stdout()
    assert_stopped(terminals, record)
    assert user.wait() == 1
    assert "it stopped while `sluice redis` used it" in user.stderr()
    assert terminals.run("redis", "status").popen.returncode == 1


@pytest.mark.slow
def test_a_command_alone_starts_the_server_and_stops_it(terminals: Terminals, home: Path) -> None:
    info = terminals.run("info")
    assert info.popen.returncode == 0, info.describe()
    assert "started the embedded Redis" in info.stderr() + info.stdout()
    log = (home / "redis" / "redis.log").read_text()
    assert log.count("Redis is starting") == 1
    assert "ready to exit, bye bye" in log  # SHUTDOWN, not a kill
    assert terminals.server() is None
    assert not (home / "redis" / "redis.sock").exists()


@pytest.mark.slow
def test_a_port_instead_of_the_socket(terminals: Terminals) -> None:
    server = terminals.start("redis", "--port", "0", "--json")
    described = server.json()
    # A port is open to every local user: the server has a password, shown only in the export line
    assert re.fullmatch(r"redis://\*\*\*@127\.0\.0\.1:\d+/0", described["url"]), described
    record = terminals.server()
    assert record is not None and record.socket is None and record.port == described["port"]
    assert record.password and described["export"] == f"export SLUICE_REDIS_URL={record.url}"
    assert record.url == f"redis://:{record.password}@127.0.0.1:{record.port}/0"
    assert probe(record.address) is None  # without the password it answers nothing
    assert probe(record.address, password=record.password) == record.pid
    # and the password is in no command line (ps shows those to everyone) and no readable file
    assert record.password not in " ".join(psutil.Process(record.pid).cmdline())
    for secret in (terminals.home / "redis" / "secret.conf", terminals.home / "redis" / "server.json"):
        assert secret.stat().st_mode & 0o077 == 0, secret
    # asking for another port while it runs is an error that says what to do
    other = terminals.run("redis", "--port", str(record.port + 1))
    assert other.popen.returncode == 1
    assert "already runs at" in other.stderr() and "sluice redis stop" in other.stderr()
    server.send(signal.SIGTERM)
    assert server.wait() == 0
    assert gone(record)


@pytest.mark.slow
def test_a_command_given_the_folders_url_is_a_user_too(terminals: Terminals, home: Path, prefix: str) -> None:
    # Given `sluice redis` in one terminal, and a worker given its exported URL in another,
    # as the README's library example does
    first = terminals.start("redis", "--json")
    url = first.json()["url"]
    worker = terminals.start(
        "worker",
        "tests.harness.proc_workers:worker",
        "--queue",
        "q",
        env={"SLUICE_REDIS_URL": url, "SLUICE_TEST_REDIS": url, "SLUICE_TEST_PREFIX": prefix},
    )
    asyncio.run(workers_seen(url, prefix, 1))
    # Then the worker counts as a user
    status = terminals.run("redis", "status", "--json")
    assert sorted(u["label"] for u in json.loads(status.stdout())["users"]) == [
        "sluice redis",
        "sluice worker",
    ]
    # When terminal 1 is stopped first, the server stays up for the worker
    first.ctrl_c()
    assert first.wait() == 0, first.describe()
    assert first.json(1) == {"left": True, "others": 1, "stopped": False}
    record = terminals.server()
    assert record is not None and probe(record.address) == record.pid
    # And when the worker, its last user, stops, so does the server
    worker.send(signal.SIGTERM)
    assert worker.wait() == 0, worker.describe()
    assert_stopped(terminals, record)
    # And a URL of another Redis makes no user, and no folder
    other = terminals.run("info", "--redis", "redis://127.0.0.1:1/0")
    assert other.popen.returncode == 1
    assert not (home / "redis" / "server.json").exists()
