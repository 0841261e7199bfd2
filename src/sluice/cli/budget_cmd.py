"""The token ledger from the terminal: ``sluice budget list | create | top-up | set-limit``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.text import Text

from sluice.cli.errors import CliFailure
from sluice.cli.options import (
    JsonOpt,
    PrefixOpt,
    QueueOpt,
    RedisOpt,
    Target,
    at_least,
    budget_name,
    parse_window,
)
from sluice.cli.output import plain_table, print_json, span, stdout, utc
from sluice.cli.parsing import SluiceCommand
from sluice.cli.runtime import with_queue
from sluice.engine import BudgetState, Queue
from sluice.engine.budgets import TOKEN_RATE_BUDGET
from sluice.engine.clock import now_ms
from sluice.engine.job import MAX_TOKENS
from sluice.errors import BudgetError, BudgetNotFound
from sluice.settings import DEFAULT_PREFIX, DEFAULT_QUEUE

budget_app = typer.Typer(
    help="The token ledger of a queue: budgets with limits, windows and parents.", no_args_is_help=True
)

NameArg = Annotated[str, typer.Argument(callback=budget_name, help="Budget name (A-Z a-z 0-9 _ . : -).")]
LimitArg = Annotated[
    int,
    typer.Argument(
        callback=at_least(0, f"the limit must be from 0 to {MAX_TOKENS:,} tokens", MAX_TOKENS),
        help="Tokens it admits (per window, if it has one).",
    ),
]
TokensArg = Annotated[
    int,
    typer.Argument(
        callback=at_least(
            1, "tokens must be 1 or more", advice="to lower a budget, use `sluice budget set-limit`"
        ),
        help="Tokens added to its limit.",
    ),
]
WideOpt = Annotated[
    bool, typer.Option("--wide", help="Also the parent and the counters (needs ~125 columns).")
]


def _window(b: BudgetState) -> str:
    if b.window != "rolling" or b.window_seconds is None:
        return b.window or "none"
    seconds = b.window_seconds
    for unit, size in (("d", 86_400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"rolling {seconds / size:g} {unit}"
    return f"rolling {seconds:g} s"


def _tokens(n: int, exact: bool) -> str:
    """1,234 / 98,765 / 1.23M / 499M: three figures for large counts, so the table fits 80 columns."""
    if exact or n < 100_000:
        return f"{n:,}"
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            value = n / size
            return f"{value:.3g}{unit}" if value < 1000 else f"{value:.0f}{unit}"
    return f"{n:,}"  # pragma: no cover - n >= 100,000 always has a unit


def _until(ms: int | None, now: int) -> str:
    return "-" if ms is None else span(max(ms - now, 0), compact=True)


def _tree(budgets: list[BudgetState]) -> list[tuple[int, BudgetState]]:
    """Budgets with their depth, each parent followed by its children (sorted by name)."""
    names = {b.name for b in budgets}
    children: dict[str | None, list[BudgetState]] = {}
    for b in sorted(budgets, key=lambda b: b.name):
        children.setdefault(b.parent if b.parent in names else None, []).append(b)
    out: list[tuple[int, BudgetState]] = []

    def walk(parent: str | None, depth: int) -> None:
        for b in children.get(parent, []):
            out.append((depth, b))
            walk(b.name, depth + 1)

    walk(None, 0)
    return out


def budget_table(budgets: list[BudgetState], title: str, *, wide: bool = False) -> RenderableType:
    """Fits 80 columns: a child budget is indented under its parent, large counts are rounded
    to three figures (1.23M); --wide gives exact counts, the parent and the counters."""
    now = now_ms()
    table = plain_table(title)
    # --wide is for a wide terminal: names and numbers stay whole there, never folded.
    table.add_column("budget", overflow="fold", min_width=8, no_wrap=wide)
    for col in ("limit", "used", "remaining"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("window", no_wrap=True)
    table.add_column("resets in" if not wide else "turns / frees (UTC)", no_wrap=True)
    if wide:
        table.add_column("parent", no_wrap=True)
        for col in ("accepted", "rejected", "unknown", "parked", "beyond"):
            table.add_column(col, justify="right", no_wrap=True)
    for depth, b in _tree(budgets):
        row = [
            ("  " * (depth - 1) + "└─" if depth else "") + b.name,
            *(_tokens(n, wide) for n in (b.limit, b.used)),
            # An overspent budget (usage beyond estimates, charged in full) admits nothing.
            Text(f"over {_tokens(b.overspent, wide)}", style="bold red")
            if b.overspent
            else _tokens(b.remaining, wide),
            _window(b),
            utc(b.resets_at_ms, seconds_only=True).removesuffix(" UTC")
            if wide
            else _until(b.resets_at_ms, now),
        ]
        if wide:
            row.append(b.parent or "-")
            row += [
                f"{n:,}" for n in (b.accepted, b.rejected, b.unknown_outcomes, b.parked, b.beyond_estimates)
            ]
        table.add_row(*row)
    return table


def _print(budgets: list[BudgetState], title: str, as_json: bool, wide: bool = False) -> None:
    if as_json:
        print_json([asdict(b) for b in budgets])
    else:
        stdout().print(budget_table(budgets, title, wide=wide))


async def all_budgets(q: Queue) -> list[BudgetState]:
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


@budget_app.command("list", cls=SluiceCommand)
def budget_list(
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Every budget of the queue as it stands now: limit, use, window and when it resets."""
    target = Target(queue, prefix, redis)
    budgets = with_queue(target, all_budgets)
    if not budgets and not as_json:
        stdout().print(
            f"{target.describe()} has no budgets; create one with `sluice budget create NAME LIMIT"
            f"{target.flags()}`"
        )
        return
    _print(budgets, f"budgets of {target.describe()}", as_json, wide)


