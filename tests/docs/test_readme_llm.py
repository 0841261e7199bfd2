"""docs/using.md's "Flow control and budgets" example runs as written, against a provider on loopback.

Its python block is the file ``app/llm.py``: a worker whose handler calls an
OpenAI-compatible ``/v1/chat/completions``, and a producer that sets the
shared limits, creates a budget under a team and adds eight jobs. The test
serves the simulated provider (sluice.testing.provider, a real HTTP server
that counts what it bills), runs ``sluice worker app.llm:worker`` in two
processes and ``python app/llm.py``, as the page says, and then checks the
claims against what the provider saw, not what the ledger says of itself:
the budgets were charged exactly the tokens the provider billed, no more
than 4 calls ran at once, no 5 starts fell within one second, and every
summary was printed.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from sluice import JobState, Queue
from sluice.testing.provider import serve_provider
from sluice.testing.simulated_server import STATS_PATH, ProviderLimits
from tests.harness.proc_harness import REPO

SECTION = "## Flow control and budgets"


def example() -> str:
    text = (REPO / "docs" / "using.md").read_text()
    start = text.index(SECTION + "\n")
    end = text.index("\n## ", start + len(SECTION))
    blocks = re.findall(r"^```python\n(.*?)^```$", text[start:end], re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "the section should hold one python block, app/llm.py"
    assert blocks[0].startswith('"""app/llm.py:')
    return str(blocks[0])


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "llm.py").write_text(example())
    return tmp_path


@pytest.mark.slow
async def test_the_flow_control_example_spends_what_the_provider_billed(
    project: Path, redis_url: str, redis: Redis
) -> None:
    limits = ProviderLimits(requests=50, tokens=200_000, window=1.0, latency=0.25)
    with serve_provider(limits) as provider:
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(project),
            "SLUICE_REDIS_URL": redis_url,
            "PROVIDER_URL": provider,
            "OPENAI_API_KEY": "sk-test-not-a-real-key",
            "SLUICE_LOG_LEVEL": "warning",
        }
        worker_cmd = [sys.executable, "-m", "sluice", "worker", "app.llm:worker", "--processes", "2"]
        workers = subprocess.Popen(worker_cmd, cwd=project, env=env, stderr=subprocess.PIPE, text=True)  # noqa: ASYNC220
        try:
            producer = subprocess.run(  # noqa: ASYNC221 - the producer runs to its end, as in a terminal
                [sys.executable, "app/llm.py"],
                cwd=project,
                env=env,
                capture_output=True,
                text=True,
                timeout=90,
                check=False,
            )
        finally:
            workers.terminate()
            assert workers.wait(30) == 0, workers.stderr.read() if workers.stderr else ""
            if workers.stderr is not None:
                workers.stderr.close()
        async with httpx.AsyncClient(base_url=provider) as http:
            billed = (await http.get(STATS_PATH)).json()
    assert producer.returncode == 0, producer.stderr
    # Then every job printed its summary
    lines = producer.stdout.splitlines()
    assert len([line for line in lines if "(200 simulated tokens)" in line]) == 8, producer.stdout
    # And the budgets were charged exactly what the provider billed: the user's truth
    queue = Queue("llm", redis=redis)
    tenant, team = await queue.budgets.get("tenant-7"), await queue.budgets.get("team-a")
    assert billed["accepted"] == 8 and billed["rate_limited"] == 0
    assert tenant.used == team.used == billed["accepted_tokens"]
    assert f"tenant-7 spent {tenant.used:,} of 200,000 tokens today" in producer.stdout
    # And the shared limits held over both worker processes
    assert billed["max_in_flight"] <= 4
    records = [r for r in await queue.get_jobs([str(i) for i in range(1, 9)]) if r is not None]
    assert len(records) == 8 and all(r.state is JobState.COMPLETED for r in records)
    starts = sorted(r.started_ms or 0 for r in records)
    assert all(b - a >= 1000 for a, b in zip(starts, starts[4:], strict=False)), starts
    await redis.delete(*[k async for k in redis.scan_iter(match=queue.keys.base + "*")])


@pytest.mark.slow
def test_the_flow_control_example_passes_ruff_and_mypy_strict(project: Path) -> None:
    config = str(REPO / "pyproject.toml")
    # Line length 88: what the user's own project most likely uses (ruff's and black's default).
    ruff = [sys.executable, "-m", "ruff"]
    options = ["--no-cache", "--config", config, "--line-length", "88"]
    for argv in (
        [*ruff, "check", *options, "app/llm.py"],
        [*ruff, "format", "--check", *options, "app/llm.py"],
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(project / ".mypy"), "app/llm.py"],
    ):
        done = subprocess.run(argv, cwd=project, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, f"$ {shlex.join(argv[1:])}\n{done.stdout}{done.stderr}"
