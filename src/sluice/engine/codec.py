"""JSON encoding of payloads and results: orjson, never pickle.

Everything a job carries through Redis is JSON, so any program (or person)
that can read Redis can read a job, and nobody who can write to Redis can make
a worker run code.

orjson (3.13) hands back each bytes object inside the buffer it wrote into,
about 4 KiB even for ``{"doc": 1}``: 8 KiB per job in a batch of small jobs
(a million jobs added at once held 9 GB). :func:`dumps` copies the output
into a bytes object of its own size, which costs a copy of what was written
and nothing more.
"""

from __future__ import annotations

from typing import Any

import orjson

from sluice.errors import PayloadNotSerializable, PayloadTooLarge

JSONValue = Any  # what orjson encodes: dict, list, str, int, float, bool, None, ...


def dumps(value: JSONValue) -> bytes:
    """orjson.dumps, in a bytes object of the output's own size (see the module's docstring)."""
    return memoryview(orjson.dumps(value)).tobytes()


def encode(value: JSONValue, what: str = "payload") -> bytes:
    try:
        return dumps(value)
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise PayloadNotSerializable(
            f"{what} is not JSON-serializable ({exc}); pass dicts, lists, strings, numbers, "
            "booleans and None (Sluice never pickles)"
        ) from exc


def encode_limited(value: JSONValue, limit: int, what: str = "payload") -> bytes:
    data = encode(value, what)
    if len(data) > limit:
        raise PayloadTooLarge(
            f"{what} is {len(data):,} bytes as JSON, over this queue's limit of {limit:,}; "
            "store large inputs elsewhere (object storage, a database) and pass a reference, "
            "or raise max_payload_bytes"
        )
    return data


def decode(data: bytes | str) -> JSONValue:
    return orjson.loads(data)
