"""The load generator of ``sluice bench ingest``: a child process that sends HTTP requests.

It runs apart from the benchmark's driver and from the API processes, so
that its CPU is visible on its own (it reports it) and an event loop busy
sending is never the one measuring. Three modes:

``rate``
    An open model: request ``i`` is due at ``t0 + i / rate`` whatever
    happened to the requests before it, and its latency is measured from
    that due time, not from when it could be sent. A server that stalls
    therefore shows the stall in every request that fell due during it (the
    "coordinated omission" a closed-loop client hides: it would wait, send
    late and time only the round trip). Several generators share a rate by
    taking every ``generators``-th request from a common start time.
``race``
    ``n`` connections are opened first, then one identical request is
    written on each of them in one burst: the duplicates reach the API
    processes as close together as the machine allows.
``burst``
    A closed model for loading jobs quickly: ``n`` requests over
    ``connections`` connections, each sending its next request when the
    previous one is answered.

The client speaks HTTP/1.1 itself (keep-alive, ``Content-Length`` bodies,
which is all uvicorn sends for JSON): httpx spends several times more CPU
per request, and on a 2-core machine every microsecond the generator spends
is taken from the server it measures (``client: "httpx"`` in ``rate`` mode
measures that for comparison). The configuration arrives as one JSON object
on standard input (the API key is in it, and a command line is visible to
every user in ``ps``); the result leaves as one JSON object on standard
output.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

#: Placeholder in a body template that each request replaces with its number.
SEQ = "{i}"
#: What every time is measured with. Not the event loop's clock: uvloop's ``clock()`` counts
#: whole milliseconds and is read once per loop iteration, a 1 ms step and a lag under load in
#: latencies that a target of 10 ms is judged on.
clock = time.perf_counter
#: How long an idle connection is kept: under uvicorn's keep-alive (5 s), as real clients do.
KEEP_ALIVE_S = 4.0
#: Connections opened at once in ``race`` mode (a burst of SYNs past the listen backlog is dropped).
OPEN_CHUNK = 250


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection with at most one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        #: when its last answer came (idle since)
        self.used = clock()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).lower()
        at = head.find(b"\r\ncontent-length:")
        length = 0
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17 : stop if stop >= 0 else len(head)])
        total = end + 4 + length
        if len(self.buf) < total:
            return
        status = int(head[9:12])
        body = bytes(self.buf[end + 4 : total])
        del self.buf[:total]
        if b"\r\nconnection: close" in head:
            self.closed = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc or ConnectionResetError("the server closed the connection"))

    def send(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None and self.waiter is None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Pool:
    """Up to ``limit`` connections; a request waits for one when all are busy (its wait counts
    in its latency, as a real client's would)."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host, self.port, self.limit = host, port, limit
        self.idle: list[_Conn] = []
        self.open = 0
        self.opened = 0
        self.waiters: deque[asyncio.Future[_Conn | None]] = deque()

    async def connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port)
        self.opened += 1
        return conn

    async def acquire(self) -> _Conn:
        while True:
            while self.idle:
                conn = self.idle.pop()
                if not conn.closed:
                    return conn
                self.open -= 1
            if self.open < self.limit:
                self.open += 1
                try:
                    return await self.connect()
                except BaseException:
                    self.open -= 1
                    self._wake(None)
                    raise
            waiter: asyncio.Future[_Conn | None] = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            got = await waiter
            if got is not None and not got.closed:
                return got
            if got is not None:
                self.open -= 1

    def release(self, conn: _Conn, *, broken: bool = False) -> None:
        if broken or conn.closed:
            conn.close()
            self.open -= 1
            self._wake(None)
            return
        if not self._wake(conn):
            self.idle.append(conn)

    def _wake(self, conn: _Conn | None) -> bool:
        """Hand ``conn`` (None: a free slot) to the first live waiter; False if none waits."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


def _request_head(cfg: dict[str, Any]) -> bytes:
    host = f"{cfg['host']}:{cfg['port']}"
    lines = [f"POST {cfg['path']} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    if cfg.get("token"):
        lines.append(f"Authorization: Bearer {cfg['token']}")
    return ("\r\n".join(lines) + "\r\nContent-Length: ").encode()


@dataclass
class _Renderer:
    """The bytes of request ``i``: the template's ``{i}`` replaced by ``i``."""

    head: bytes
    parts: list[bytes]

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> _Renderer:
        return cls(_request_head(cfg), [p.encode() for p in str(cfg["body"]).split(SEQ)])

    def body(self, i: int) -> bytes:
        return str(i).encode().join(self.parts)

    def __call__(self, i: int) -> bytes:
        body = self.body(i)
        return self.head + str(len(body)).encode() + b"\r\n\r\n" + body


