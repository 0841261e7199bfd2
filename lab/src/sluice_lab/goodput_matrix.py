"""The goodput matrix: every variant under every condition issue 13 names, in one run.

Issue 13 asks for goodput at the provider's exact published limits, with
zero refused calls, "in every cell" of: the three variants of
:mod:`sluice_lab.goodput` (Sluice's limits, retry-on-429, a per-process
aiolimiter) x 1 and 2 worker processes x 0, 5 and 50 ms of network delay
between workers and provider x refused calls not counted and counted by the
provider. Each cell is one :func:`~sluice_lab.goodput.run_variant` against a
fresh provider, with the same workload; the variants of one condition run
one after the other, so that they meet about the same load on a shared
machine.

A cell meets the target (:data:`TARGET_PCT`) when every job finished, the
provider refused no call, and the accepted calls used at least 97 % of the
binding limit in the windows while jobs waited (see
:func:`~sluice_lab.goodput.goodput`). :func:`write_plot` draws each cell's
goodput per variant against that line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sluice.testing.network import check_network_delay
from sluice_lab.goodput import (
    CLIENT_LIMITED,
    VARIANTS,
    GoodputSpec,
    Progress,
    run_variant,
    theoretical_min_s,
    workload,
)
from sluice_lab.goodput_report import spec_meta

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: Goodput, % of the binding limit, a cell must reach (with no 429 and every job done).
TARGET_PCT = 97.0
#: Seconds a cell may take by default: this many times the theoretical minimum, plus CELL_SLACK_S.
CELL_TIMEOUT_FACTOR = 2.0
CELL_SLACK_S = 10.0

T = TypeVar("T")

#: Called with (index of the cell, the cell) as it starts.
CellStart = Callable[[int, "Cell"], None]


@dataclass(frozen=True, slots=True)
class Cell:
    """One condition and one variant."""

    variant: str
    processes: int
    network_delay_ms: float
    count_rejected: bool

    def spec(self, base: GoodputSpec) -> GoodputSpec:
        return dataclasses.replace(
            base,
            processes=self.processes,
            network_delay=self.network_delay_ms / 1000,
            count_rejected=self.count_rejected,
        )

    def label(self) -> str:
        refusals = "counted" if self.count_rejected else "free"
        return f"{self.variant}, {self.processes} proc, {self.network_delay_ms:g} ms, refusals {refusals}"


@dataclass(frozen=True, slots=True)
class Matrix:
    """The axes of the matrix; each may be narrowed to some of its values."""

    variants: tuple[str, ...] = VARIANTS
    processes: tuple[int, ...] = (1, 2)
    network_delay_ms: tuple[float, ...] = (0.0, 5.0, 50.0)
    count_rejected: tuple[bool, ...] = (False, True)

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variant {unknown[0]!r}; use some of {', '.join(VARIANTS)}")
        if any(p < 1 for p in self.processes):
            raise ValueError(f"processes must be >= 1, got {list(self.processes)}")
        for delay in self.network_delay_ms:
            check_network_delay(delay / 1000)
        if not (self.variants and self.processes and self.network_delay_ms and self.count_rejected):
            raise ValueError("every axis of the matrix needs at least one value")

    def cells(self) -> list[Cell]:
        """Condition by condition (processes, delay, refusals), every variant within each."""
        return [
            Cell(variant, processes, delay, counted)
            for processes in _unique(self.processes)
            for delay in _unique(self.network_delay_ms)
            for counted in _unique(self.count_rejected)
            for variant in _unique(self.variants)
        ]


def _unique(values: Sequence[T]) -> list[T]:
    return list(dict.fromkeys(values))


def cell_specs(base: GoodputSpec, matrix: Matrix) -> list[tuple[Cell, GoodputSpec]]:
    """Every cell and its spec, all checked (ValueError) before the first one runs."""
    out = []
    for cell in matrix.cells():
        spec = cell.spec(base)
        if cell.variant == CLIENT_LIMITED:
            spec.client_limits()
        out.append((cell, spec))
    return out


def cell_timeout(base: GoodputSpec) -> float:
    """The default seconds per cell: a cell twice as slow as the limits allow has missed anyway."""
    minimum, _ = theoretical_min_s(base, workload(base.jobs))
    return round(CELL_TIMEOUT_FACTOR * minimum + CELL_SLACK_S, 1)


def meets_target(result: dict[str, Any]) -> bool:
    """Every job done, no call refused, goodput at least :data:`TARGET_PCT`."""
    pct = result.get("goodput_pct")
    return bool(result["complete"] and result["rate_limited"] == 0 and pct is not None and pct >= TARGET_PCT)


async def run_matrix(
    redis: Redis,
    url: str,
    base: GoodputSpec,
    matrix: Matrix,
    log_dir: Path | None = None,
    on_cell: CellStart | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run every cell of ``matrix`` on ``base`` (its processes, delay and refusals replaced per cell)."""
    results = []
    for i, (cell, spec) in enumerate(cell_specs(base, matrix)):
        if on_cell is not None:
            on_cell(i, cell)
        result = await run_variant(redis, url, spec, cell.variant, log_dir, progress)
        results.append(
            {
                **dataclasses.asdict(cell),
                "label": cell.label(),
                "meets_target": meets_target(result),
                "result": result,
            }
        )
    return {
        "spec": spec_meta(base),
        "matrix": dataclasses.asdict(matrix),
        "target_pct": TARGET_PCT,
        "cells": results,
        "met": sum(c["meets_target"] for c in results),
    }


