"""``sluice dev``, ``sluice serve`` and ``sluice keys`` as a user runs them: real processes, real ports."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.local.embedded import free_port

pytestmark = pytest.mark.timeout(120)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["SLUICE_HOME"] = str(home)
    env.update(extra)
    return env


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the command exited with {proc.returncode}")
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the API did not become ready")


def _until(check: object, timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()  # type: ignore[operator]
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out")


def _stop(proc: subprocess.Popen[bytes]) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    return out.decode()


def _metrics(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(base + "/metrics", headers={"accept": "text/plain"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _servers_of(home: Path) -> list[str]:
    """Processes still running whose command line names the folder (redis, postgres, workers)."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if str(home) in line and "ps -eo" not in line]


def test_sluice_dev_runs_everything_and_stops_it_and_finds_its_data_again(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sluice", "dev", "--port", str(port)]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=_env(tmp_path / ".sluice", TMPDIR=str(scratch)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_ready(base, proc)
        job = httpx.post(base + "/jobs", json={"type": "generic", "payload": {"hello": "world"}}).json()
        done = _until(
            lambda: (r := httpx.get(f"{base}/jobs/{job['id']}").json())["status"] == "COMPLETED" and r
        )
        assert done["result"] == {"ok": True, "attempt": 1}  # type: ignore[index]
        page = httpx.get(base + "/", follow_redirects=True)
        assert page.status_code == 200 and '<meta name="sluice-auth" content="off">' in page.text
        # A dashboard watching (its live stream open) does not hold the stop up
        watching = threading.Event()

        def watch() -> None:
            with (
                contextlib.suppress(httpx.HTTPError),  # the stop cuts it
                httpx.stream("GET", base + "/v1/live", timeout=60) as stream,
            ):
                for _ in stream.iter_bytes():
                    watching.set()

        threading.Thread(target=watch, daemon=True).start()
        assert watching.wait(10)
        # The workers' series are in the API's own exposition (one shared multiprocess folder)
        found = _until(lambda: (m := _metrics(base)).get(("sluice_worker_processes", ())) == 2 and m)
        assert found[("sluice_api_processes", ())] == 1  # type: ignore[index]
        handled = (("job_type", "generic"), ("outcome", "completed"))
        assert found[("sluice_worker_handler_duration_seconds_count", handled)] == 1  # type: ignore[index]
        assert len(glob.glob(str(scratch / "sluice-dev-metrics-*"))) == 1
    finally:
        started = time.monotonic()
        out = _stop(proc)
    assert proc.returncode == 0, out
    assert time.monotonic() - started < 30, "the stop waited for the open stream"
    assert "NO AUTHENTICATION" in out and f"curl -s -X POST {base}/jobs" in out
    assert f"dashboard: {base}/dashboard/" in out
    assert f"{base}/metrics" in out
    assert _servers_of(tmp_path) == []  # Redis, PostgreSQL and the workers stopped with it
    assert glob.glob(str(scratch / "sluice-dev-metrics-*")) == []

    # A second run on the same folder finds the job again
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=_env(tmp_path / ".sluice"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        _wait_ready(base, proc)
        again = httpx.get(f"{base}/jobs/{job['id']}").json()
        assert again["status"] == "COMPLETED"
    finally:
        _stop(proc)
    assert _servers_of(tmp_path) == []


def test_sluice_serve_needs_a_key_from_sluice_keys(
    tmp_path: Path, redis_url: str, sluice_database_url: str
) -> None:
    env = _env(tmp_path, SLUICE_REDIS_URL=redis_url, SLUICE_DATABASE_URL=sluice_database_url)
    made = subprocess.run(
        [sys.executable, "-m", "sluice", "keys", "create", "--tenant", "acme", "--json"],
        env=env,
        capture_output=True,
        check=True,
    )
    key = json.loads(made.stdout)["key"]
    listed = subprocess.run(
        [sys.executable, "-m", "sluice", "keys", "list"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "acme" in listed and key not in listed and key[:10] in listed
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", "serve", "--port", str(port), "--queue", "served"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_ready(base, proc)
        assert httpx.post(base + "/jobs", json={"type": "generic", "payload": {}}).status_code == 401
        ok = httpx.post(
            base + "/jobs",
            json={"type": "generic", "payload": {}},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert ok.status_code == 201
    finally:
        _stop(proc)
    missing = subprocess.run(
        [sys.executable, "-m", "sluice", "serve"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 1 and "SLUICE_REDIS_URL" in missing.stderr
    down = subprocess.run(
        [sys.executable, "-m", "sluice", "serve", "--database", "postgresql://x@127.0.0.1:1/db"],
        env=_env(tmp_path, SLUICE_REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        check=False,
    )
    assert down.returncode == 1 and "Traceback" not in down.stderr
    assert "PostgreSQL at postgresql://x@127.0.0.1:1/db cannot be used" in down.stderr


def test_the_readmes_service_commands_run_as_written(tmp_path: Path) -> None:
    # The section's sh block: `sluice dev`, then curl lines (port 8000 becomes a free one, and
    # JOB_ID the id the first answer gave)
    text = (Path(__file__).parents[2] / "README.md").read_text()
    start = text.index("## Run the service\n")
    block = re.findall(r"^```sh\n(.*?)^```$", text[start : text.index("\n## ", start + 5)], re.M | re.S)[0]
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    lines = [words for words in lines if words]
    assert lines[0] == [".venv/bin/sluice", "dev"]
    assert all(words[0] == "curl" for words in lines[1:]) and len(lines) == 3
    port = free_port()
    argv = [sys.executable, "-m", "sluice", "dev", "--port", str(port)]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=_env(tmp_path / ".sluice"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        job_id = ""

        def curl(words: list[str]) -> dict[str, object]:
            argv = [w.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("JOB_ID", job_id) for w in words]
            out = subprocess.run(argv, capture_output=True, check=True).stdout
            answer: dict[str, object] = json.loads(out)
            return answer

        first = curl(lines[1])
        assert first["status"] == "QUEUED"
        job_id = str(first["id"])
        done = _until(lambda: (r := curl(lines[2]))["status"] == "COMPLETED" and r)
        assert done["result"] == {"sent": True, "to": "ada@example.com"}  # type: ignore[index]
    finally:
        _stop(proc)


def test_the_service_pages_llm_commands_run_as_written(tmp_path: Path) -> None:
    # docs/service.md, "LLM jobs and the semantic cache": `sluice dev` with no provider configured
    # (the offline model), two llm-inference submissions, then the second job: answered from the first's.
    text = (Path(__file__).parents[2] / "docs" / "service.md").read_text()
    start = text.index("## LLM jobs and the semantic cache\n")
    block = re.findall(r"^```sh\n(.*?)^```$", text[start : text.index("\n## ", start + 5)], re.M | re.S)[0]
    lines = [words for words in (shlex.split(line, comments=True) for line in block.splitlines()) if words]
    assert lines[0] == [".venv/bin/sluice", "dev"]
    assert [words[0] for words in lines[1:]] == ["curl", "curl", "curl"]
    port = free_port()
    env = {k: v for k, v in _env(tmp_path / ".sluice").items() if k not in ("AI_PROVIDER", "AI_MODEL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", "dev", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        job_id = ""

        def curl(words: list[str]) -> dict[str, object]:
            argv = [w.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("JOB_ID", job_id) for w in words]
            answer: dict[str, object] = json.loads(
                subprocess.run(argv, capture_output=True, check=True).stdout
            )
            return answer

        def completed(job: str) -> dict[str, object]:
            nonlocal job_id
            job_id = job
            found = _until(lambda: (r := curl(lines[3]))["status"] == "COMPLETED" and r, timeout=60)
            assert isinstance(found, dict)
            return found

        first = completed(str(curl(lines[1])["id"]))
        result = first["result"]
        assert isinstance(result, dict)
        assert result["cacheHit"] is False and result["provider"] == "offline"
        second = completed(str(curl(lines[2])["id"]))
        hit = second["result"]
        assert isinstance(hit, dict)
        assert hit["cacheHit"] is True and hit["similarity"] >= 0.92
        assert hit["response"] == result["response"] and hit["cost"] == 0.0
    finally:
        _stop(proc)
