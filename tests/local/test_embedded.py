"""The embedded redis-server: one owned by one object, and the per-folder server commands share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as sync_redis

from sluice.errors import ConfigurationError
from sluice.local.embedded import EmbeddedRedis, find_binary, pid_alive, probe, shutdown
from sluice.local.shared import RedisFolder, SharedRedis

ROOT = Path(__file__).resolve().parents[2]


def test_unix_socket_server_persists_across_restarts(tmp_path: Path) -> None:
    data = tmp_path / "r"
    with EmbeddedRedis(data) as server:
        assert server.url.startswith("unix://")
        client = sync_redis.Redis.from_url(server.url, socket_timeout=5)
        client.set("kept", "yes")
        client.close()
    with EmbeddedRedis(data) as server:
        client = sync_redis.Redis.from_url(server.url, socket_timeout=5)
        assert client.get("kept") == b"yes"
        client.close()


def test_long_paths_fall_back_to_a_loopback_port(tmp_path: Path) -> None:
    deep = tmp_path / ("x" * 120)
    with EmbeddedRedis(deep, persist=False) as server:
        assert server.url.startswith("redis://127.0.0.1:")
        assert sync_redis.Redis.from_url(server.url, socket_timeout=5).ping()


def test_an_explicit_binary_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"SLUICE_REDIS_SERVER=.* is not an executable"):
        find_binary(str(tmp_path / "missing"))


def test_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a", port=0, persist=False) as first:
        taken = first.port
        second = EmbeddedRedis(tmp_path / "b", port=taken, persist=False)
        with pytest.raises(ConfigurationError, match="exited at start"):
            second.start()


def test_probe_names_the_process_that_answers(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "r", persist=False) as server:
        assert server.process is not None
        assert probe(server.address) == server.process.pid
    assert probe(server.address) is None
    assert probe(("127.0.0.1", 1)) is None


def test_a_detached_server_outlives_its_session_and_shutdown_keeps_its_data(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r", detached=True)
    server.start()
    assert server.process is not None
    pid = server.process.pid
    try:
        # a session of its own: a Ctrl-C in the starter's terminal does not reach it
        assert os.getsid(pid) == pid != os.getsid(0)
        client = sync_redis.Redis.from_url(server.url, socket_timeout=5)
        client.set("kept", "yes")
        client.close()
        assert shutdown(server.address)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists():  # the starter's reaper thread collects it: no zombie stays
            assert time.monotonic() < deadline, f"pid {pid} was not reaped after SHUTDOWN"
            time.sleep(0.02)
        assert not pid_alive(pid) and server.process.wait(5) == 0
    finally:
        server.stop()
    with EmbeddedRedis(tmp_path / "r") as again:
        client = sync_redis.Redis.from_url(again.url, socket_timeout=5)
        assert client.get("kept") == b"yes"
        client.close()


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen(["true"])
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not pid_alive(child.pid)  # exited, not yet reaped
    finally:
        child.wait()
    assert not pid_alive(child.pid)
    assert pid_alive(os.getpid())


def test_two_users_in_one_process_share_and_the_last_stops_it(tmp_path: Path) -> None:
    first, second = SharedRedis(tmp_path, label="first"), SharedRedis(tmp_path, label="second")
    url = first.attach()
    assert first.started and second.attach() == url and not second.started
    assert first.record == second.record and first.record is not None
    pid = first.record.pid
    assert [u.label for u in first.users()] == ["second"]
    assert first.detach() == 1 and probe(first.record.address) == pid
    assert second.detach() == 0 and not pid_alive(pid)
    assert RedisFolder(tmp_path).read_record() is None


def test_a_stale_record_is_replaced(tmp_path: Path) -> None:
    # Given a server.json naming a process that is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    folder = RedisFolder(tmp_path)
    folder.path.mkdir(parents=True)
    record = {
        "url": f"unix://{folder.path}/redis.sock",
        "pid": dead.pid,
        "version": "7.0.0",
        "binary": "/usr/bin/redis-server",
        "origin": "system",
        "socket": f"{folder.path}/redis.sock",
        "port": 0,
        "started_by": dead.pid,
        "started_at": 0.0,
    }
    folder.record_path.write_text(json.dumps(record))
    # Then the next user starts a server and records it instead
    with SharedRedis(tmp_path) as url:
        now = folder.read_record()
        assert now is not None and now.pid != dead.pid and probe(now.address) == now.pid
        client = sync_redis.Redis.from_url(url, socket_timeout=5)
        assert client.ping()
        client.close()
    assert folder.read_record() is None


def test_a_server_the_record_does_not_name_is_left_alone(tmp_path: Path) -> None:
    # Given a redis-server on the folder's data and socket that server.json does not name
    with EmbeddedRedis(RedisFolder(tmp_path).path) as stranger:
        # Then a user refuses to start a second server on the same data, and says why
        with pytest.raises(ConfigurationError, match="does not name answers on"):
            SharedRedis(tmp_path).attach()
        assert stranger.process is not None and probe(stranger.address) == stranger.process.pid
    assert list((RedisFolder(tmp_path).users_path).iterdir()) == []


def test_cli_demo_runs_end_to_end(tmp_path: Path) -> None:
    # Given no SLUICE_REDIS_URL: the demo starts the shared Redis of SLUICE_HOME, and stops it after
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env |= {"SLUICE_HOME": str(tmp_path), "HOME": str(tmp_path), "COLUMNS": "120"}
    out = subprocess.run(
        [sys.executable, "-m", "sluice", "demo", "--jobs", "60", "--processes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert "60/60 completed" in out.stdout
    assert "worker-1" in out.stdout and "worker-2" in out.stdout
    assert (tmp_path / "redis").is_dir()
    assert RedisFolder(tmp_path).read_record() is None
    assert not (tmp_path / "redis" / "redis.sock").exists()
