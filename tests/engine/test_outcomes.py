"""How an attempt's ending is classified (engine/outcomes.py): plain functions, no Redis."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from sluice.engine import outcomes
from sluice.engine.context import JobContext
from sluice.engine.wireformat import Kind
from sluice.errors import PermanentError, Throttled

WID = "w1"


def ctx(attempt: int = 1, max_attempts: int = 3) -> JobContext:
    return JobContext("q", "job-a", "work", None, attempt, max_attempts, 0, WID, b"1")


def test_a_return_value_completes_the_job_as_json() -> None:
    assert outcomes.returned(ctx(), {"n": 1}, False, WID) == (Kind.COMPLETED, b'{"n":1}', 0)


def test_a_value_json_cannot_hold_dead_letters_the_job() -> None:
    kind, error, retry = outcomes.returned(ctx(), object(), False, WID)
    assert (kind, retry) == (Kind.PERMANENT, 0)
    assert b"PayloadNotSerializable" in error


def test_a_plain_function_that_returns_a_coroutine_is_dead_lettered() -> None:
    async def later() -> int:
        return 1

    kind, error, _ = outcomes.returned(ctx(), later(), True, WID)
    assert kind == Kind.PERMANENT
    assert b"async def" in error


def test_an_error_is_retried_after_the_backoff_while_attempts_remain() -> None:
    backoff = orjson.dumps(["fixed", 2.5, 2.5, 0.0])
    kind, error, retry = outcomes.failed(ctx(attempt=1), ValueError("boom"), backoff, WID)
    assert (kind, retry) == (Kind.FAILED, 2500)
    assert error.startswith(b"ValueError: boom\n")


def test_an_unreadable_backoff_waits_a_second() -> None:
    assert outcomes.failed(ctx(), ValueError("x"), b"not json", WID)[2] == 1000


def test_the_last_attempt_fails_with_no_retry() -> None:
    kind, _, retry = outcomes.failed(ctx(attempt=3), ValueError("boom"), b"", WID)
    assert (kind, retry) == (Kind.FAILED, 0)


def test_a_permanent_error_dead_letters_at_once() -> None:
    assert outcomes.failed(ctx(), PermanentError("no"), b"", WID)[0] == Kind.PERMANENT


def test_a_throttle_carries_its_wait_in_ms() -> None:
    assert outcomes.failed(ctx(), Throttled(1.25), b"", WID) == (Kind.THROTTLED, b"1250", 0)


def test_a_timeout_is_a_failure_noted_with_what_the_handler_did_after() -> None:
    kind, error, _ = outcomes.timed_out(ctx(), 2.0, b"", WID, after="raised KeyError", late=0.5)
    assert kind == Kind.FAILED
    assert b"AttemptTimeout" in error
    assert b"0.50s later raised KeyError" in error


def test_a_stopped_handler_reports_why() -> None:
    assert outcomes.stopped("cancel") == (Kind.CANCELLED, b"cancelled by request", 0)
    assert outcomes.stopped("release") == (Kind.RELEASED, b"", 0)
    assert outcomes.stopped(None) == (Kind.RELEASED, b"", 0)
    assert outcomes.stopped("lease_lost") is None


@pytest.mark.parametrize(
    ("outcome", "attempt", "name"),
    [
        ((Kind.COMPLETED, b"1", 0), 1, "completed"),
        ((Kind.FAILED, b"E", 10), 1, "retry"),
        ((Kind.FAILED, b"E", 0), 3, "dead"),
        ((Kind.PERMANENT, b"E", 0), 1, "dead"),
        ((Kind.THROTTLED, b"5", 0), 1, "throttled"),
        ((Kind.CANCELLED, b"", 0), 1, "cancelled"),
        ((Kind.RELEASED, b"", 0), 1, "released"),
        (None, 1, "lease_lost"),
    ],
)
def test_hooks_see_the_outcome_named(outcome: outcomes.Result | None, attempt: int, name: str) -> None:
    got, error = outcomes.trace_name(ctx(attempt=attempt), outcome)
    assert got == name
    assert (error is not None) == (outcome is not None and outcome[0] in (Kind.FAILED, Kind.PERMANENT))


def test_an_error_text_is_bounded() -> None:
    text = outcomes.describe_error(ValueError("x" * 20_000))
    assert len(text) == outcomes.MAX_ERROR_BYTES


def test_no_handler_names_what_the_worker_serves() -> None:
    kind, error, _ = outcomes.no_handler(ctx(), frozenset({"b", "a"}), WID)
    assert kind == Kind.PERMANENT
    assert b"(it serves: a, b)" in error


def test_classifying_needs_no_event_loop() -> None:
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    assert outcomes.failed(ctx(), ValueError("x"), b"", WID)[0] == Kind.FAILED
