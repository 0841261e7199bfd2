"""The load generator's ``rate`` mode: an open model (request ``i`` is due at ``t0 + i / rate``,
its latency measured from then), through the raw client or through httpx."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, cast

from sluice_lab.ingest_client import _Conn, _Renderer, clock

#: How long an idle connection is kept: under uvicorn's keep-alive (5 s), as real clients do.
KEEP_ALIVE_S = 4.0


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
