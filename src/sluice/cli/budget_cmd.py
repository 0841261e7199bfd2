"""Budgets and flow controls from the terminal: ``sluice budget ...`` and ``sluice flow ...``."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

import typer
from rich.table import Table

from sluice.cli.jobs_cmd import QueueOpt, RedisOpt, _with_queue, console
from sluice.engine import BudgetState, FlowState, Queue
from sluice.engine.budgets import TOKEN_RATE_BUDGET

budget_app = typer.Typer(
    help="The token ledger of a queue: budgets with limits, windows and parents.", no_args_is_help=True
)
flow_app = typer.Typer(
    help="Flow controls shared by every worker of a queue: concurrency, rates, pause, throttle.",
    no_args_is_help=True,
)


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _window(b: BudgetState) -> str:
    if b.window == "rolling":
        return f"rolling {b.window_seconds:g} s"
    return b.window or "none"


def budget_table(budgets: list[BudgetState], title: str) -> Table:
    table = Table(title=title)
    for col in ("budget", "limit", "used", "remaining", "window", "parent", "accepted", "rejected"):
        table.add_column(col, justify="left" if col in ("budget", "window", "parent") else "right")
    table.add_column("unknown", justify="right")
    table.add_column("parked", justify="right")
    table.add_column("window turns / frees")
    for b in budgets:
        table.add_row(
            b.name,
            f"{b.limit:,}",
            f"{b.used:,}",
            f"{b.remaining:,}",
            _window(b),
            b.parent or "-",
            f"{b.accepted:,}",
            f"{b.rejected:,}",
            f"{b.unknown_outcomes:,}",
            f"{b.parked:,}",
            _when(b.resets_at_ms),
        )
    return table


async def _all_budgets(q: Queue) -> list[BudgetState]:
    prefix = q.keys.budget_prefix
    names: list[str] = []
    async for key in q.redis.scan_iter(match=_glob(prefix) + "*", count=1000):
        name = key.decode()[len(prefix) :]
        if name != TOKEN_RATE_BUDGET:
            names.append(name)
    return [b for b in await q.budgets.get_many(sorted(names)) if b is not None]


def _glob(text: str) -> str:
    for ch in "\\[]*?":
        text = text.replace(ch, "\\" + ch)
    return text


@budget_app.command("list")
def budget_list(queue: QueueOpt = "default", redis: RedisOpt = None) -> None:
    """Every budget of the queue, as it stands now."""

    async def go(q: Queue) -> None:
        budgets = await _all_budgets(q)
        if not budgets:
            console.print(f"queue {q.name} has no budgets; create one with `sluice budget create`")
            return
        console.print(budget_table(budgets, f"budgets of queue {q.name}"))

    _with_queue(redis, queue, go)


@budget_app.command("create")
def budget_create(
    name: Annotated[str, typer.Argument(help="Budget name (A-Z a-z 0-9 _ . : -).")],
    limit: Annotated[int, typer.Argument(help="Tokens it admits (per window, if it has one).")],
    window: Annotated[
        str | None,
        typer.Option(help='"day" or "month" (UTC calendar), or a number of seconds (rolling).'),
    ] = None,
    parent: Annotated[str | None, typer.Option(help="A budget every reservation must also fit.")] = None,
    queue: QueueOpt = "default",
    redis: RedisOpt = None,
) -> None:
    """Create a budget."""
    win: str | float | None = window
    if window is not None and window not in ("day", "month"):
        try:
            win = float(window)
        except ValueError:
            raise typer.BadParameter(
                'use "day", "month" or a number of seconds', param_hint="--window"
            ) from None

    async def go(q: Queue) -> None:
        b = await q.budgets.create(name, limit, window=win, parent=parent)
        console.print(budget_table([b], f"created in queue {q.name}"))

    _with_queue(redis, queue, go)


@budget_app.command("top-up")
def budget_top_up(
    name: Annotated[str, typer.Argument(help="Budget name.")],
    tokens: Annotated[int, typer.Argument(help="Tokens added to its limit.")],
    queue: QueueOpt = "default",
    redis: RedisOpt = None,
) -> None:
    """Add tokens to a budget's limit; jobs parked on it try again at once."""

    async def go(q: Queue) -> None:
        await q.budgets.top_up(name, tokens)
        console.print(budget_table([await q.budgets.get(name)], f"topped up in queue {q.name}"))

    _with_queue(redis, queue, go)


