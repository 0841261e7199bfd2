"""Flow controls shared by every worker of a queue: ``sluice flow show | set | pause | resume | throttle``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Annotated

import typer
from rich.console import RenderableType

from sluice.cli.options import JsonOpt, PrefixOpt, QueueOpt, RedisOpt, Target, at_least
from sluice.cli.output import fields_table, print_json, stdout, utc
from sluice.cli.parsing import SluiceCommand
from sluice.cli.runtime import with_queue
from sluice.engine import FlowState, Queue
from sluice.engine.flow import MAX_PACING_MS
from sluice.engine.job import MAX_TOKENS
from sluice.engine.windows import MAX_WINDOWS, check_limits
from sluice.errors import ConfigurationError
from sluice.settings import DEFAULT_PREFIX, DEFAULT_QUEUE

flow_app = typer.Typer(
    help="Flow controls shared by every worker of a queue: concurrency, rates, pause, throttle.",
    no_args_is_help=True,
)

#: The longest throttle and the longest rate window, in seconds (the library's bounds).
MAX_SECONDS = 86_400
Limit = tuple[int, float] | None
#: The windows --limit and --token-limit take by name (seconds).
WINDOW_NAMES = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86_400,
    "day": 86_400,
}
#: What --limit and --token-limit accept, for their --help and errors.
LIMIT_FORMS = "N/WINDOW, WINDOW one of s, min, h, day (or second, minute, hour) or seconds"


def flow_table(f: FlowState, target: Target) -> RenderableType:
    table = fields_table(f"flow controls of {target.describe()}")
    table.add_row("paused", "yes (`sluice flow resume` ends it)" if f.paused else "no")
    table.add_row("throttled until", utc(f.throttled_until_ms) if f.throttled_until_ms else "not throttled")
    table.add_row("global concurrency", f"{f.concurrency or 'none'} ({f.active} running)")
    rate = f"{f.rate_max} per {f.rate_per_seconds:g} s" if f.rate_max else "none"
    table.add_row("request rate", f"{rate} ({f.starts_in_window} started in the window)")
    for w in f.windows:
        if w.kind == "requests" and not w.paced:
            table.add_row("request cap", f"{w.limit} per {w.per_seconds:g} s ({w.in_window} started in it)")
    tokens = f"{f.token_limit:,} per {f.token_per_seconds:g} s" if f.token_limit else "none"
    table.add_row("token rate", f"{tokens} ({f.tokens_in_window:,} in the window)")
    for w in f.windows:
        if w.kind == "tokens" and not w.paced:
            table.add_row("token cap", f"{w.limit:,} per {w.per_seconds:g} s ({w.in_window:,} in it)")
    pace = "off (the windows alone)" if f.pace_tolerance_ms is None else f"{f.pace_tolerance_ms} ms tolerance"
    measured = f"measured {f.measured_headroom_ms} ms" if f.measured_headroom_ms else "none measured lately"
    table.add_row(
        "pacing", f"{pace}, {f.effective_headroom_ms} ms headroom (at least {f.headroom_ms}; {measured})"
    )
    if f.pace_factor_pm < 1000:
        table.add_row("after a 429", f"starts paced at {f.pace_factor_pm / 10:g} % of the limits, recovering")
    return table


def _apply(target: Target, change: Callable[[Queue], Awaitable[object]], as_json: bool = False) -> None:
    """Make a change (or none) and print the flow controls as they are after it."""

    async def go(q: Queue) -> FlowState:
        await change(q)
        return await q.flow()

    state = with_queue(target, go)
    if as_json:
        print_json(asdict(state))
    else:
        stdout().print(flow_table(state, target))


async def _nothing(_q: Queue) -> None:
    return None


@flow_app.command("show", cls=SluiceCommand)
def flow_show(
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """The queue's flow controls and how full their windows are."""
    _apply(Target(queue, prefix, redis), _nothing, as_json)


