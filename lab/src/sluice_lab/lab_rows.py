"""What the tables of ``sluice bench lab`` show: a result read by its keys (a partial one still
renders), and the rows of figures and checks that the terminal table and the HTML summary
share, so that the two always show the same figures."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

Result = Mapping[str, Any]
Cell = Callable[[Result], str]
Row = tuple[str, Cell]


# -- reading the results ------------------------------------------------------------------------------------


def _at(data: Any, *path: str) -> Any:
    """The value at a path of keys, or None where a step is missing: a partial result still renders."""
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _is_num(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _num(value: Any, digits: int = 1) -> str:
    return f"{value:,.{digits}f}" if _is_num(value) else "-"


def _field(*path: str, digits: int = 1) -> Cell:
    def cell(result: Result) -> str:
        value = _at(result, *path)
        if isinstance(value, str):
            return value
        return _num(value, digits)

    return cell


def _of(part: tuple[str, ...], whole: tuple[str, ...]) -> Cell:
    """'n of limit': a remaining budget or a peak reads only against what it may reach."""

    def cell(result: Result) -> str:
        return f"{_num(_at(result, *part), 0)} of {_num(_at(result, *whole), 0)}"

    return cell


def _admitted(budget: str) -> Cell:
    def cell(result: Result) -> str:
        tokens = _num(_at(result, budget, "admittedTokens"), 0)
        return f"{tokens} ({_num(_at(result, budget, 'acceptedReservations'), 0)} jobs)"

    return cell


def _workers(result: Result) -> str:
    ids = _at(result, "metrics", "workerIds")
    return ", ".join(str(w) for w in ids) if isinstance(ids, list) and ids else "-"


def _latency_rows(name: str, key: str) -> tuple[Row, ...]:
    return tuple((f"{name} {p} ms", _field("metrics", key, p)) for p in ("p50", "p95", "p99"))


#: Rows of figures, in groups (a rule between groups); shared by the terminal and HTML tables.
_FIGURES: tuple[tuple[Row, ...], ...] = (
    (
        ("throughput, jobs/s", _field("metrics", "throughputJobsPerSecond", digits=2)),
        ("max concurrent", _of(("metrics", "maxConcurrent"), ("workload", "globalConcurrency"))),
        ("min ms between every 5th start", _field("metrics", "minimumMsBetweenEveryFifthStart")),
    ),
    (
        *_latency_rows("queue wait", "queueWaitMs"),
        *_latency_rows("processing", "processingMs"),
        *_latency_rows("end to end", "endToEndMs"),
    ),
    (
        ("race admitted, tokens", _admitted("raceBudget")),
        ("race rejected, jobs", _field("raceBudget", "rejectedReservations", digits=0)),
        ("race remaining, tokens", _of(("raceBudget", "remaining"), ("raceBudget", "initial"))),
        ("race admitted util. %", _field("raceBudget", "admittedUtilizationPct")),
        ("race ledger util. %", _field("raceBudget", "ledgerUtilizationPct")),
        ("load budget remaining", _of(("loadBudget", "remaining"), ("loadBudget", "initial"))),
    ),
    (
        ("overuse spend, tokens", _of(("overuseBudget", "realSpend"), ("overuseBudget", "limit"))),
        ("overuse overspend", _field("overuseBudget", "overspend", digits=0)),
        ("overuse bound", _field("overuseBudget", "bound", digits=0)),
        ("overuse ledger used", _field("overuseBudget", "ledgerUsed", digits=0)),
        ("overuse ledger overspent", _field("overuseBudget", "ledgerOverspent", digits=0)),
        ("overuse admitted, jobs", _field("overuseBudget", "admittedJobs", digits=0)),
    ),
    (("workers", _workers),),
)

#: (label, key in "checks"); "all checks" last, after a rule.
_CHECKS: tuple[tuple[str, str], ...] = (
    ("two workers used", "usedTwoWorkers"),
    ("priority order enforced", "priorityOrderEnforced"),
    ("concurrency ceiling held", "sharedConcurrencyCeilingHeld"),
    ("global rate limit observed", "globalRateLimitObserved"),
    ("budget never overspent", "atomicBudgetNeverOverspent"),
    ("race outcome as expected", "raceOutcomeMatchedExpectation"),
    ("overuse spend within bound", "overuseWithinBound"),
    ("ledger used = real spend", "ledgerMatchesRealSpend"),
    ("429 paused the queue, no failure", "throttleRecovered"),
    ("all checks", "allPassed"),
)
#: The last of the budget checks: a rule after it in the terminal table.
_LAST_BUDGET_CHECK = "ledgerMatchesRealSpend"

_THROTTLE_ROWS: tuple[Row, ...] = (
    ("job", _field("throttle", "jobId")),
    ("retry after ms", _field("throttle", "retryAfterMs", digits=0)),
    ("paused ms", _field("throttle", "pausedMs")),
    ("attempts", _field("throttle", "attempts", digits=0)),
    ("failures", _field("throttle", "failures", digits=0)),
    ("status", _field("throttle", "status")),
)


def _title(results: Sequence[Result]) -> str:
    if not results:
        return "Sluice lab (no modes run)"
    work = _at(results[0], "workload")
    overuse = (
        f" + {_num(_at(work, 'overuseJobs'), 0)} overuse" if _at(work, "overuseJobs") is not None else ""
    )
    return (
        f"Sluice lab: {_num(_at(work, 'loadJobs'), 0)} load + {_num(_at(work, 'raceJobs'), 0)} race"
        f"{overuse} jobs, {_num(_at(work, 'workerProcesses'), 0)} worker processes"
    )


def _caption(results: Sequence[Result]) -> str:
    work = _at(results[0], "workload") if results else None
    text = (
        "5th start: least time between starts n and n+4 (the rate limit allows "
        f"{_num(_at(work, 'rateLimitMax'), 0)} per {_num(_at(work, 'rateLimitDurationMs'), 0)} ms). "
        "Util. %: tokens admitted, or recorded in the budget ledger, over the budget."
    )
    overuse = _at(results[0], "overuseBudget") if results else None
    if overuse is not None:
        e, u, c = (_num(_at(overuse, key), 0) for key in ("estimate", "usage", "concurrency"))
        text += (
            f" Overuse: jobs estimating {e} tokens use {u}; spend is what their handlers reported, "
            f"bound = limit + {c} running at once x ({u} - {e}), ledger is what the budget says."
        )
    if any(_at(r, "mode") == "naive" for r in results):
        text += (
            " naive is the check-then-act baseline: it may overspend and counts estimates only,"
            " and its 'all checks' does not count that."
        )
    return text


def _workload_text(results: Sequence[Result]) -> str:
    """The fixed workload in one paragraph, so the report reads on its own."""
    if not results:
        return "No modes were run."
    first = results[0]

    def w(key: str) -> str:
        return _num(_at(first, "workload", key), 0)

    jobs = [j for j in _at(first, "jobs") or [] if isinstance(j, Mapping) and j.get("phase") == "load"]
    runs = [(p, len(list(run))) for p, run in itertools.groupby(j.get("priority") for j in jobs)]
    mix = ", then ".join(f"{n} at priority {p}" for p, n in runs)
    return (
        f"{w('workerProcesses')} worker processes (local concurrency {w('localConcurrency')} each) share a "
        f"global concurrency of {w('globalConcurrency')} and a rate limit of {w('rateLimitMax')} starts per "
        f"{w('rateLimitDurationMs')} ms. Load phase: {w('loadJobs')} jobs of {w('tokensPerJob')} tokens"
        f"{f' ({mix})' if mix else ''} against a "
        f"{_num(_at(first, 'loadBudget', 'initial'), 0)}-token budget. "
        f"Race phase: {w('raceJobs')} jobs of {w('tokensPerJob')} tokens at once against a "
        f"{_num(_at(first, 'raceBudget', 'initial'), 0)}-token budget." + _overuse_text(first)
    )


def _overuse_text(first: Result) -> str:
    overuse = _at(first, "overuseBudget")
    if overuse is None:
        return ""

    def o(key: str) -> str:
        return _num(_at(overuse, key), 0)

    return (
        f" Overuse phase, without the rate limit: {_num(_at(first, 'workload', 'overuseJobs'), 0)} jobs "
        f"estimating {o('estimate')} tokens whose calls use {o('usage')} against a {o('limit')}-token "
        f"budget; with at most {o('concurrency')} running at once, the spend may pass the limit by at most "
        f"{o('concurrency')} x ({o('usage')} - {o('estimate')}) tokens, and the ledger must show it all."
    )


def _jobs(result: Result) -> list[Mapping[str, Any]]:
    return [j for j in _at(result, "jobs") or [] if isinstance(j, Mapping)]
