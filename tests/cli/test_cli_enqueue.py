"""``sluice enqueue``: every JobSpec option, job names checked against live workers, --file, --wait."""

from __future__ import annotations

import json
from pathlib import Path

from redis.asyncio import Redis

from sluice import JobContext, PermanentError, Queue, Worker
from sluice.cli.enqueue_cmd import PROGRESS_FROM
from tests.cli.test_cli import invoke
from tests.conftest import eventually, running


async def summarize(job: JobContext) -> dict[str, str]:
    return {"summary": str(job.payload["text"])[:5]}


async def translate(job: JobContext) -> None:
    return None


async def fail(job: JobContext) -> None:
    raise PermanentError("the model refused\nsecond line")


def serving_worker(queue: str, prefix: str) -> Worker:
    return Worker(
        queue, prefix=prefix, handlers={"summarize": summarize, "translate": translate, "fail": fail}
    )


async def test_every_option_reaches_the_job(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("opts", redis=redis, prefix=prefix)
    await q.budgets.create("team", 10_000)
    where = ["-q", "opts", "--prefix", prefix, "--redis", redis_url]
    options = [
        "--priority",
        "5",
        "--delay",
        "60",
        "--max-attempts",
        "4",
        "--timeout",
        "30",
        "--max-stalls",
        "2",
    ]
    ledger = ["--tokens", "900", "--budget", "team", "--on-exhausted", "wait", "--idempotency-key", "k"]
    await invoke("enqueue", "summarize", '{"text": "hi"}', *options, *ledger, *where)
    r = await q.get_job("1")
    assert r is not None
    assert (r.priority, r.max_attempts, r.timeout, r.max_stalls, r.state) == (5, 4, 30.0, 2, "delayed")
    assert (r.tokens, r.budget, r.on_exhausted, r.idempotency_key) == (900, "team", "wait", "k")
    assert r.due_ms is not None and r.due_ms - r.created_ms == 60_000
    bad = await invoke("enqueue", "x", "--on-exhausted", "later", *where, code=2)
    assert "'later' is not one of" in bad.output or "reject" in bad.output
    bad = await invoke("enqueue", "x", "--timeout", "0", *where, code=2)
    assert "the timeout must be more than 0 seconds" in bad.output


async def test_a_job_takes_the_id_it_is_given_once(
    redis: Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    q = Queue("ids", redis=redis, prefix=prefix)
    where = ["-q", "ids", "--prefix", prefix, "--redis", redis_url]
    out = await invoke("enqueue", "summarize", '{"text": "hi"}', "--id", "order-7", *where)
    assert "job order-7 added to queue ids" in out.stdout
    out = await invoke("enqueue", "summarize", '{"text": "again"}', "--id", "order-7", *where)
    assert "job order-7 already existed (same id or idempotency key)" in out.stdout
    record = await q.get_job("order-7")
    assert record is not None and record.payload == {"text": "hi"}
    lines = tmp_path / "jobs.jsonl"
    lines.write_text('{"name": "summarize", "job_id": "order-8"}\n{"name": "summarize", "job_id": "9"}\n')
    bad = await invoke("enqueue", "--file", str(lines), *where, code=1)
    assert "line 2" in bad.output and "not all digits" in bad.output and "nothing was added" in bad.output
    bad = await invoke("enqueue", "summarize", "--id", "42", *where, code=1)
    assert "not all digits" in bad.output
    bad = await invoke("enqueue", "x", "--budget", "no spaces", *where, code=2)
    assert "budget name 'no spaces' is not usable" in bad.output


async def test_no_result_in_time_says_what_to_do(redis_url: str, prefix: str) -> None:
    where = ["-q", "late", "--prefix", prefix, "--redis", redis_url]
    note, out = (await invoke("enqueue", "x", "--any-name", "--wait", "0.2", *where, code=1)).stderr.split(
        "\n", 1
    )
    assert note.startswith("job 1 added to queue late") and note.endswith("waiting for its result")
    assert out.startswith("error: job 1 has no result yet (it is waiting) and goes on; wait longer (--wait)")
    assert f"`sluice info --queue late --prefix {prefix}`" in out


async def test_a_missing_budget_is_refused_in_cli_words(redis: Redis, redis_url: str, prefix: str) -> None:
    where = ["-q", "nob", "--prefix", prefix, "--redis", redis_url]
    out = await invoke("enqueue", "summarize", "--tokens", "5", "--budget", "ghost", *where, code=1)
    assert "the job names budget 'ghost', which does not exist in queue nob" in out.stderr
    assert "nothing was added" in out.stderr and "`sluice budget create ghost LIMIT --queue nob" in out.stderr
    assert (await Queue("nob", redis=redis, prefix=prefix).counts())["added"] == 0


async def test_job_names_are_checked_against_live_workers(redis: Redis, redis_url: str, prefix: str) -> None:
    q = Queue("names", redis=redis, prefix=prefix)
    where = ["-q", "names", "--prefix", prefix, "--redis", redis_url]
    unchecked = await invoke("enqueue", "anything", *where)
    assert (
        "no worker has served queue names" in unchecked.stderr and "could not be checked" in unchecked.stderr
    )
    await q.pause()  # the worker only advertises its names here; jobs stay waiting
    async with running(serving_worker("names", prefix), redis_url):
        await eventually(q.workers)
        refused = await invoke("enqueue", "summarise", *where, code=1)
        assert "no worker of queue names" in refused.stderr and "'summarise'" in refused.stderr
        assert "they serve fail, summarize, translate." in refused.stderr and "--any-name" in refused.stderr
        served = await invoke("enqueue", "summarize", *where)
        assert "job 2 added" in served.stdout and "warning" not in served.stderr
        await invoke("enqueue", "summarise", "--any-name", *where)
    assert [r.name for r in await q.get_jobs(["1", "2", "3"]) if r] == ["anything", "summarize", "summarise"]


async def test_wait_prints_the_result_or_a_rejection_in_cli_words(
    redis: Redis, redis_url: str, prefix: str
) -> None:
    q = Queue("wait", redis=redis, prefix=prefix)
    await q.budgets.create("small", 100)
    where = ["-q", "wait", "--prefix", prefix, "--redis", redis_url]
    async with running(serving_worker("wait", prefix), redis_url):
        done = await invoke("enqueue", "summarize", '{"text": "hello world"}', "--wait", "10", *where)
        # The result alone on stdout (for pipes); the note on stderr
        assert done.stdout == '{"summary":"hello"}\n' and "job 1 added" in done.stderr
        data = json.loads(
            (await invoke("enqueue", "summarize", '{"text": "abc"}', "--wait", "10", "--json", *where)).stdout
        )
        assert data == {"ids": ["2"], "added": 1, "existing": 0, "result": {"summary": "abc"}}
        note, failed = (await invoke("enqueue", "fail", "--wait", "10", *where, code=1)).stderr.split("\n", 1)
        assert note.startswith("job 3 added")
        assert failed.startswith(
            "error: job 3 failed and is in the dead-letter queue: PermanentError: the model"
        )
        assert f"`sluice dlq show 3 --queue wait --prefix {prefix}`" in failed and failed.count("\n") == 1
        rejected = await invoke(
            "enqueue", "summarize", "--tokens", "500", "--budget", "small", "--wait", "10", *where, code=1
        )
    line = rejected.stderr.strip().split("\n", 1)[1]
    assert line.startswith("error: job 4 was rejected: budget small cannot admit 500 tokens"), line
    assert f"`sluice budget credit small N --queue wait --prefix {prefix}`" in line
    assert "--on-exhausted wait" in line and "on_exhausted" not in line and "queue.budgets" not in line


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


async def test_file_adds_every_line_or_none(
    redis: Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    q = Queue("bulk", redis=redis, prefix=prefix)
    await q.budgets.create("team", 10**6)
    where = ["-q", "bulk", "--prefix", prefix, "--redis", redis_url]
    bad = _write(
        tmp_path / "bad.jsonl",
        [
            '{"name": "summarize", "payload": {"doc": 1}}',
            '{"name": "summarize", "priority": -1}',
            '{"name": "summarize", "prio": 3}',
        ],
    )
    out = await invoke("enqueue", "--file", bad, *where, code=1)
    assert f"{bad} line 2: priority must be an integer from 0 to" in out.stderr
    assert "(and 1 more bad line(s)); nothing was added" in out.stderr
    assert (await q.counts())["added"] == 0
    ghost = _write(
        tmp_path / "ghost.jsonl", ['{"name": "a"}', '{"name": "a", "budget": "ghost", "tokens": 5}']
    )
    out = await invoke("enqueue", "--file", ghost, *where, code=1)
    assert f"{ghost} line 2 names budget 'ghost', which does not exist" in out.stderr
    assert (await q.counts())["added"] == 0
    good = _write(
        tmp_path / "good.jsonl",
        [
            '{"name": "summarize", "payload": {"doc": 1}, "priority": 1, "idempotency_key": "d1"}',
            "",
            '{"name": "translate", "tokens": 7, "on_exhausted": "wait", "delay": 0}',
            '{"name": "summarize", "payload": {"doc": 1}, "idempotency_key": "d1"}',
            '{"name": "translate", "budget": null}',
        ],
    )
    out = await invoke("enqueue", "--file", good, "--budget", "team", "--tokens", "900", *where)
    assert "added 3 job(s) to queue bulk" in out.stdout and "1 already existed" in out.stdout
    first, second, third = await q.get_jobs(["1", "2", "3"])
    assert first is not None and second is not None and third is not None
    assert (first.priority, first.tokens, first.budget) == (1, 900, "team")
    assert (second.tokens, second.budget, second.on_exhausted) == (7, "team", "wait")
    assert (third.tokens, third.budget) == (900, None)
    piped = await invoke("enqueue", "--file", "-", "--json", *where, input='{"name": "a"}\n{"name": "b"}\n')
    assert json.loads(piped.stdout) == {"ids": ["4", "5"], "added": 2, "existing": 0}
    mixed = await invoke("enqueue", "x", "--file", good, *where, code=2)
    assert "with --file, give no NAME" in mixed.output


async def test_a_large_file_is_checked_whole_before_slices_are_added(
    redis: Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    q = Queue("large", redis=redis, prefix=prefix)
    await q.budgets.create("team", 10**6)
    where = ["-q", "large", "--prefix", prefix, "--redis", redis_url]
    lines = ['{"name": "a", "budget": "team", "tokens": 1}'] * (PROGRESS_FROM + 5)
    late = _write(tmp_path / "late.jsonl", [*lines, '{"name": "a", "budget": "late", "tokens": 1}'])
    out = await invoke("enqueue", "--file", late, *where, code=1)
    assert f"line {PROGRESS_FROM + 6} names budget 'late'" in out.stderr
    assert (await q.counts())["added"] == 0
    out = await invoke("enqueue", "--file", _write(tmp_path / "ok.jsonl", lines), *where)
    assert f"added {PROGRESS_FROM + 5:,} job(s)" in out.stdout
    assert (await q.counts())["waiting"] == PROGRESS_FROM + 5


async def test_unknown_names_in_a_file_are_refused(
    redis: Redis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    q = Queue("fnames", redis=redis, prefix=prefix)
    await q.pause()
    where = ["-q", "fnames", "--prefix", prefix, "--redis", redis_url]
    path = _write(tmp_path / "jobs.jsonl", ['{"name": "summarize"}', '{"name": "nope"}', '{"name": "nada"}'])
    async with running(serving_worker("fnames", prefix), redis_url):
        await eventually(q.workers)
        out = await invoke("enqueue", "--file", path, *where, code=1)
    assert f"{path} line 3: no worker of queue fnames" in out.stderr and "'nada' (and 1 more" in out.stderr
    assert (await q.counts())["added"] == 0
