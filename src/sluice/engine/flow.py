"""Flow controls shared by every worker of a queue: the gates of the dispatch script.

They are plain fields of the queue's ``control`` hash, read by the dispatch
script on every call, so a change reaches every worker on every machine at
its next dispatch. Whatever reopens a gate (resume, a raised limit) puts the
wake marker back so idle workers come at once; a gate that opens with time
(a rate window, a throttle) tells each refused worker when to come back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.engine.budget_state import TOKEN_RATE_BUDGET, BudgetState, token_cap_budget
from sluice.engine.budgets import Budgets
from sluice.engine.job import MAX_TOKENS
from sluice.engine.transport import reads, writes
from sluice.engine.windows import (
    MAX_REQUESTS,
    Limits,
    RateWindow,
    check_limits,
    decode_request_caps,
    decode_token_caps,
    seconds_text,
    window_ms,
)
from sluice.errors import ConfigurationError

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from sluice.engine.core import QueueCore


#: The pacer's tolerance unless set (ms; the dispatch script has the same default).
DEFAULT_TOLERANCE_MS = 20
#: The least headroom unless set (ms; the scripts have the same default). The workers'
#: measured spread of dispatch-to-send delays is used when it is larger (engine/lag.py).
DEFAULT_HEADROOM_MS = 10
#: The largest tolerance or headroom accepted (ms).
MAX_PACING_MS = 60_000


@dataclass(frozen=True, slots=True)
class FlowState:
    """The queue's flow controls and how full their windows are now."""

    paused: bool
    #: Unix ms until which a provider throttle holds dispatch (None: not throttled)
    throttled_until_ms: int | None
    concurrency: int | None
    active: int
    rate_max: int | None
    rate_per_seconds: float | None
    starts_in_window: int
    token_limit: int | None
    token_per_seconds: float | None
    tokens_in_window: int
    #: The pacer's tolerance (ms; None: no pacer, starts come as the logs allow)
    pace_tolerance_ms: int | None = DEFAULT_TOLERANCE_MS
    #: The least headroom added to every rate window the logs count (ms), as set
    headroom_ms: int = DEFAULT_HEADROOM_MS
    #: The headroom the workers measured: the spread of their dispatch-to-send delays (ms;
    #: 0 when none reported lately). The windows count over the larger of the two.
    measured_headroom_ms: int = 0
    #: The pacers' rate now, per mille of the limits': below 1000 for a while after a
    #: provider's 429 (each further one takes it to 95 % of what it is, down to 50 %; it climbs
    #: back over two of the longest paced window)
    pace_factor_pm: int = 1000
    #: Whether the limits follow what providers' answers say of theirs (Queue.follow_provider)
    follows_provider: bool = True
    #: Requests the provider counted that the queue had not started (another program on the
    #: key), added to its request window since the queue was made
    unseen_requests: int = 0
    #: Every window of the request-rate and token-rate limits, requests first, each kind
    #: shortest (the paced one, also reported above) first; see :meth:`FlowControl.set_limits`
    windows: tuple[RateWindow, ...] = ()

    @property
    def effective_headroom_ms(self) -> int:
        """What the rate windows count over beyond their length now (ms)."""
        return max(self.headroom_ms, self.measured_headroom_ms)


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{what} must be an integer >= 1 (or None to remove the limit), got {value!r}"
        )
    return value