def _count(value: str, hint: str) -> int | None:
    """'none' -> None (remove the limit), else a whole number of 1 or more."""
    if value == "none":
        return None
    if not value.isdigit() or int(value) < 1:
        raise typer.BadParameter(
            f'use a whole number of 1 or more, or "none" to remove it; got {value!r}', param_hint=hint
        )
    return int(value)


def _per(value: str, hint: str, low_seconds: float, high_count: int) -> Limit:
    """N/SECONDS -> (N, SECONDS); 'none' -> None (remove the limit)."""
    if value == "none":
        return None
    count, _, per = value.partition("/")
    try:
        n, seconds = int(count), float(per or "1")
    except ValueError:
        n, seconds = 0, 0.0
    if not 1 <= n <= high_count or not low_seconds <= seconds <= MAX_SECONDS:
        raise typer.BadParameter(
            f"use N/SECONDS with N from 1 to {high_count:,} and SECONDS from {low_seconds:g} to "
            f'{MAX_SECONDS} (e.g. 4/1), or "none" to remove it; got {value!r}',
            param_hint=hint,
        )
    return n, seconds


def _windows(values: list[str], kind: str, hint: str) -> dict[float, int]:
    """The values of a repeatable --limit / --token-limit (N/WINDOW) as set_limits takes them;
    "none" (alone) removes every window of the kind."""
    if values == ["none"]:
        return {}
    windows: dict[float, int] = {}
    for value in values:
        count, _, per = value.partition("/")
        seconds: float | None = WINDOW_NAMES.get(per.strip().lower())
        try:
            n = int(count)
            if seconds is None:
                seconds = float(per)
        except ValueError:
            n = 0
        if n < 1 or seconds is None:
            raise typer.BadParameter(
                f'use {LIMIT_FORMS}, e.g. 500/min or 10000/day (up to {MAX_WINDOWS} of them), or "none" '
                f"alone to remove them all; got {value!r}",
                param_hint=hint,
            )
        if seconds in windows:
            raise typer.BadParameter(f"the window of {seconds:g} s is given twice", param_hint=hint)
        windows[seconds] = n
    try:
        check_limits(kind, windows)
    except ConfigurationError as exc:
        raise typer.BadParameter(str(exc), param_hint=hint) from None
    return windows


def _set_limits(kind: str, windows: dict[float, int]) -> Callable[[Queue], Awaitable[None]]:
    async def change(q: Queue) -> None:
        if kind == "requests":
            await q.set_limits(requests=windows)
        else:
            await q.set_limits(tokens=windows)

    return change


def _tolerance(value: str) -> int | None:
    """'off' -> None (no pacer), else whole ms from 0 to MAX_PACING_MS."""
    if value == "off":
        return None
    if not value.isdigit() or int(value) > MAX_PACING_MS:
        raise typer.BadParameter(
            f'use whole ms from 0 to {MAX_PACING_MS}, or "off" for no pacer; got {value!r}',
            param_hint="--tolerance-ms",
        )
    return int(value)


