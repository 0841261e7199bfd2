"""Job ids: version 7 UUIDs, in the order they were made, unguessable."""

from __future__ import annotations

import time
import uuid

from sluice.store.ids import new_job_id


def test_ids_are_version_7_uuids_of_the_current_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    job_id = new_job_id()
    after = time.time_ns() // 1_000_000
    assert job_id.version == 7 and job_id.variant == uuid.RFC_4122
    assert before <= job_id.int >> 80 <= after
    assert uuid.UUID(str(job_id)) == job_id


def test_ids_made_later_sort_later_and_none_repeats() -> None:
    first = [new_job_id() for _ in range(2_000)]
    time.sleep(0.002)
    second = [new_job_id() for _ in range(2_000)]
    assert max(first) < min(second)
    assert len(set(first + second)) == 4_000
    # the random part varies in every one of its 74 bits
    randoms = [i.int & ((1 << 76) - 1) for i in first]
    varying = 0
    for r in randoms:
        varying |= r ^ randoms[0]
    assert varying == ((0xFFF << 64) | ((1 << 62) - 1))