@dataclass
class _Tally:
    """What the answers were, as they come."""

    statuses: Counter[str] = field(default_factory=Counter)
    exceptions: Counter[str] = field(default_factory=Counter)
    latency_us: list[int] = field(default_factory=list)
    send_lag_us: list[int] = field(default_factory=list)
    #: answers with the expected status per second since t0 (by answer time)
    per_second_ok: Counter[int] = field(default_factory=Counter)
    #: the slowest answer (µs) of the requests due in each second since t0: where a stall was
    per_second_worst_us: dict[int, int] = field(default_factory=dict)
    last_ok: float = 0.0

    def answer(self, status: int, due: float, sent: float, now: float, t0: float, ok: int) -> None:
        self.statuses[str(status)] += 1
        latency = round((now - due) * 1e6)
        self.latency_us.append(latency)
        second = int(due - t0)
        if latency > self.per_second_worst_us.get(second, -1):
            self.per_second_worst_us[second] = latency
        self.send_lag_us.append(round((sent - due) * 1e6))
        if status == ok:
            self.per_second_ok[int(now - t0)] += 1
            self.last_ok = max(self.last_ok, now)

    def failure(self, exc: BaseException) -> None:
        self.exceptions[type(exc).__name__] += 1

    def summary(self, t0: float, seconds: float) -> dict[str, Any]:
        span = range(int(max(seconds, 1)) + 1)
        return {
            "statuses": dict(self.statuses),
            "exceptions": dict(self.exceptions),
            "latency_us": sorted(self.latency_us),
            "send_lag_us": sorted(self.send_lag_us),
            "per_second_ok": [self.per_second_ok.get(s, 0) for s in span],
            "per_second_worst_us": [self.per_second_worst_us.get(s, 0) for s in span],
            "last_ok_s": round(self.last_ok - t0, 4) if self.last_ok else None,
        }


def _start_time(start_at: float) -> float:
    """:func:`clock` at wall-clock ``start_at`` (generators in several processes share it)."""
    return clock() + max(0.0, start_at - time.time())


async def run_rate(cfg: dict[str, Any]) -> dict[str, Any]:
    """Send ``rate * seconds`` requests (this generator's share) on the open schedule."""
    rate, seconds = float(cfg["rate"]), float(cfg["seconds"])
    index, stride = int(cfg.get("generator", 0)), int(cfg.get("generators", 1))
    timeout, ok = float(cfg.get("timeout", 10.0)), int(cfg.get("ok_status", 201))
    render = _Renderer.of(cfg)
    tally = _Tally()
    cpu0 = time.process_time()
    t0 = _start_time(float(cfg.get("start_at", 0.0)))
    total = int(rate * seconds)
    if cfg.get("client") == "httpx":
        sent_all, opened = await _rate_httpx(cfg, render, tally, rate, range(index, total, stride), t0)
    else:
        lanes = _OpenLoop(cfg, render, tally, t0, timeout, ok)
        sent_all = await lanes.run(rate, range(index, total, stride))
        opened = lanes.opened
    return {
        "mode": "rate",
        "client": cfg.get("client", "raw"),
        "sent": len(range(index, total, stride)),
        **tally.summary(t0, seconds),
        "schedule_end_s": round(sent_all - t0, 4),
        "connections_opened": opened,
        "cpu_s": round(time.process_time() - cpu0, 3),
    }