_COLORS = {"sluice-limited": "#0969da", "no-limiter": "#cf222e", "aiolimiter": "#8250df"}


def _condition(cell: dict[str, Any]) -> tuple[int, float, bool]:
    return cell["processes"], cell["network_delay_ms"], cell["count_rejected"]


def write_plot(data: dict[str, Any], path: Path) -> Path:
    """Goodput per cell, a bar per variant, grouped by condition, with the target line.

    Above each bar: the provider's 429s for that cell; a hatched bar did not
    finish every job.
    """
    from sluice_lab.deps import require

    require("the goodput matrix plot", "matplotlib")
    from matplotlib.figure import Figure

    cells: list[dict[str, Any]] = data["cells"]
    conditions = list(dict.fromkeys(_condition(c) for c in cells))
    variants = list(dict.fromkeys(c["variant"] for c in cells))
    width = 0.8 / len(variants)
    fig = Figure(figsize=(max(6.0, 1.1 * len(conditions) + 2.0), 4.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    for k, variant in enumerate(variants):
        labelled = False
        for x, condition in enumerate(conditions):
            found = [c for c in cells if c["variant"] == variant and _condition(c) == condition]
            if not found:
                continue
            r = found[0]["result"]
            pct = r["goodput_pct"] or 0.0
            xpos = x - 0.4 + width * (k + 0.5)
            ax.bar(
                xpos,
                pct,
                width=width * 0.92,
                color=_COLORS.get(variant, "#57606a"),
                hatch=None if r["complete"] else "//",
                edgecolor="white",
                label=None if labelled else variant,
            )
            labelled = True
            ax.annotate(
                f"{r['rate_limited']:,}",
                (xpos, pct),
                ha="center",
                va="bottom",
                fontsize=6,
                rotation=90,
                color="#cf222e" if r["rate_limited"] else "#57606a",
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.axhline(data["target_pct"], color="#1a7f37", lw=1.0, ls="--", label=f"target {data['target_pct']:g} %")
    ax.set_xticks(
        list(range(len(conditions))),
        [f"{p} proc\n{d:g} ms\n{'counted' if c else 'free'}" for p, d, c in conditions],
        fontsize=8,
    )
    spec = data["spec"]
    ax.set_title(
        f"Goodput at the provider's limits ({spec['requests']:,} requests, {spec['tokens']:,} tokens per "
        f"{spec['window']:g} s), {spec['jobs']:,} calls per cell; 429s above each bar; hatched: not all done",
        loc="left",
        fontsize=9,
    )
    ax.set_ylabel("goodput, % of the binding limit")
    ax.set_xlabel("worker processes, network delay one way, refused calls")
    ax.set_ylim(0, 112)
    ax.grid(axis="y", color="#d0d7de", lw=0.6)
    ax.set_axisbelow(True)
    fig.legend(loc="outside lower center", fontsize=8, frameon=False, ncols=len(variants) + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", facecolor="white")
    return path
