"""The token ledger from the terminal: ``sluice budget list | create | credit | adjust | set-limit |
held | sweep``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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
from sluice.cli.output import plain_table, print_json, span, stderr, stdout, utc
from sluice.cli.parsing import SluiceCommand
from sluice.cli.runtime import with_queue
from sluice.engine import BudgetState, Queue
from sluice.engine.budget_state import BudgetChange, is_rate_budget
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
            1, "tokens must be 1 or more", advice="to lower a budget, use `sluice budget adjust NAME -N`"
        ),
        help="Tokens the current window admits beyond the limit.",
    ),
]
DeltaArg = Annotated[
    int,
    typer.Argument(
        callback=at_least(
            -MAX_TOKENS, f"the change must be from {-MAX_TOKENS:,} to {MAX_TOKENS:,} tokens", MAX_TOKENS
        ),
        help="Tokens added to the limit of every window (negative to lower it).",
    ),
]
OpIdOpt = Annotated[
    str | None,
    typer.Option(
        "--op-id",
        help="An id for this change (e.g. a UUID), the same on every retry of it: the change applies "
        "once, and a retry prints what the first did.",
        show_default=False,
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
            # a one-off credit shows beside the standing limit: "1,000 +500"
            _tokens(b.limit, wide) + (f" +{_tokens(b.credit, wide)}" if b.credit else ""),
            _tokens(b.used, wide),
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
        if not is_rate_budget(name):
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


def _change(
    target: Target, name: str, what: str, call: Callable[[Queue], Awaitable[BudgetChange]], as_json: bool
) -> None:
    async def run(q: Queue) -> tuple[BudgetChange, BudgetState]:
        try:
            change = await call(q)
        except BudgetNotFound:
            raise
        except BudgetError as exc:
            raise CliFailure(f"{exc}. Nothing was changed.") from exc
        return change, await q.budgets.get(name)

    change, state = with_queue(target, run)
    if not change.applied and not as_json:
        stderr().print(f"this operation id was applied before: nothing changed now ({what} left it as shown)")
    _print([state], f"budget of {target.describe()}", as_json)


@budget_app.command("credit", cls=SluiceCommand)
def budget_credit(
    name: NameArg,
    tokens: TokensArg,
    op_id: OpIdOpt = None,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """A one-off credit: the current window admits TOKENS more, later windows do not.

    A day or month budget's credit ends when the window turns; a rolling
    budget's lasts one window length; without a window it never ends. To raise
    what every window admits, use `sluice budget adjust`. Jobs parked on the
    budget try again at once.
    """
    target = Target(queue, prefix, redis)
    _change(target, name, "the first credit", lambda q: q.budgets.credit(name, tokens, op_id=op_id), as_json)


@budget_app.command("adjust", cls=SluiceCommand)
def budget_adjust(
    name: NameArg,
    delta: DeltaArg,
    op_id: OpIdOpt = None,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Add DELTA (negative to lower it) to the limit of every window, atomically.

    Changes made at once from several places all apply, unlike reading the
    limit and setting a new one. Raising it lets parked jobs try again.
    """
    target = Target(queue, prefix, redis)
    _change(
        target, name, "the first adjustment", lambda q: q.budgets.adjust(name, delta, op_id=op_id), as_json
    )


@budget_app.command("top-up", cls=SluiceCommand, hidden=True)
def budget_top_up(
    name: NameArg,
    tokens: TokensArg,
    op_id: OpIdOpt = None,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Deprecated: use `sluice budget credit` (this window only) or `sluice budget adjust` (every window)."""
    stderr().print(
        "`sluice budget top-up` is deprecated: it is `sluice budget credit` (a one-off credit to the "
        "current window); use `sluice budget adjust` to raise the limit of every window"
    )
    budget_credit(name, tokens, op_id, as_json, queue, prefix, redis)


@budget_app.command("set-limit", cls=SluiceCommand)
def budget_set_limit(
    name: NameArg,
    limit: LimitArg,
    op_id: OpIdOpt = None,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Set the limit of every window (this one too); raising it lets parked jobs try again."""
    target = Target(queue, prefix, redis)
    _change(target, name, "the first call", lambda q: q.budgets.set_limit(name, limit, op_id=op_id), as_json)


@budget_app.command("held", cls=SluiceCommand)
def budget_held(
    budget: Annotated[
        str | None,
        typer.Option(callback=budget_name, help="Only holds charging this budget.", show_default=False),
    ] = None,
    limit: Annotated[
        int,
        typer.Option(
            callback=at_least(1, "--limit must be from 1 to 100,000", 100_000), help="At most this many."
        ),
    ] = 100,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Reservations that callers (queue.budgets.reserve) hold and have not settled, first to expire first.

    A hold not settled in time is swept as an unknown outcome by the queue's
    workers; `sluice budget sweep` does it now.
    """
    target = Target(queue, prefix, redis)
    held = with_queue(target, lambda q: q.budgets.held(budget=budget, limit=limit))
    if as_json:
        print_json([asdict(h) for h in held])
        return
    if not held:
        stdout().print(f"no held reservations in {target.describe()}")
        return
    now = now_ms()
    table = plain_table(f"held reservations of {target.describe()}")
    table.add_column("id", overflow="fold")
    table.add_column("budgets", overflow="fold")
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("held for", no_wrap=True)
    table.add_column("expires in", no_wrap=True)
    table.add_column("job", no_wrap=True)
    for h in held:
        left = h.expires_at_ms - now
        table.add_row(
            h.id,
            " < ".join(h.budgets),
            f"{h.tokens:,}",
            span(max(now - h.reserved_at_ms, 0), compact=True),
            span(left, compact=True) if left > 0 else Text("expired", style="bold red"),
            h.job or "-",
        )
    stdout().print(table)


@budget_app.command("sweep", cls=SluiceCommand)
def budget_sweep(
    ids: Annotated[
        list[str] | None,
        typer.Argument(
            help="Holds to settle now, whatever their time (default: those whose time ran out).",
            show_default=False,
        ),
    ] = None,
    refund: Annotated[
        bool,
        typer.Option("--refund", help="Give the tokens back (the provider was never called); needs IDS."),
    ] = False,
    as_json: JsonOpt = False,
    queue: QueueOpt = DEFAULT_QUEUE,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    redis: RedisOpt = None,
) -> None:
    """Settle holds nobody will settle: as unknown outcomes (tokens stay charged), or refunded.

    Without IDS: every hold whose time ran out. With IDS: those holds now (a
    caller you know has crashed); add --refund only when you know it never
    called the provider.
    """
    target = Target(queue, prefix, redis)
    if refund and not ids:
        raise CliFailure(
            "--refund needs the ids of the holds to refund (see `sluice budget held`); holds whose time "
            "ran out are swept as unknown outcomes, since their callers may have called the provider"
        )
    swept = with_queue(target, lambda q: q.budgets.sweep(ids or None, refund=refund))
    if as_json:
        print_json([asdict(s) for s in swept])
        return
    done = [s for s in swept if s.changed]
    how = "refunded" if refund else "settled as unknown outcomes (tokens stay charged)"
    stdout().print(f"{len(done)} hold(s) {how}" + (": " + ", ".join(s.id for s in done) if done else ""))
    for s in swept:
        if not s.changed:
            stdout().print(f"{s.id}: not held ({s.state}), left as it is")
