"""The flow-test worker (tests/harness/flow_workers.py) in a process whose wall clock is wrong.

``SLUICE_TEST_CLOCK_SKEW_MS`` (may be negative) is added to ``time.time`` and
``time.time_ns`` for the whole process before the worker is built, as if the
host's clock were that far off; monotonic time (which asyncio sleeps by) is
left alone, as on a real host whose wall clock was set wrong.
"""

from __future__ import annotations

import os
import time

from sluice import Worker
from tests.harness.flow_workers import make_worker

_SKEW_MS = int(os.environ.get("SLUICE_TEST_CLOCK_SKEW_MS", "0"))
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _SKEW_MS / 1000
time.time_ns = lambda: _time_ns() + _SKEW_MS * 1_000_000


def __getattr__(name: str) -> Worker:
    if name == "worker":
        lease = float(os.environ.get("SLUICE_TEST_LEASE", "5"))
        return make_worker(os.environ["SLUICE_TEST_REDIS"], os.environ["SLUICE_TEST_PREFIX"], lease=lease)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