class _OpenLoop:
    """The raw client's open model, driven by callbacks: no task, no timer and no future of its
    own per request (each cost the generator CPU that the server it measures then lacked).

    A request falls due at its time whatever happened to the others; it is
    written at once on an idle connection, else it waits in line for the
    next one to come free (up to ``max_connections`` are opened as needed),
    and that wait is part of its latency. One sweep every 50 ms fails the
    requests still unanswered ``timeout`` after they were due (a waiting one
    leaves the line; a written one closes its connection).
    """

    def __init__(
        self, cfg: dict[str, Any], render: _Renderer, tally: _Tally, t0: float, timeout: float, ok: int
    ) -> None:
        self.host, self.port = cfg["host"], int(cfg["port"])
        self.limit = int(cfg.get("max_connections", 512))
        self.render, self.tally, self.t0, self.timeout, self.ok = render, tally, t0, timeout, ok
        self.idle: list[_Conn] = []
        self.line: deque[tuple[int, float]] = deque()
        self.flying: dict[_Conn, tuple[float, float]] = {}
        self.open = 0
        self.opened = 0
        self.expired: set[_Conn] = set()
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task[None]] = set()
        #: every request is due (``scheduled``), and then every one was answered or failed
        self.scheduled = False
        self.quiet = asyncio.Event()

    def _settle(self) -> None:
        if self.scheduled and not (self.line or self.flying or self.tasks):
            self.quiet.set()

    async def run(self, rate: float, numbers: range) -> float:
        sweeper = self.loop.create_task(self._sweep())
        try:
            for i in numbers:
                due = self.t0 + i / rate
                wait = due - clock()
                if wait > 0.0005:
                    await asyncio.sleep(wait)
                self.line.append((i, due))
                self._pump()
            sent_all = clock()
            self.scheduled = True
            self._settle()
            await self.quiet.wait()
            return sent_all
        finally:
            sweeper.cancel()
            for conn in self.idle:
                conn.close()

    def _pump(self) -> None:
        while self.line:
            conn = self._idle()
            if conn is None:
                if self.open < self.limit:
                    self.open += 1
                    task = self.loop.create_task(self._connect())
                    self.tasks.add(task)
                    task.add_done_callback(self._connected)
                return
            i, due = self.line.popleft()
            sent = clock()
            self.flying[conn] = (due, sent)
            conn.send(self.render(i)).add_done_callback(functools.partial(self._answered, conn))

    def _connected(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._settle()

    def _idle(self) -> _Conn | None:
        """The connection used last, if one is idle; those idle past ``KEEP_ALIVE_S`` are closed
        here, before the server closes them under a request being written (a reset)."""
        now = clock()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.used < KEEP_ALIVE_S:
                return conn
            conn.close()
            self.open -= 1
        return None

    async def _connect(self) -> None:
        try:
            _, conn = await self.loop.create_connection(_Conn, self.host, self.port)
        except OSError as exc:
            self.open -= 1
            if self.line:
                self.line.popleft()
                self.tally.failure(exc)
        else:
            self.opened += 1
            self.idle.append(conn)
        self._pump()

    def _answered(self, conn: _Conn, answer: asyncio.Future[tuple[int, bytes]]) -> None:
        due, sent = self.flying.pop(conn)
        if conn in self.expired:
            self.expired.discard(conn)
            self.tally.failure(TimeoutError())
            self.open -= 1
        elif answer.exception() is not None:
            self.tally.failure(cast("BaseException", answer.exception()))
            conn.close()
            self.open -= 1
        else:
            status, _ = answer.result()
            conn.used = clock()
            self.tally.answer(status, due, sent, conn.used, self.t0, self.ok)
            self.idle.append(conn)
        self._pump()
        self._settle()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            late = clock() - self.timeout
            while self.line and self.line[0][1] < late:
                self.line.popleft()
                self.tally.failure(TimeoutError())
            for conn, (due, _) in list(self.flying.items()):
                if due < late and conn not in self.expired:
                    self.expired.add(conn)
                    conn.close()  # its answer fails now, and is counted as a timeout
            self._settle()


async def _rate_httpx(
    cfg: dict[str, Any], render: _Renderer, tally: _Tally, rate: float, numbers: range, t0: float
) -> tuple[float, int]:
    """The same schedule through httpx (a task per request), to compare clients."""
    loop = asyncio.get_running_loop()
    timeout, ok = float(cfg.get("timeout", 10.0)), int(cfg.get("ok_status", 201))
    send = _httpx_sender(cfg, render)

    async def one(i: int, due: float) -> None:
        try:
            async with asyncio.timeout(due + timeout - clock()):
                sent = clock()
                status = await send(i)
            tally.answer(status, due, sent, clock(), t0, ok)
        except Exception as exc:  # noqa: BLE001 - a timeout, a refused or reset connection: counted
            tally.failure(exc)

    tasks: set[asyncio.Task[None]] = set()
    for i in numbers:
        due = t0 + i / rate
        wait = due - clock()
        if wait > 0:
            await asyncio.sleep(wait)
        task = loop.create_task(one(i, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    sent_all = clock()
    while tasks:
        await asyncio.gather(*list(tasks))
    await send.aclose()
    return sent_all, 0


def _httpx_sender(cfg: dict[str, Any], render: _Renderer) -> Any:
    """``send(i) -> status`` through an httpx client (to measure what httpx itself costs)."""
    import httpx

    limits = httpx.Limits(
        max_connections=int(cfg.get("max_connections", 512)), max_keepalive_connections=None
    )
    base = f"http://{cfg['host']}:{cfg['port']}"
    client = httpx.AsyncClient(base_url=base, limits=limits, timeout=float(cfg.get("timeout", 10.0)))
    headers = {"content-type": "application/json"}
    if cfg.get("token"):
        headers["authorization"] = f"Bearer {cfg['token']}"

    class Sender:
        async def __call__(self, i: int) -> int:
            resp = await client.post(cfg["path"], content=render.body(i), headers=headers)
            return resp.status_code

        async def aclose(self) -> None:
            await client.aclose()

    return Sender()


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
