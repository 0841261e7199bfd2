"""The sink's map of engine ids to store ids: a direct-mapped table of a fixed size."""

from __future__ import annotations

import uuid

import pytest

from sluice.store.sink import _MAP_SIZE, StoreIds


def test_it_remembers_store_ids_and_ids_that_are_not_the_apis() -> None:
    ids = StoreIds(8)
    high = uuid.UUID("ffffffff-ffff-7fff-bfff-ffffffffffff").int  # both halves use their top bit
    ids[5] = high
    ids[6] = None
    ids[7] = 0
    assert (ids[5], ids[6], ids[7]) == (high, None, 0)
    assert 6 in ids and 4 not in ids
    with pytest.raises(KeyError):
        ids[4]
    assert ids.get(4) is None and ids.get(5) == high
    ids[6] = 12  # looked up again and found after all
    assert ids[6] == 12


def test_an_id_takes_the_slot_of_the_one_size_before_it() -> None:
    ids = StoreIds(4)
    for engine_id in range(1, 9):
        ids[engine_id] = engine_id * 100
    # the last four are there; those they displaced are gone (a lookup brings them back)
    assert [ids.get(e) for e in range(1, 9)] == [None] * 4 + [500, 600, 700, 800]
    assert all(e not in ids for e in range(1, 5))
    ids[2] = None  # an old id read again displaces the newer one in its slot
    assert 2 in ids and ids[2] is None and 6 not in ids


def test_ids_out_of_range_are_never_remembered_and_clear_forgets() -> None:
    ids = StoreIds(4)
    assert 0 not in ids  # nothing allocated yet: nothing matches, not even an empty slot's tag
    ids[0] = 9
    assert ids[0] == 9 and 4 not in ids
    for engine_id in (-1, StoreIds.LIMIT, 2**64):
        ids[engine_id] = 1
        assert engine_id not in ids
    ids.clear()
    assert 0 not in ids


def test_the_sinks_map_holds_a_million_jobs_in_24_mib() -> None:
    assert _MAP_SIZE >= 1_000_000
    ids = StoreIds(_MAP_SIZE)
    ids[1] = 1
    assert sum(a.itemsize * len(a) for a in (ids._tags, ids._high, ids._low)) == 24 * 2**20
