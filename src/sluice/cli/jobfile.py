"""Jobs from a JSON Lines file, for ``sluice enqueue --file``.

One JSON object per line, blank lines skipped::

    {"name": "summarize", "payload": {"doc": 7}, "priority": 1, "tokens": 900, "budget": "team"}

Every line is checked before anything is added, so a mistake on line 9,000
adds nothing rather than half a file; the error names the file, the line and
the field. Fields a line leaves out take the command's options (``--budget``,
``--tokens``...), except the idempotency key and the id, which belong to one job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sluice.cli.errors import CliFailure
from sluice.engine import JobSpec
from sluice.errors import InvalidJobError
from sluice.settings import DEFAULT_MAX_PAYLOAD_BYTES

#: The fields a line may have: JobSpec's, but for the backoff (the worker's default applies).
FIELDS = (
    "name",
    "payload",
    "priority",
    "tokens",
    "budget",
    "on_exhausted",
    "idempotency_key",
    "job_id",
    "delay",
    "max_attempts",
    "timeout",
    "max_stalls",
)


@dataclass(frozen=True, slots=True)
class Line:
    """A checked job and where it came from (line 0: the command line)."""

    number: int
    spec: JobSpec


class _BadLine(Exception):
    pass


def read_jobs(lines: Iterable[str], source: str, defaults: Mapping[str, Any]) -> list[Line]:
    """Every job of the file, checked; raises CliFailure naming the first bad line and how many more."""
    jobs: list[Line] = []
    errors: list[str] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            jobs.append(Line(number, _spec(text, defaults)))
        except _BadLine as exc:
            errors.append(f"{source} line {number}: {exc}")
    if errors:
        more = f" (and {len(errors) - 1} more bad line(s))" if len(errors) > 1 else ""
        raise CliFailure(f"{errors[0]}{more}; nothing was added")
    if not jobs:
        raise CliFailure(
            f'{source} has no jobs; write one JSON object per line, e.g. {{"name": "summarize"}}'
        )
    return jobs


def _spec(text: str, defaults: Mapping[str, Any]) -> JobSpec:
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise _BadLine(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise _BadLine("not a JSON object; write one {...} per line")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise _BadLine(f"unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    if "name" not in data:
        raise _BadLine('no "name": every job needs the name of its handler')
    size = len(orjson.dumps(data.get("payload")))
    if size > DEFAULT_MAX_PAYLOAD_BYTES:
        raise _BadLine(
            f"payload is {size:,} bytes as JSON, over the limit of {DEFAULT_MAX_PAYLOAD_BYTES:,}; store "
            "large inputs elsewhere and pass a reference"
        )
    try:
        return JobSpec(**{**defaults, **data})
    except InvalidJobError as exc:
        raise _BadLine(str(exc)) from None


def who(jobs: list[Line], source: str, found: Callable[[JobSpec], bool], default: str = "the job") -> str:
    """'jobs.jsonl line 7' (or ``default`` for the command line's job): the first job
    ``found(spec)`` is true of, for a message."""
    number = next((j.number for j in jobs if found(j.spec)), 0)
    return f"{source} line {number}" if number else default
