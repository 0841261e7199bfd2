"""A network's delay in front of an ASGI app: what a remote provider's distance adds to each call.

On loopback a call reaches the simulated provider in well under a
millisecond; a real provider is 5 to 50 ms away, one way. The distance does
not change how many calls a limit allows, but it moves every arrival later
than its dispatch, and a client that counts calls when it sends them (as a
queue does) sees the provider count them that much later. :class:`NetworkDelay`
puts that distance back: each HTTP request waits ``delay`` seconds before the
app sees it (so the app's clock, and a rate limiter's arrival time, read the
request after the delay), and the answer waits ``delay`` seconds before its
first message goes back. The waits are real ``asyncio`` sleeps on the
server's event loop, concurrent across requests, as a wire's are.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The longest one-way delay accepted, in seconds: far beyond any real network, short of a hang.
MAX_NETWORK_DELAY_S = 10.0


def check_network_delay(delay: object) -> float:
    """``delay`` as seconds, or ValueError saying what is wrong with it."""
    if (
        isinstance(delay, bool)
        or not isinstance(delay, int | float)
        or not math.isfinite(delay)
        or not 0 <= delay <= MAX_NETWORK_DELAY_S
    ):
        raise ValueError(
            f"network_delay must be a number of seconds from 0 to {MAX_NETWORK_DELAY_S:g} (one way), "
            f"got {delay!r}"
        )
    return float(delay)


class NetworkDelay:
    """An ASGI wrapper: ``delay`` seconds on the way in and again on the way out of every HTTP request.

    Other scopes (lifespan, websockets) pass through untouched.
    """

    def __init__(self, app: ASGIApp, delay: float) -> None:
        self.app = app
        self.delay = check_network_delay(delay)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.delay == 0:
            await self.app(scope, receive, send)
            return
        await asyncio.sleep(self.delay)
        answered = False

        async def delayed(message: Message) -> None:
            nonlocal answered
            if not answered:
                answered = True
                await asyncio.sleep(self.delay)
            await send(message)

        await self.app(scope, receive, delayed)
