"""The embedded redis-server the CLI starts when no URL is configured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis as sync_redis

from sluice.errors import ConfigurationError
from sluice.testing.embedded import EmbeddedRedis, find_binary

ROOT = Path(__file__).resolve().parent.parent


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


def test_cli_demo_runs_end_to_end(tmp_path: Path) -> None:
    # Given no SLUICE_REDIS_URL: the demo starts its own Redis under SLUICE_HOME
    env = {"PATH": "/usr/bin:/bin", "SLUICE_HOME": str(tmp_path), "HOME": str(tmp_path), "COLUMNS": "120"}
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