def _pacing_ms(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PACING_MS:
        raise ConfigurationError(
            f"{what} must be an integer number of ms from 0 to {MAX_PACING_MS}, got {value!r}"
        )
    return value


def _window_ms(per: object) -> int:
    if isinstance(per, str):  # set_rate_limit's per is seconds; names are for set_limits
        raise ConfigurationError(f"per must be a number of seconds, got {per!r}")
    return window_ms(per)


def _first_window_error(kind: str, limit: int, ms: int, reply: list[int]) -> ConfigurationError:
    """The paced window given is not shorter, or not lower, than a cap set with set_limits."""
    cap_ms, cap = int(reply[1]), int(reply[2])
    return ConfigurationError(
        f"{limit} {kind} per {seconds_text(ms)} s must be a shorter window with a lower limit than "
        f"the queue's other {kind} window ({cap} per {seconds_text(cap_ms)} s); set every window "
        "at once with set_limits"
    )


#: After a provider's 429 the pacers slow down for a while (dispatch.lua, slow_now): they
#: recover over this many of the longest limit window (at least a second).
SLOW_RECOVER_WINDOWS = 2


def pace_factor(control: dict[str, str], now: int) -> int:
    """The pacers' rate at ``now``, per mille of the limits' (as dispatch.lua's slow_now)."""
    if "slow_pm" not in control or "slow_at" not in control:
        return 1000
    pm, at = int(control["slow_pm"]), int(control["slow_at"])
    longest = max(int(control.get("rate_ms", 0)), int(control.get("tpm_ms", 0)), 1000)
    recover = SLOW_RECOVER_WINDOWS * longest
    if now - at >= recover:
        return 1000
    return math.floor(pm + (1000 - pm) * max(now - at, 0) / recover)


class FlowControl:
    """A queue's calls that set the shared gates (offered by :class:`Queue`)."""

    def __init__(self, core: QueueCore, budgets: Budgets) -> None:
        self.keys = core.keys
        self.scripts = core.scripts
        self.budgets = budgets
        self._core = core

    @property
    def redis(self) -> Redis:
        return self._core.redis

    async def _wake(self) -> None:
        await self._core.wake()

    @writes
    async def set_global_concurrency(self, limit: int | None) -> None:
        """At most ``limit`` jobs of this queue run at once, over all workers (None: no limit).

        Each worker's own ``concurrency`` still applies beside it.
        """
        if limit is None:
            await self.redis.hdel(self.keys.control, "concurrency")
        else:
            await self.redis.hset(
                self.keys.control, "concurrency", _positive_int("global concurrency", limit)
            )
        await self._wake()

    @writes
    async def set_rate_limit(self, max_starts: int | None, per: float = 1.0) -> None:
        """At most ``max_starts`` job starts in any ``per`` seconds, over all workers.

        A sliding window, counted over ``per`` plus the headroom
        (:meth:`set_pacing`): every ``max_starts + 1`` consecutive starts span
        at least that. The pacer spaces the starts evenly within it. None
        removes the limit, and the longer windows :meth:`set_limits` set
        beside it; a limit replaces the paced (shortest) window only, which
        must stay shorter and lower than those.
        """
        if max_starts is None:
            await self._set_windows("requests", "first", [])
            return
        limit, ms = _positive_int("max_starts", max_starts), _window_ms(per)
        if limit > MAX_REQUESTS:
            raise ConfigurationError(f"max_starts must be at most {MAX_REQUESTS:,}, got {max_starts!r}")
        reply = await self._set_windows("requests", "first", [(ms, limit)])
        if reply[0] == 0:
            raise _first_window_error("requests", limit, ms, reply)

    @writes
    async def set_token_rate_limit(
        self, tokens: int | None, per: float = 60.0, *, refund_unused: bool = False
    ) -> None:
        """At most ``tokens`` estimated tokens dispatched in any ``per`` seconds.

        Jobs reserve their ``tokens`` estimate when dispatched: for an LLM
        call, its prompt's tokens plus ``max_tokens``, which is what OpenAI's
        limiter counts when the call arrives. Usage the handler reports above
        the estimate is added to the window; usage below it is not given back,
        because that provider does not give it back either, unless
        ``refund_unused`` (for a provider whose limiter corrects its count by
        the output really written, as Anthropic's output-token limit does).
        The window is counted over ``per`` plus the headroom
        (:meth:`set_pacing`), and the pacer spaces starts by their tokens.
        None removes the limit, and the longer windows :meth:`set_limits` set
        beside it; a limit replaces the paced (shortest) window only, which
        must stay shorter and lower than those (``refund_unused`` applies to
        them all).
        """
        if tokens is None:
            await self._set_windows("tokens", "first", [])
            return
        limit = _positive_int("tokens", tokens)
        if limit > MAX_TOKENS:
            raise ConfigurationError(f"tokens must be at most {MAX_TOKENS}, got {tokens!r}")
        win_ms = _window_ms(per)
        if win_ms < 1000:
            raise ConfigurationError(f"a token-rate window must be at least 1 second, got {per!r}")
        reply = await self._set_windows("tokens", "first", [(win_ms, limit)], refund=refund_unused)
        if reply[0] == 0:
            raise _first_window_error("tokens", limit, win_ms, reply)

    @writes
    async def set_limits(
        self,
        *,
        requests: Limits | None = None,
        tokens: Limits | None = None,
        refund_unused: bool = False,
    ) -> None:
        """Every limit of a provider, as its page states them: per second, minute, hour or day.

        ``requests`` and ``tokens`` each map a window (``"second"``,
        ``"minute"``, ``"hour"``, ``"day"``, or a number of seconds) to its
        limit, e.g. ``requests={"minute": 500, "day": 10_000},
        tokens={"minute": 30_000, "day": 1_000_000}``. Each replaces every
        window of its kind (an empty dict removes them all); a kind not given
        stays as it is. At most three windows per kind, a longer one admitting
        more than a shorter one. The shortest is the limit
        :meth:`set_rate_limit` / :meth:`set_token_rate_limit` set, paced; the
        longer ones are hard caps: exact sliding logs, counted over their
        length plus the headroom, that stop starts once full until enough of
        what they count has left. Jobs reserve their token estimate on every
        token window, and ``refund_unused`` says for all of them whether usage
        below the estimate is given back. A token window new to the queue
        counts from now; the request windows count the starts already logged.
        """
        if requests is None and tokens is None:
            raise ConfigurationError(
                'give requests=, tokens= or both, e.g. requests={"minute": 500, "day": 10_000} '
                "(an empty dict removes every window of that kind)"
            )
        if refund_unused and tokens is None:
            raise ConfigurationError("refund_unused applies to the token windows: give tokens= too")
        asked = [
            (kind, given) for kind, given in (("requests", requests), ("tokens", tokens)) if given is not None
        ]
        checked = [(kind, check_limits(kind, given)) for kind, given in asked]  # all, before any change
        for kind, windows in checked:
            await self._set_windows(kind, "all", windows, refund=refund_unused)

    async def _set_windows(
        self, kind: str, which: str, windows: list[tuple[int, int]], *, refund: bool = False
    ) -> list[int]:
        args: list[str | int] = [kind, which, int(bool(refund))]
        for ms, limit in windows:
            args += [ms, limit]
        reply: list[int] = await self._core.run(self._core.commands.pace(args))
        return [int(v) for v in reply]

    @writes
    async def set_pacing(
        self, *, tolerance_ms: int | None = DEFAULT_TOLERANCE_MS, headroom_ms: int = DEFAULT_HEADROOM_MS
    ) -> None:
        """How the request-rate and token-rate limits space the starts they admit.

        The pacer spaces starts evenly, ``(per + headroom) / limit`` apart (per
        request, or per token for the token-rate limit), so a window's worth
        never leaves at once; a worker up to ``tolerance_ms`` late takes the
        starts it owes at once. ``tolerance_ms=None`` turns the pacer off: the
        limits' logs alone admit, in bursts. The headroom is added to every
        window the logs count, so calls that reach the provider up to that
        much closer together than they were started still fit its window. The
        workers measure it (the spread of their dispatch-to-send delays, see
        :meth:`JobContext.note_sent`); ``headroom_ms`` is the least used,
        for what they cannot see (network delays that differ between hosts).
        Defaults: the pacer on with 20 ms of tolerance, at least 10 ms of
        headroom (the answers then tell how late each call came, and a late
        one stays longer in the windows: docs/architecture.md, "Late calls
        stay longer"). A headroom costs headroom / window of the limit: 1 % of
        a 1-second limit, 0.02 % of a per-minute one.
        """
        tolerance = "off" if tolerance_ms is None else _pacing_ms("tolerance_ms", tolerance_ms)
        headroom = _pacing_ms("headroom_ms", headroom_ms)
        await self._core.run(self._core.commands.pace(["pacing", tolerance, headroom]))

    @writes
    async def follow_provider(self, enabled: bool = True) -> None:
        """Whether the limits follow what providers' answers say of theirs (on by default).

        Each completion's rate-limit headers (limit and remaining, for requests
        and tokens) reach the queue: use the provider counted that the queue did
        not start (another program on the same key) is added to its windows,
        and a limit the provider states lower than the queue's lowers the
        queue's (docs/architecture.md, "The provider's view"). Turn it off for a
        queue that spreads its calls over several keys, whose answers each
        speak for one key only.
        """
        if not isinstance(enabled, bool):
            raise ConfigurationError(f"enabled must be True or False, got {enabled!r}")
        if enabled:
            await self.redis.hdel(self.keys.control, "follow")
        else:
            await self.redis.hset(self.keys.control, "follow", 0)

    @writes
    async def pause(self) -> None:
        """Dispatch nothing until :meth:`resume`; running jobs go on."""
        await self.redis.hset(self.keys.control, "paused", 1)

    @writes
    async def resume(self) -> None:
        """Undo :meth:`pause`; idle workers wake at once."""
        await self.redis.hdel(self.keys.control, "paused")
        await self._wake()

    @writes
    async def throttle(self, seconds: float) -> None:
        """Dispatch nothing for ``seconds`` from now (Redis's clock); 0 lifts the throttle.

        Unlike a handler's ``Throttled``, which only ever extends the pause,
        this replaces it: an operator may shorten or lift it.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= 86_400:
            raise ConfigurationError(f"seconds must be from 0 to 86400, got {seconds!r}")
        if seconds == 0:
            await self.redis.hdel(self.keys.control, "throttled_until")
            await self._wake()
        else:
            until = await self._core.now_ms() + round(seconds * 1000)
            await self.redis.hset(self.keys.control, "throttled_until", until)

    @reads
    async def flow(self, *, now: int | None = None) -> FlowState:
        """The flow controls as set, and how full their windows are now."""
        k = self.keys
        t = now if now is not None else await self._core.now_ms()
        raw: dict[bytes, bytes] = await self.redis.hgetall(k.control)  # type: ignore[assignment]
        c = {key.decode(): value.decode() for key, value in raw.items()}
        rate_ms = int(c["rate_ms"]) if "rate_ms" in c else None
        least = int(c.get("headroom_ms", DEFAULT_HEADROOM_MS))
        measured = int(c.get("lag_h", 0))
        headroom = max(least, measured)
        request_windows = [(rate_ms, int(c["rate_max"]))] if rate_ms and "rate_max" in c else []
        if request_windows:
            request_windows += decode_request_caps(c.get("rate_caps"))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(k.active)
            for ms, _ in request_windows:
                pipe.zcount(k.starts, f"({t - ms - headroom}", "+inf")
            active, *starts = await pipe.execute()
        windows = [
            RateWindow("requests", limit, ms / 1000, int(n), paced=i == 0)
            for i, ((ms, limit), n) in enumerate(zip(request_windows, starts, strict=True))
        ]
        tpm: BudgetState | None = None
        if c.get("tpm") == "1":
            caps = decode_token_caps(c.get("tok_caps"))
            tpm, *capped = await self.budgets.get_many(
                [TOKEN_RATE_BUDGET, *(token_cap_budget(ms) for ms in caps)], now=t
            )
            if tpm:
                # the nominal window: the budget's counts the headroom too
                per = int(c["tpm_ms"]) / 1000 if "tpm_ms" in c else tpm.window_seconds or 0.0
                windows.append(RateWindow("tokens", tpm.limit, per, tpm.used, paced=True))
                windows += [
                    RateWindow("tokens", b.limit, ms / 1000, b.used, paced=False)
                    for ms, b in zip(caps, capped, strict=True)
                    if b is not None
                ]
        until = int(c["throttled_until"]) if "throttled_until" in c else 0
        tolerance = c.get("tolerance_ms", str(DEFAULT_TOLERANCE_MS))
        return FlowState(
            paused=c.get("paused") == "1",
            throttled_until_ms=until if until > t else None,
            concurrency=int(c["concurrency"]) if "concurrency" in c else None,
            active=int(active),
            rate_max=int(c["rate_max"]) if "rate_max" in c else None,
            rate_per_seconds=rate_ms / 1000 if rate_ms else None,
            starts_in_window=windows[0].in_window if request_windows else 0,
            token_limit=tpm.limit if tpm else None,
            token_per_seconds=next((w.per_seconds for w in windows if w.kind == "tokens"), None),
            tokens_in_window=tpm.used if tpm else 0,
            pace_tolerance_ms=None if tolerance == "off" else int(tolerance),
            headroom_ms=least,
            measured_headroom_ms=measured,
            pace_factor_pm=pace_factor(c, t),
            follows_provider=c.get("follow") != "0",
            unseen_requests=int(c.get("unseen_requests", 0)),
            windows=tuple(windows),
        )
