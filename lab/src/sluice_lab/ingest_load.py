"""The load generator of ``sluice bench ingest``: a child process that sends HTTP requests.

It runs apart from the benchmark's driver and from the API processes, so
that its CPU is visible on its own (it reports it) and an event loop busy
sending is never the one measuring. Three modes:

``rate``
    An open model (:mod:`sluice_lab.ingest_open_loop`): request ``i`` is due
    at ``t0 + i / rate`` whatever happened to the requests before it, and its
    latency is measured from that due time, not from when it could be sent.
    A server that stalls therefore shows the stall in every request that fell
    due during it (the "coordinated omission" a closed-loop client hides: it
    would wait, send late and time only the round trip). Several generators
    share a rate by taking every ``generators``-th request from a common
    start time.
``race``
    ``n`` connections are opened first, then one identical request is
    written on each of them in one burst: the duplicates reach the API
    processes as close together as the machine allows.
``burst``
    A closed model for loading jobs quickly: ``n`` requests over
    ``connections`` connections, each sending its next request when the
    previous one is answered.

The client (:mod:`sluice_lab.ingest_client`) speaks HTTP/1.1 itself
(keep-alive, ``Content-Length`` bodies, which is all uvicorn sends for
JSON): httpx spends several times more CPU per request, and on a 2-core
machine every microsecond the generator spends is taken from the server it
measures (``client: "httpx"`` in ``rate`` mode measures that for
comparison). The configuration arrives as one JSON object on standard input
(the API key is in it, and a command line is visible to every user in
``ps``); the result leaves as one JSON object on standard output.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import Counter
from typing import Any

import orjson

from sluice_lab.ingest_client import _Conn, _Pool, _Renderer, clock
from sluice_lab.ingest_open_loop import run_rate

#: Connections opened at once in ``race`` mode (a burst of SYNs past the listen backlog is dropped).
OPEN_CHUNK = 250


async def run_race(cfg: dict[str, Any]) -> dict[str, Any]:
    """Open ``n`` connections, then write the same request on every one at once."""
    n = int(cfg["n"])
    pool = _Pool(cfg["host"], int(cfg["port"]), n)
    conns: list[_Conn] = []
    t_open = clock()
    try:
        for start in range(0, n, OPEN_CHUNK):
            conns += await asyncio.gather(*(pool.connect() for _ in range(min(OPEN_CHUNK, n - start))))
        opened_s = clock() - t_open
        data = _Renderer.of(cfg)(0)
        t0 = clock()
        waits = [conn.send(data) for conn in conns]
        written_s = clock() - t0
        answers = await asyncio.wait_for(
            asyncio.gather(*waits, return_exceptions=True), float(cfg.get("timeout", 60.0))
        )
        elapsed = clock() - t0
    finally:
        for conn in conns:
            conn.close()
    statuses: Counter[str] = Counter()
    exceptions: Counter[str] = Counter()
    ids: Counter[str] = Counter()
    created: Counter[str] = Counter()
    for answer in answers:
        if isinstance(answer, BaseException):
            exceptions[type(answer).__name__] += 1
            continue
        status, body = answer
        statuses[str(status)] += 1
        with contextlib.suppress(ValueError, TypeError, KeyError):
            parsed = orjson.loads(body)
            ids[str(parsed["id"])] += 1
            if "created" in parsed:
                created[str(parsed["created"]).lower()] += 1
    return {
        "mode": "race",
        "n": n,
        "statuses": dict(statuses),
        "exceptions": dict(exceptions),
        "ids": dict(ids),
        "created": dict(created),
        "open_s": round(opened_s, 4),
        "write_s": round(written_s, 4),
        "answer_all_s": round(elapsed, 4),
    }


async def run_burst(cfg: dict[str, Any]) -> dict[str, Any]:
    """``n`` requests over ``connections`` connections, as fast as they are answered."""
    n, first = int(cfg["n"]), int(cfg.get("first", 0))
    render = _Renderer.of(cfg)
    pool = _Pool(cfg["host"], int(cfg["port"]), int(cfg.get("connections", 64)))
    statuses: Counter[str] = Counter()
    exceptions: Counter[str] = Counter()
    numbers = iter(range(first, first + n))

    async def lane() -> None:
        conn = await pool.acquire()
        try:
            for i in numbers:
                try:
                    status, _ = await asyncio.wait_for(conn.send(render(i)), float(cfg.get("timeout", 30.0)))
                    statuses[str(status)] += 1
                except (TimeoutError, OSError) as exc:
                    exceptions[type(exc).__name__] += 1
                    conn.close()
                    conn = await pool.connect()
        finally:
            conn.close()

    t0 = clock()
    await asyncio.gather(*(lane() for _ in range(pool.limit)))
    elapsed = clock() - t0
    return {
        "mode": "burst",
        "n": n,
        "statuses": dict(statuses),
        "exceptions": dict(exceptions),
        "seconds": round(elapsed, 4),
    }


async def run(cfg: dict[str, Any]) -> dict[str, Any]:
    modes = {"rate": run_rate, "race": run_race, "burst": run_burst}
    mode = cfg.get("mode")
    if mode not in modes:
        raise ValueError(f"mode must be one of {', '.join(modes)}, got {mode!r}")
    return await modes[mode](cfg)


def main() -> None:
    cfg = orjson.loads(sys.stdin.buffer.read())
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(cfg))
    else:
        result = uvloop.run(run(cfg))
    # A file, not stdout: a minute of latencies is megabytes, which a pipe once cut short.
    with open(cfg["out"], "wb") as out:
        out.write(orjson.dumps(result))


if __name__ == "__main__":
    main()