@budget_app.command("set-limit")
def budget_set_limit(
    name: Annotated[str, typer.Argument(help="Budget name.")],
    limit: Annotated[int, typer.Argument(help="The new limit.")],
    queue: QueueOpt = "default",
    redis: RedisOpt = None,
) -> None:
    """Set a budget's limit (raising it lets parked jobs try again)."""

    async def go(q: Queue) -> None:
        await q.budgets.set_limit(name, limit)
        console.print(budget_table([await q.budgets.get(name)], f"changed in queue {q.name}"))

    _with_queue(redis, queue, go)


def flow_table(f: FlowState, queue: str) -> Table:
    table = Table(title=f"flow controls of queue {queue}")
    table.add_column("control")
    table.add_column("limit", justify="right")
    table.add_column("now", justify="right")
    table.add_row("paused", "yes" if f.paused else "no", "")
    table.add_row("throttled until", _when(f.throttled_until_ms), "")
    table.add_row("global concurrency", str(f.concurrency or "none"), f"{f.active} running")
    rate = f"{f.rate_max} per {f.rate_per_seconds:g} s" if f.rate_max else "none"
    table.add_row("request rate", rate, f"{f.starts_in_window} in window")
    tokens = f"{f.token_limit:,} per {f.token_per_seconds:g} s" if f.token_limit else "none"
    table.add_row("token rate", tokens, f"{f.tokens_in_window:,} in window")
    return table


@flow_app.command("show")
def flow_show(queue: QueueOpt = "default", redis: RedisOpt = None) -> None:
    """The queue's flow controls and how full their windows are."""

    async def go(q: Queue) -> None:
        console.print(flow_table(await q.flow(), q.name))

    _with_queue(redis, queue, go)


def _per(value: str, what: str) -> tuple[int, float] | None:
    """'4/1' -> (4, 1.0); 'none' -> None."""
    if value == "none":
        return None
    count, _, per = value.partition("/")
    try:
        return int(count), float(per or "1")
    except ValueError:
        raise typer.BadParameter('use N/SECONDS (e.g. 4/1) or "none"', param_hint=what) from None


@flow_app.command("set")
def flow_set(
    concurrency: Annotated[str | None, typer.Option(help='Jobs at once over all workers, or "none".')] = None,
    rate: Annotated[str | None, typer.Option(help='Starts per window: N/SECONDS, or "none".')] = None,
    tokens: Annotated[
        str | None, typer.Option(help='Estimated tokens per window: N/SECONDS, or "none".')
    ] = None,
    queue: QueueOpt = "default",
    redis: RedisOpt = None,
) -> None:
    """Set or remove the shared limits (only those given change)."""
    conc: Any = None
    if concurrency is not None and concurrency != "none":
        try:
            conc = int(concurrency)
        except ValueError:
            raise typer.BadParameter('an integer or "none"', param_hint="--concurrency") from None
    rate_v = _per(rate, "--rate") if rate is not None else None
    tokens_v = _per(tokens, "--tokens") if tokens is not None else None

    async def go(q: Queue) -> None:
        if concurrency is not None:
            await q.set_global_concurrency(conc)
        if rate is not None:
            await q.set_rate_limit(*rate_v) if rate_v else await q.set_rate_limit(None)
        if tokens is not None:
            await q.set_token_rate_limit(*tokens_v) if tokens_v else await q.set_token_rate_limit(None)
        console.print(flow_table(await q.flow(), q.name))

    _with_queue(redis, queue, go)


@flow_app.command("pause")
def flow_pause(queue: QueueOpt = "default", redis: RedisOpt = None) -> None:
    """Dispatch nothing until `sluice flow resume`; running jobs go on."""
    _with_queue(redis, queue, lambda q: q.pause())
    console.print(f"queue {queue} paused")


@flow_app.command("resume")
def flow_resume(queue: QueueOpt = "default", redis: RedisOpt = None) -> None:
    """Dispatch again; idle workers wake at once."""
    _with_queue(redis, queue, lambda q: q.resume())
    console.print(f"queue {queue} resumed")


@flow_app.command("throttle")
def flow_throttle(
    seconds: Annotated[
        float, typer.Argument(min=0, max=86_400, help="Seconds to hold dispatch (0 lifts it).")
    ],
    queue: QueueOpt = "default",
    redis: RedisOpt = None,
) -> None:
    """Hold dispatch for some seconds, as a provider's 429 does."""
    _with_queue(redis, queue, lambda q: q.throttle(seconds))
    console.print(
        f"queue {queue} throttled for {seconds:g} s" if seconds else f"queue {queue} throttle lifted"
    )
