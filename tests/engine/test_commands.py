"""Each script call's KEYS and ARGV, as commands.py builds them, against what its script reads.

A script documents its KEYS and ARGV in its header and reads them by index;
the builder is the one place Python lays them out. For a script of fixed
shape the builder must give exactly as many as the script indexes, for one
with a variable tail (per job, per lease) at least its fixed part, and every
script the engine loads has a builder. A key added on one side only fails
here, before any Redis sees it.
"""

from __future__ import annotations

import re
from importlib import resources

import pytest

from sluice.engine.commands import Call, Commands
from sluice.engine.job import JobSpec
from sluice.engine.keys import QueueKeys
from sluice.engine.scripts import COMMANDS, source
from sluice.engine.wireformat import Kind

KEYS = QueueKeys.for_queue("q", "sluice")
COMMANDS_OF = Commands(KEYS, events_maxlen=100, event_result_max_bytes=1000, idempotency_ttl_ms=1000)
TWO_JOBS = [JobSpec("a", {}, idempotency_key="k"), JobSpec("b", {}, job_id="b-1")]
OUTCOME = ("7", b"token", Kind.COMPLETED.value, b"null", 0, -1)


def calls(c: Commands) -> list[Call]:
    """One call of every builder, with a variable tail where the script takes one."""
    return [
        c.add(TWO_JOBS, [(["a"], b"{}"), (["b"], b"{}")]),
        c.cancel("7", ahead=False),
        c.dispatch(want=2, lease_ms=1000, worker_id="w", outcomes=[OUTCOME]),
        c.extend(now=None, lease_ms=1000, leases=[("7", b"t"), ("8", b"u")]),
        c.reap(now=None, limit=10),
        c.trim(now=None, limit=10),
        c.heartbeat("w", b'{"names":[]', 2000, leaving=False),
        c.lag("w", "1.000", "2.000", 5000, withdraw=False),
        c.observe(["p", "m", 1, 2, 3, 4, 5, 6]),
        c.latency(
            "q", bucket_10s=1, bucket_1m=0, priority="0", other="other", keep_ms=(1, 2), bins=[("3", 1)]
        ),
        c.redrive(["7", "8"]),
        c.purge(["7", "8"]),
        c.retention(),
        c.now(),
        c.pace(["requests", "all", 0, 1000, 10]),
        c.budget_read(["b"], now=None),
        c.budget_restore(["b", 10, "none", 0, "", 0, 0, 0, 0, 0], now=None),
        c.budget_put(
            now=None,
            name="b",
            op="create",
            tokens=10,
            win="none",
            win_ms=0,
            parent="",
            max_tokens=100,
            op_id="",
            op_id_keep_ms=1,
        ),
        c.reserve(now=None, name="b", tokens=1, reservation="r", job_id="", hold_ms=1000),
        c.settle(now=None, reservation="r", how="commit", tokens=1),
        c.sweep(now=None, how="refund", reservations=["r"]),
    ]


_INDEX = re.compile(r"\b(KEYS|ARGV)\[([^\]]*)\]")
_RANGE = re.compile(r"^\s*(\d+)\s*(?:\.\.\s*(\d+)\s*)?$")


def shape(script: str, table: str) -> tuple[int, bool]:
    """(the highest literal index of ``table`` in the script and its header, whether the
    script also reads a variable number of them)."""
    raw = resources.files("sluice.engine").joinpath("lua", f"{script}.lua").read_text()
    most, variable = 0, f"#{table}" in raw
    for text in (raw, source(script)):
        for name, inside in _INDEX.findall(text):
            if name != table:
                continue
            literal = _RANGE.match(inside)
            if literal is None:
                variable = True  # KEYS[8 + k], ARGV[4 ...]: a tail of per-item values
                continue
            most = max(most, int(literal.group(2) or literal.group(1)))
    return most, variable


def test_every_script_has_a_builder_and_every_builder_a_script() -> None:
    assert sorted({call.script for call in calls(COMMANDS_OF)}) == sorted(COMMANDS)


@pytest.mark.parametrize("call", calls(COMMANDS_OF), ids=lambda call: call.script)
def test_a_builder_gives_what_its_script_reads(call: Call) -> None:
    for table, given in (("KEYS", call.keys), ("ARGV", call.args)):
        most, variable = shape(call.script, table)
        if variable:
            assert len(given) >= most, (table, given)
        else:
            assert len(given) == most, (table, given)
    assert all(isinstance(key, str) and key.startswith("sluice") for key in call.keys), call.keys


def test_jobs_sharing_an_idempotency_key_share_its_key() -> None:
    same = [JobSpec("a", {}, idempotency_key="k"), JobSpec("b", {}, idempotency_key="k")]
    call = COMMANDS_OF.add(same, [(["a"], b"{}"), (["b"], b"{}")])
    assert call.keys.count(KEYS.idem("k")) == 1
    assert call.args[4] == b'["a","1","",""]' and call.args[6] == b'["b","1","",""]'


def test_an_outcome_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="an outcome is"):
        COMMANDS_OF.dispatch(want=0, lease_ms=1000, worker_id="w", outcomes=[("7", b"t")])  # type: ignore[list-item]
