"""The dispatch wire has one definition (engine/wireformat.py), and Lua reads the same one."""

from __future__ import annotations

import dataclasses
import re

from redis.asyncio import Redis

from sluice import Backoff, JobSpec, Queue
from sluice.engine import wireformat as wire
from sluice.engine.scripts import expand, source
from sluice.engine.wireformat import LEASED, LEASED_FIELDS, Kind
from tests.harness.model import LeasedJob
from tests.harness.stepping import step


async def test_lua_sees_the_layout_and_kinds_python_defines(redis: Redis) -> None:
    script = expand(
        "-- @include wire\n"
        "local out = {LEASED_FIELDS}\n"
        "for _, name in ipairs(cjson.decode(ARGV[1])) do out[#out + 1] = LEASED[name] end\n"
        "for _, name in ipairs(cjson.decode(ARGV[2])) do out[#out + 1] = KIND[name] end\n"
        "return out\n"
    )
    names = "[" + ",".join(f'"{n}"' for n in LEASED) + "]"
    kinds = "[" + ",".join(f'"{k.name.lower()}"' for k in Kind) + "]"
    reply = await redis.eval(script, 0, names, kinds)
    assert reply[0] == LEASED_FIELDS
    assert reply[1 : 1 + LEASED_FIELDS] == list(range(1, LEASED_FIELDS + 1))
    assert reply[1 + LEASED_FIELDS :] == [k.value for k in Kind]


def test_the_offset_constants_follow_the_table() -> None:
    for name in LEASED:
        assert getattr(wire, name.upper()) == LEASED.index(name)


def test_the_model_reads_the_reply_in_the_same_order() -> None:
    assert tuple(f.name for f in dataclasses.fields(LeasedJob)) == LEASED


def test_the_scripts_name_what_they_write() -> None:
    # No bare offset into a leased job's group, and no bare outcome kind in code.
    # The generated include lays them out; what the scripts write by hand names them.
    text = source("dispatch")
    assert "Generated from sluice/engine/wireformat.py" in text
    generated = re.search(r"-- begin include wire\n.*?-- end include wire", text, re.DOTALL)
    assert generated is not None
    written = text.replace(generated.group(0), "")
    code = "\n".join(line.split("--")[0] for line in written.splitlines())
    assert not re.search(r"out\[n \+ \d+\]", code)
    assert not re.search(r"kind\s*[=~]=\s*'[a-z]'", code)
    # One read of a leasable record, and no field of it by a bare number.
    assert "'payload'" not in code and "read_leasable(" in code
    assert not re.search(
        r"\bf\[\d+\]", code.split("local function admit_job")[1].split("local function take_jobs")[0]
    )


def test_every_leased_value_has_one_source() -> None:
    assert set(wire.LEASED_GIVEN) | set(wire.LEASED_FROM) == set(LEASED)
    assert not set(wire.LEASED_GIVEN) & set(wire.LEASED_FROM)
    assert {source for source, _ in wire.LEASED_FROM.values()} <= set(wire.LEASE_READ)
    assert {how for _, how in wire.LEASED_FROM.values()} <= {"read", "or_empty", "count"}


def test_kinds_are_bytes_on_the_wire() -> None:
    # What hiredis packs and the script compares: the bytes themselves.
    assert [bytes(k) for k in Kind] == [b"c", b"f", b"p", b"o", b"r", b"x", b"t"]
    assert {b"c": "completed"}[Kind.COMPLETED] == "completed"
    assert len({k.value for k in Kind}) == len(Kind)


async def test_a_damaged_records_leased_values_stay_in_their_places(queue: Queue) -> None:
    # A record edited by hand (no budget field, a negative estimate) still gives a full
    # group: '' for the absent field and 0 tokens, never a hole that shifts the rest.
    job = await queue.add("work", {"n": 1}, tokens=5)
    await queue.redis.hset(queue.keys.job(job.id), "tokens", "-3")
    await queue.redis.hdel(queue.keys.job(job.id), "budget", "cid")
    reply = await step(queue, 1_000, want=1)
    assert len(reply.jobs) == LEASED_FIELDS
    f = reply.jobs
    assert f[wire.ID].decode() == job.id and f[wire.TOKENS] == 0
    assert f[wire.BUDGET] == b"" and f[wire.CORRELATION_ID] == b"" and f[wire.PRIORITY] == b"0"


async def test_a_leased_job_reads_by_name(queue: Queue) -> None:
    job = await queue.add("work", {"n": 1}, max_attempts=4, correlation_id="req-7")
    reply = await step(queue, 1_000, want=1)
    f = reply.jobs[:LEASED_FIELDS]
    assert len(reply.jobs) == LEASED_FIELDS
    assert f[wire.ID].decode() == job.id
    assert f[wire.NAME] == b"work"
    assert f[wire.PAYLOAD] == b'{"n":1}'
    assert f[wire.ATTEMPT] == 1
    assert int(f[wire.MAX_ATTEMPTS]) == 4
    assert f[wire.CORRELATION_ID] == b"req-7"
    assert f[wire.BUDGET] == b""


async def test_lua_reads_a_jobs_packed_options_by_the_names_python_lays_out(redis: Redis) -> None:
    script = expand(
        "-- @include wire\n"
        "local out = {}\n"
        "for _, name in ipairs(cjson.decode(ARGV[1])) do out[#out + 1] = ADDED[name] end\n"
        "return out\n"
    )
    names = "[" + ",".join(f'"{n}"' for n in wire.ADDED) + "]"
    assert await redis.eval(script, 0, names) == list(range(1, len(wire.ADDED) + 1))


async def test_every_packed_option_lands_in_its_field(queue: Queue) -> None:
    # Given a job with every option set, next to its idempotency key and a caller's id
    await queue.budgets.create("team", 1_000)
    spec = JobSpec(
        "work",
        {"n": 'ünïcode "quoted"'},
        priority=7,
        delay=2.5,
        max_attempts=4,
        backoff=Backoff.fixed(3.0),
        timeout=1.5,
        idempotency_key="k-1",
        max_stalls=2,
        tokens=900,
        budget="team",
        on_exhausted="wait",
        correlation_id="req-9",
        trace_context="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        job_id="order-9",
    )
    (job,) = await queue.add_bulk([spec])
    record = await queue.get_job(job.id)
    # Then each option is where its name says
    assert record is not None and record.id == "order-9"
    assert (record.name, record.payload, record.priority) == ("work", {"n": 'ünïcode "quoted"'}, 7)
    assert record.due_ms is not None and record.due_ms - record.created_ms == 2_500
    assert (record.max_attempts, record.backoff, record.timeout, record.max_stalls) == (
        4,
        spec.backoff,
        1.5,
        2,
    )
    assert (record.tokens, record.budget, record.on_exhausted) == (900, "team", "wait")
    assert (record.correlation_id, record.trace_context, record.idempotency_key) == (
        "req-9",
        spec.trace_context,
        "k-1",
    )
