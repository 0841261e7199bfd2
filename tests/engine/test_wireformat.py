"""The dispatch wire has one definition (engine/wireformat.py), and Lua reads the same one."""

from __future__ import annotations

import dataclasses
import re

from redis.asyncio import Redis

from sluice import Queue
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
    text = source("dispatch")
    assert "Generated from sluice/engine/wireformat.py" in text
    code = "\n".join(line.split("--")[0] for line in text.splitlines())
    assert not re.search(r"out\[n \+ \d+\]", code)
    assert not re.search(r"kind\s*[=~]=\s*'[a-z]'", code)


def test_kinds_are_bytes_on_the_wire() -> None:
    # What hiredis packs and the script compares: the bytes themselves.
    assert [bytes(k) for k in Kind] == [b"c", b"f", b"p", b"o", b"r", b"x", b"t"]
    assert {b"c": "completed"}[Kind.COMPLETED] == "completed"
    assert len({k.value for k in Kind}) == len(Kind)


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
