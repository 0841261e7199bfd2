"""Wall-clock milliseconds, the one time source the engine passes to scripts.

Scripts never read the clock themselves: the caller passes "now", so tests can
drive time and every script in a call agrees on one instant.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    return time.time_ns() // 1_000_000