@flow_app.command("set", cls=SluiceCommand)
def flow_set(
    as_json: JsonOpt = False,
    concurrency: Annotated[
        str | None, typer.Option(help='Jobs running at once over all workers, or "none".')
    ] = None,
    rate: Annotated[str | None, typer.Option(help='Job starts per window: N/SECONDS, or "none".')] = None,
    tokens: Annotated[
        str | None, typer.Option(help='Estimated tokens per window: N/SECONDS (at least 1 s), or "none".')
    ] = None,
    limit: Annotated[
        list[str] | None,
        typer.Option(
            "--limit",
            metavar="N/WINDOW",
            help=(
                f"Job starts per window, as the provider states them; repeat for each ({LIMIT_FORMS}), "
                "e.g. --limit 500/min --limit 10000/day. Replaces every request window: the shortest "
                'is paced, the others are hard caps. "none" removes them.'
            ),
        ),
    ] = None,
    token_limit: Annotated[
        list[str] | None,
        typer.Option(
            "--token-limit",
            metavar="N/WINDOW",
            help=(
                "Estimated tokens per window, as --limit (windows of at least 1 s), e.g. "
                "--token-limit 30000/min --token-limit 1000000/day."
            ),
        ),
    ] = None,
    tolerance_ms: Annotated[
        str | None,
        typer.Option(
            help='The pacer\'s tolerance in ms (default 20), or "off": the windows alone, in bursts.'
        ),
    ] = None,
    headroom_ms: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=MAX_PACING_MS,
            help=(
                "The least ms added to every rate window (default 10); the workers' measured "
                "spread of dispatch-to-send delays is used when larger."
            ),
        ),
    ] = None,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Set or remove the shared limits; only those given change."""
    changes: list[Callable[[Queue], Awaitable[None]]] = []
    if concurrency is not None:
        most = _count(concurrency, "--concurrency")
        changes.append(lambda q: q.set_global_concurrency(most))
    if rate is not None:
        starts = _per(rate, "--rate", 0.001, 10**9)
        changes.append(lambda q: q.set_rate_limit(*starts) if starts else q.set_rate_limit(None))
    if tokens is not None:
        window = _per(tokens, "--tokens", 1, MAX_TOKENS)
        changes.append(lambda q: q.set_token_rate_limit(*window) if window else q.set_token_rate_limit(None))
    for many, one, kind, hint in (
        (limit, rate, "requests", "--limit"),
        (token_limit, tokens, "tokens", "--token-limit"),
    ):
        if many:
            if one is not None:
                other = "--rate" if kind == "requests" else "--tokens"
                raise typer.BadParameter(
                    f"give {other} (the shortest window only) or {hint} (every window), not both",
                    param_hint=hint,
                )
            changes.append(_set_limits(kind, _windows(many, kind, hint)))
    if tolerance_ms is not None or headroom_ms is not None:
        tolerance = _tolerance(tolerance_ms) if tolerance_ms is not None else None

        async def pacing(q: Queue) -> None:
            now = await q.flow()
            await q.set_pacing(
                tolerance_ms=now.pace_tolerance_ms if tolerance_ms is None else tolerance,
                headroom_ms=now.headroom_ms if headroom_ms is None else headroom_ms,
            )

        changes.append(pacing)
    if not changes:
        raise typer.BadParameter(
            "give --concurrency, --rate, --tokens, --limit, --token-limit, --tolerance-ms or "
            "--headroom-ms (or several)"
        )

    async def change(q: Queue) -> None:
        for one in changes:
            await one(q)

    _apply(Target(queue, prefix, redis), change, as_json)


@flow_app.command("pause", cls=SluiceCommand)
def flow_pause(
    queue: QueueOpt = DEFAULT_QUEUE, prefix: PrefixOpt = DEFAULT_PREFIX, redis: RedisOpt = None
) -> None:
    """Dispatch nothing until `sluice flow resume`; running jobs go on."""
    _apply(Target(queue, prefix, redis), Queue.pause)


@flow_app.command("resume", cls=SluiceCommand)
def flow_resume(
    queue: QueueOpt = DEFAULT_QUEUE, prefix: PrefixOpt = DEFAULT_PREFIX, redis: RedisOpt = None
) -> None:
    """Dispatch again; idle workers wake at once."""
    _apply(Target(queue, prefix, redis), Queue.resume)


@flow_app.command("throttle", cls=SluiceCommand)
def flow_throttle(
    seconds: Annotated[
        float,
        typer.Argument(
            callback=at_least(
                0.0, f"seconds must be from 0 to {MAX_SECONDS} (0 lifts the throttle)", 86_400.0
            ),
            help="Seconds to hold dispatch, as a provider's 429 does (0 lifts it).",
        ),
    ],
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Hold dispatch for some seconds; running jobs go on."""

    async def throttle(q: Queue) -> None:
        await q.throttle(seconds)

    _apply(Target(queue, prefix, redis), throttle)
