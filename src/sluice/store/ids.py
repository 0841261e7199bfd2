"""Job ids: UUIDs that sort by the time they were made (version 7, RFC 9562).

A job's id is the primary key of ``jobs`` and half of ``job_attempts``'s.
Random (version 4) ids land anywhere in those indexes, so every insert and
every new row version the sink writes touches a page of its own, and after
each checkpoint writes that page whole into the WAL. Ids that grow with time
keep a batch's entries together at the index's right edge, where they share
pages, so far fewer pages are written whole per job (docs/decisions/0014 has the figures).

The other 74 bits are random (``os.urandom``), so ids stay unguessable; what
they give away is the millisecond the job was made, which the API answers
with anyway (``createdAt``). Python 3.14's ``uuid.uuid7`` makes the same;
this one is for 3.11 to 3.13.
"""

from __future__ import annotations

import os
import time
import uuid

_MS_BITS = (1 << 48) - 1
_VERSION = 0x7 << 76
_VARIANT = 0b10 << 62
_RAND_B = (1 << 62) - 1


def new_job_id() -> uuid.UUID:
    """A version 7 UUID: 48 bits of Unix time in ms, then version, 12 random bits, variant
    and 62 random bits."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    rand_a, rand_b = rand >> 62 & 0xFFF, rand & _RAND_B
    value = (ms & _MS_BITS) << 80 | _VERSION | rand_a << 64 | _VARIANT | rand_b
    return uuid.UUID(int=value)