@budget_app.command("create", cls=SluiceCommand)
def budget_create(
    name: NameArg,
    limit: LimitArg,
    as_json: JsonOpt = False,
    window: Annotated[
        str | None,
        typer.Option(
            help='"day" or "month" (renews each UTC calendar day or month), or a number of seconds '
            "(rolling: tokens charged longer ago no longer count). Default: no window (top it up).",
            show_default=False,
        ),
    ] = None,
    parent: Annotated[
        str | None,
        typer.Option(callback=budget_name, help="An existing budget every reservation must also fit."),
    ] = None,
    exist_ok: Annotated[
        bool, typer.Option("--exist-ok", help="Succeed if it exists (its settings stay as they are).")
    ] = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Create a budget that jobs of the queue spend from (sluice enqueue --budget NAME)."""
    target = Target(queue, prefix, redis)
    win = parse_window(window)

    async def create(q: Queue) -> BudgetState:
        try:
            return await q.budgets.create(name, limit, window=win, parent=parent, exist_ok=exist_ok)
        except BudgetNotFound as exc:
            if exc.name != parent:
                raise
            raise CliFailure(
                f"parent budget {parent!r} does not exist in {target.describe()}; create it first with "
                f"`sluice budget create {parent} LIMIT{target.flags()}`"
            ) from exc

    _print([with_queue(target, create)], f"budget of {target.describe()}", as_json)


@budget_app.command("top-up", cls=SluiceCommand)
def budget_top_up(
    name: NameArg,
    tokens: TokensArg,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Add tokens to a budget's limit; jobs parked on it try again at once."""
    target = Target(queue, prefix, redis)

    async def top_up(q: Queue) -> BudgetState:
        try:
            await q.budgets.top_up(name, tokens)
        except BudgetError as exc:
            if isinstance(exc, BudgetNotFound):
                raise
            raise CliFailure(
                f"topping up {name!r} by {tokens:,} would take its limit past {MAX_TOKENS:,}; set the "
                f"limit you want with `sluice budget set-limit {name} N{target.flags()}`"
            ) from exc
        return await q.budgets.get(name)

    _print([with_queue(target, top_up)], f"budget of {target.describe()}", as_json)


@budget_app.command("set-limit", cls=SluiceCommand)
def budget_set_limit(
    name: NameArg,
    limit: LimitArg,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Set a budget's limit; raising it lets jobs parked on it try again."""
    target = Target(queue, prefix, redis)

    async def set_limit(q: Queue) -> BudgetState:
        await q.budgets.set_limit(name, limit)
        return await q.budgets.get(name)

    _print([with_queue(target, set_limit)], f"budget of {target.describe()}", as_json)
