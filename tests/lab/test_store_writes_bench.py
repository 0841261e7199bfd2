"""benchmarks/store_writes.py: each variant drains every job it stored, and the figures are written."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
from sqlalchemy.engine import make_url

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "store_writes.py"


async def _databases(url: str) -> set[str]:
    conn = await asyncpg.connect(
        make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    )
    try:
        return {r[0] for r in await conn.fetch("SELECT datname FROM pg_database")}
    finally:
        await conn.close()


async def test_every_variant_runs_and_leaves_no_database_behind(
    sluice_database_url: str, tmp_path: Path
) -> None:
    before = await _databases(sluice_database_url)
    out = tmp_path / "writes.json"
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(SCRIPT), "--database", sluice_database_url, "--jobs", "3000", "--batch", "700",
         "--reps", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["summary"]] == [
        "as built",
        "wide jobs",
        "attempts FK",
        "no attempts",
    ]
    # The server is on this machine: the backend's CPU is read, for every run.
    assert all(r["backend_cpu_us_per_job"] is not None for r in result["runs"])
    assert result["summary"][0]["vs_first"] == 1.0
    assert await _databases(sluice_database_url) == before


def test_a_server_that_is_down_is_named_with_what_to_do() -> None:
    down = "postgresql://postgres:secret@127.0.0.1:1/x"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--database", down, "--jobs", "10"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "error: PostgreSQL at postgresql://postgres:***@127.0.0.1:1/x failed" in done.stderr
    assert "secret" not in done.stderr and "Traceback" not in done.stderr


def test_bad_arguments_say_what_is_wrong() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--jobs", "0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "--jobs, --batch and --reps must be at least 1" in done.stderr
