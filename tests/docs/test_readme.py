"""The README's library example runs as written, as a newcomer runs it, in a fresh folder.

The test reads the section "## Use it as a library": its ``sh`` block (the
commands, one terminal after another) and its ``python`` block (the file
``app/tasks.py``). It writes that file into an empty folder and runs the
commands there with a clean environment: ``.venv/bin/sluice`` becomes this
interpreter's ``-m sluice``, ``.venv/bin/python`` this interpreter, and
``export SLUICE_REDIS_URL=...`` the line that ``sluice redis`` printed. A
line it does not know how to run fails the test, so the README and this test
cannot drift apart silently.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sluice import JobState, Queue, Worker
from sluice.local.embedded import probe
from tests.local.test_shared_redis import REPO, Command, Terminals, assert_stopped

SECTION = "## Use it as a library"
ENV_URL = "SLUICE_REDIS_URL"


def section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else None]


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", section(), re.MULTILINE | re.DOTALL)


def commands() -> list[list[str]]:
    """The sh block's commands, as argv lists, comments and blank lines left out."""
    out = []
    for line in blocks("sh")[0].splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


def local_argv(words: list[str]) -> list[str]:
    """The README's command with this test's interpreter in place of the project's venv."""
    program, *rest = words
    if program in (".venv/bin/sluice", "sluice"):
        return [sys.executable, "-m", "sluice", *rest]
    if program in (".venv/bin/python", "python", "python3"):
        return [sys.executable, *rest]
    raise AssertionError(f"the README's sh block runs {shlex.join(words)!r}, which this test cannot run")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A fresh folder holding only the README's app/tasks.py."""
    folder = tmp_path / "project"
    (folder / "app").mkdir(parents=True)
    assert "app/tasks.py" in section(), "the README no longer says where the python block goes"
    (folder / "app" / "tasks.py").write_text(blocks("python")[0])
    return folder


def load_worker(project: Path) -> Worker:
    spec = importlib.util.spec_from_file_location("readme_tasks", project / "app" / "tasks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    worker = module.worker
    assert isinstance(worker, Worker)
    return worker


async def the_job(url: str, worker: Worker) -> tuple[JobState, object, str | None]:
    queue = Queue.from_url(url, worker.queue_name, prefix=worker.prefix)
    try:
        record = await queue.get_job("1")
        assert record is not None, "the producer added no job"
        return record.state, record.result, record.worker
    finally:
        await queue.close()


@pytest.mark.slow
def test_the_library_example_runs_as_written(project: Path, tmp_path: Path) -> None:
    # Each command runs from the project folder, with no SLUICE_* variable but what the README sets
    terminals = Terminals(project / ".sluice", tmp_path / "logs", cwd=project, home_in_env=False)
    env: dict[str, str] = {}
    url: str | None = None
    background: dict[str, Command] = {}
    producer: Command | None = None
    try:
        for words in commands():
            if words[0] == "source" and words[1:] == [".venv/bin/activate"]:
                continue  # puts .venv/bin on PATH; the commands below are spelled out in full
            if words[0] == "export":
                name, _, value = words[1].partition("=")
                if name == ENV_URL:
                    assert url is not None, f"the README exports {ENV_URL} before `sluice redis` printed it"
                    value = url
                env[name] = value
                continue
            argv = local_argv(words)
            command = terminals.start(argv=argv, env=env)
            if argv[1:3] == ["-m", "sluice"] and argv[3] == "redis":
                # Then `sluice redis` prints the line to paste, and its URL works
                export = command.wait_for(rf"^export {ENV_URL}=(\S+)$")
                url = shlex.split(export.group(0))[1].partition("=")[2]
                background["redis"] = command
            elif argv[1:3] == ["-m", "sluice"]:
                background[argv[3]] = command
            else:
                assert producer is None, "the README runs two programs to the end; which is the producer?"
                producer = command
                assert producer.wait(60) == 0, producer.describe()
        assert url is not None and producer is not None and "worker" in background, commands()

        # Then the producer printed the result of the job the worker process ran
        state, result, ran_on = asyncio.run(the_job(url, load_worker(project)))
        assert state is JobState.COMPLETED
        assert str(result) in producer.stdout(), producer.describe()
        for claimed in re.findall(r"producer prints `([^`]+)`", " ".join(section().split())):
            assert claimed in producer.stdout(), f"the README says the producer prints {claimed}"
        assert ran_on is not None and f":{background['worker'].pid}:" in ran_on

        # And Ctrl-C in each terminal stops the worker, then the Redis, cleanly
        record = terminals.server()
        assert record is not None and probe(record.address) == record.pid
        for name in ("worker", "redis"):
            background[name].ctrl_c()
            assert background[name].wait() == 0, background[name].describe()
        assert_stopped(terminals, record)
    finally:
        terminals.close()


@pytest.mark.slow
def test_the_library_example_passes_ruff_and_mypy_strict(project: Path) -> None:
    tasks = "app/tasks.py"
    config = str(REPO / "pyproject.toml")
    # Line length 88: what the user's own project most likely uses (ruff's and black's default).
    ruff = [sys.executable, "-m", "ruff"]
    options = ["--no-cache", "--config", config, "--line-length", "88"]
    checks = [
        [*ruff, "check", *options, tasks],
        [*ruff, "format", "--check", "--diff", *options, tasks],
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(project / ".mypy_cache"), tasks],
    ]
    for argv in checks:
        done = subprocess.run(argv, cwd=project, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, f"$ {shlex.join(argv[1:])}\n{done.stdout}{done.stderr}"


def test_the_python_block_is_the_worker_module() -> None:
    # The commands run `sluice worker app.tasks:worker` and `python app/tasks.py` on the python block
    code = blocks("python")[0]
    assert ["sluice", "worker", "app.tasks:worker"] in [
        [w.removeprefix(".venv/bin/") for w in c] for c in commands()
    ]
    assert 'if __name__ == "__main__":' in code and ENV_URL in code
