"""The load generator's HTTP/1.1 client: keep-alive connections with one request in flight
each, a pool of them, and the bytes of request ``i``."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

#: Placeholder in a body template that each request replaces with its number.
SEQ = "{i}"
#: What every time is measured with. Not the event loop's clock: uvloop's ``clock()`` counts
#: whole milliseconds and is read once per loop iteration, a 1 ms step and a lag under load in
#: latencies that a target of 10 ms is judged on.
clock = time.perf_counter


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
