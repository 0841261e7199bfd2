"""``sluice bench ingest``, short: the command runs end to end and its JSON says what the docs say.

The slow test runs the real command (its own Redis, ``sluice serve -p 2``,
generator and worker processes) for a few seconds at a low rate on the
session's PostgreSQL, and checks the file's structure and the race's
behaviour: one job per key and only 201s. Whether the rate targets are met
is the benchmark's verdict on a quiet machine, never a test's. The fast
tests check the load generator's open model against a slow local server:
a request's latency counts from when it was due, so time spent waiting for
a connection shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sluice_lab.ingest import judge
from sluice_lab.ingest_load import run as run_load
from sluice_lab.ingest_run import body_template
from sluice_lab.ingest_spec import ROUTES

INGEST_ROW = {
    "api_processes",
    "rate",
    "seconds",
    "sent",
    "ok",
    "errors",
    "statuses",
    "exceptions",
    "achieved_rate",
    "latency_ms",
    "send_lag_ms",
    "generator_cpu_us_per_request",
    "api_cpu_us_per_request",
    "redis_cpu_us_per_request",
    "postgres_cpu_us_per_request",
    "machine_busy_share",
    "sink_catch_up_s",
    "saturated",
    "met",
}
RACE_ROW = {
    "api_processes",
    "duplicates",
    "statuses",
    "exceptions",
    "distinct_ids",
    "store_rows",
    "engine_jobs",
    "engine_has_the_job",
    "answer_all_s",
    "passed",
}


def test_the_body_templates_are_json_with_a_key_per_request() -> None:
    for route in ROUTES:
        template, ok = body_template(route, "pre-")
        body = json.loads(template.replace("{i}", "7"))
        assert ok == 201 and body["type"] == "generic" and body["payload"] == {"n": 7}
        assert "pre-7" in body.values()


@contextlib.asynccontextmanager
async def _slow_server(delay: float, seen: list[float]) -> AsyncIterator[int]:
    """An HTTP/1.1 server that answers every request with a 201 after ``delay`` seconds; yields
    its port, and on leaving waits for its connections to end (the client closes them)."""
    loop = asyncio.get_running_loop()
    handlers: set[asyncio.Task[Any]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                seen.append(loop.time())
                await asyncio.sleep(delay)
                writer.write(b'HTTP/1.1 201 Created\r\ncontent-length: 11\r\n\r\n{"id":"x1"}')
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]
        server.close()
        await asyncio.wait_for(asyncio.gather(*handlers), 10)


async def test_open_model_latency_counts_from_the_due_time_not_the_send() -> None:
    # One connection, a server taking 0.1 s a request, 20 requests due over one second: they
    # queue for the connection, and the last is answered about a second after it was due. A
    # closed-loop client would report 0.1 s for each.
    seen: list[float] = []
    async with _slow_server(0.1, seen) as port:
        cfg: dict[str, Any] = {
            "mode": "rate",
            "host": "127.0.0.1",
            "port": port,
            "path": "/jobs",
            "body": '{"n":{i}}',
            "rate": 20,
            "seconds": 1,
            "max_connections": 1,
            "timeout": 30,
        }
        result = await run_load(cfg)
    assert result["sent"] == 20 and result["statuses"] == {"201": 20} and result["exceptions"] == {}
    latency = result["latency_us"]
    assert len(latency) == 20
    assert latency[-1] > 5 * latency[0]  # the wait for the connection is in the latency
    assert result["connections_opened"] == 1
    assert max(result["send_lag_us"]) > 500_000  # requests went out long after they were due


async def test_the_race_mode_writes_every_duplicate_before_reading_an_answer() -> None:
    seen: list[float] = []
    async with _slow_server(1.0, seen) as port:
        cfg = {"mode": "race", "host": "127.0.0.1", "port": port, "path": "/jobs", "body": "{}", "n": 50}
        result = await run_load(cfg)
    assert result["statuses"] == {"201": 50} and result["ids"] == {"x1": 50}
    assert max(seen) - min(seen) < 1.0  # all arrived before the first answer could have gone out


def test_judge_names_each_target_and_what_missed_it() -> None:
    row = {
        "api_processes": 2,
        "rate": 1500.0,
        "achieved_rate": 900.0,
        "errors": 3,
        "met": False,
        "latency_ms": {"p95_ms": 40.0, "p99_ms": 80.0},
    }
    race = {"duplicates": 2000, "passed": True}
    skipped = {"rate": 2000.0, "skipped": "1500/s saturated"}
    verdict = judge({"ingest": [row, skipped], "race": [race], "drain": {"ratio": 0.7}})
    assert verdict["ingest"]["met"] is False and verdict["ingest"]["best"]["achieved_rate"] == 900.0
    assert verdict["race"] == {"target": verdict["race"]["target"], "met": True, "largest": 2000}
    assert verdict["drain"]["met"] is True
    assert judge({"ingest": [], "race": [], "drain": None})["drain"]["met"] is False


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sluice_bench_ingest_short_run(tmp_path: Path, sluice_database_url: str) -> None:
    out = tmp_path / "ingest.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["COLUMNS"] = "200"
    argv = [sys.executable, "-m", "sluice", "bench", "ingest", "--rate", "20", "--seconds", "2"]
    argv += ["-p", "2", "--warmup", "0", "--race", "50", "--race", "100"]
    argv += [
        "--drain-jobs",
        "1000",
        "--drain-workers",
        "1",
        "--drain-concurrency",
        "20",
        "--drain-rounds",
        "2",
    ]
    argv += ["--database", sluice_database_url, "--json", str(out), "--logs", str(tmp_path / "logs")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=220, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data.keys() >= {"meta", "spec", "database", "ingest", "race", "drain", "targets"}
    assert data["meta"]["database"] == "given" and data["spec"]["api_processes"] == [2]

    [row] = data["ingest"]
    assert row.keys() >= INGEST_ROW
    assert row["sent"] == 40 and row["ok"] + row["errors"] == row["sent"]
    assert row["latency_ms"]["samples"] == sum(row["statuses"].values())
    assert row["latency_ms"].keys() >= {"p50_ms", "p95_ms", "p99_ms", "max_ms"}

    # The race: one job per key, every answer a 201 naming it, on both sizes.
    assert [r["duplicates"] for r in data["race"]] == [50, 100]
    for race in data["race"]:
        assert race.keys() >= RACE_ROW
        assert race["statuses"] == {"201": race["duplicates"]} and race["exceptions"] == {}
        assert (race["distinct_ids"], race["store_rows"], race["engine_jobs"]) == (1, 1, 1)
        assert race["engine_has_the_job"] and race["passed"]
    assert data["targets"]["race"]["met"] is True

    drain = data["drain"]
    assert drain["with_store"]["complete"] and drain["engine_alone"]["complete"]
    assert drain["with_store"]["store_rate"] > 0 and drain["engine_alone"]["engine_rate"] > 0
    assert isinstance(drain["ratio"], float)
    # Two pairs: the ratio is the lower of the two (the median's lower middle), and its pair's
    # drains are the ones reported.
    assert len(drain["rounds"]) == 2
    assert drain["ratio"] == min(r["ratio"] for r in drain["rounds"])
    [median] = [r for r in drain["rounds"] if r["ratio"] == drain["ratio"]][:1]
    assert median["store_rate"] == drain["with_store"]["store_rate"]
    assert "median of 2 pairs" in done.stdout
    assert set(data["targets"]) == {"ingest", "race", "drain"}
    assert "The idempotency race" in done.stdout and "Targets" in done.stdout
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize("server", ["redis", "database"])
def test_a_given_server_that_is_down_is_named_with_what_to_do(server: str) -> None:
    from sluice.local.embedded import free_port

    down = (
        f"redis://127.0.0.1:{free_port()}/0"
        if server == "redis"
        else f"postgresql://u:pw@127.0.0.1:{free_port()}/x"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")} | {"COLUMNS": "400"}
    argv = [
        sys.executable,
        "-m",
        "sluice",
        "bench",
        "ingest",
        f"--{server}",
        down,
        "-r",
        "10",
        "--seconds",
        "1",
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert "internal error" not in said and "Traceback" not in said
    if server == "redis":
        assert f"Redis at {down} is unavailable" in said and "--redis or SLUICE_REDIS_URL" in said
    else:
        assert "PostgreSQL at postgresql://u:***@127.0.0.1" in said and "cannot be reached" in said
        assert "pw" not in said and "check --database or SLUICE_DATABASE_URL" in said
