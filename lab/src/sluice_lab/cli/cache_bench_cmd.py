"""``sluice bench cache``: the semantic cache's savings, false hits and lookup latency.

Registered on ``bench_app`` when imported (``sluice_lab.cli`` imports it).
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Table

from sluice.cli.errors import CliFailure
from sluice.cli.runtime import run
from sluice_lab.cli.bench_cmd import JsonOpt, bench_app, console, save_json


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


@bench_app.command("cache")
def cache(
    sizes: Annotated[
        list[int] | None,
        typer.Option(
            "--entries", "-n", min=0, max=2_000_000, help="Cache sizes for the lookup latency (repeatable)."
        ),
    ] = None,
    lookups: Annotated[int, typer.Option(min=1, help="Lookups timed at each size.")] = 500,
    repeats: Annotated[
        int, typer.Option(min=0, max=20, help="Exact repeats of each prompt in the workload.")
    ] = 1,
    threshold: Annotated[
        float,
        typer.Option(
            min=0.01, max=1.0, help="Least cosine similarity of a hit (CACHE_SIMILARITY_THRESHOLD)."
        ),
    ] = 0.92,
    database: Annotated[
        str | None,
        typer.Option(
            help="PostgreSQL URL with pgvector whose llm_cache table is empty (default: a throw-away "
            "embedded server; never $SLUICE_DATABASE_URL: the benchmark rewrites the table)."
        ),
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """The semantic cache measured on the shipped labelled set of paraphrases and near misses.

    Prints, per threshold, the share of paraphrases served from the cache and
    of near misses that would be served a wrong answer, with and without the
    guards, and what each guard caught; then a workload of repeated and
    paraphrased prompts (calls, tokens and money saved; false hits); then
    lookup latency p50/p95/p99 with 10,000 and 100,000 entries (filler entries
    with random vectors, one tenant and scope: the index search is not
    narrowed), with the embedder's share apart and the index's recall.
    """
    from sluice.store.database import Database, redact_url
    from sluice_lab.bench_database import bench_database
    from sluice_lab.cache_bench import CacheBenchSpec, run_cache_bench

    try:
        spec = CacheBenchSpec(
            sizes=tuple(sizes) if sizes else (10_000, 100_000),
            lookups=lookups,
            repeats=repeats,
            threshold=threshold,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc

    async def go(url: str, origin: str) -> dict[str, Any]:
        db = Database(url, pool_size=2)
        try:
            await db.migrate()  # a server that is down was named by bench_database already
            await _refuse_a_used_cache(db, redact_url(url))
            with console.status("starting") as status:
                result = await run_cache_bench(db, spec, status.update)
        finally:
            await db.close()
        return {"meta": {"database": origin, "cpus": os.cpu_count()}, **result}

    with bench_database(database, durable=False, from_env=False) as bench_db:
        data = run(go(bench_db.url, bench_db.origin))
    for name, part in data["quality"].items():
        console.print(quality_table(name, part["rates"]))
    console.print(guards_table(data["quality"]["cache_pairs"]["guards"]))
    console.print(workload_table(data["workload"]))
    console.print(latency_table(data["latency"]))
    save_json(json_path, data)


async def _refuse_a_used_cache(db: Any, where: str) -> None:
    """The benchmark truncates llm_cache and rebuilds its index: on a database whose cache holds
    entries (a service's), that would throw away every tenant's answers."""
    pool = await db.raw_pool()
    async with pool.acquire() as conn:
        used = await conn.fetchval("SELECT EXISTS (SELECT 1 FROM llm_cache)")
    if used:
        raise CliFailure(
            f"the llm_cache table of {where} holds entries, and the benchmark would delete them: "
            "give --database a database of its own (or leave it out for a throw-away server)"
        )


def quality_table(name: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"Hits on {name}: paraphrases (want high) / near misses and related (want 0)")
    for column in ("threshold", "paraphrases", "+ guards", "near misses", "+ guards", "related", "+ guards"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"{r['threshold']:.2f}",
            _pct(r["paraphrase_hit"]),
            _pct(r["paraphrase_hit_guarded"]),
            _pct(r["near_miss_false_hit"]),
            _pct(r["near_miss_false_hit_guarded"]),
            _pct(r["related_false_hit"]),
            _pct(r["related_false_hit_guarded"]),
        )
    return table


def guards_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="What each guard vetoed (labelled set)")
    for column in ("guard", "near misses vetoed", "only this guard", "paraphrases wrongly vetoed"):
        table.add_column(column, justify="right" if column != "guard" else "left")
    for r in rows:
        table.add_row(
            r["guard"],
            str(r["near_misses_vetoed"]),
            str(r["only_guard"]),
            str(r["paraphrases_wrongly_vetoed"]),
        )
    return table


def workload_table(w: dict[str, Any]) -> Table:
    table = Table(
        title=f"Workload: {w['requests']:,} requests (each prompt {1 + w['repeats']}x, its pair once)"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("provider calls", f"{w['provider_calls']:,}")
    table.add_row("calls saved", f"{w['calls_saved']:,} ({_pct(w['calls_saved_share'])})")
    table.add_row("  exact repeats / paraphrases", f"{w['exact_hits']:,} / {w['paraphrase_hits']:,}")
    table.add_row("false hits", f"{w['false_hits']:,} ({_pct(w['false_hit_share_of_requests'])} of requests)")
    table.add_row("tokens saved", f"{w['tokens_saved']:,}")
    table.add_row("money saved", f"${w['money_saved_usd']:.4f} at {w['priced_at']} list prices")
    return table


def latency_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Lookup latency (exact path, embedding, HNSW search, guards)")
    for column in ("entries", "p50", "p95", "p99", "p99 w/o embedding", "recall@1", "index build"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"{r['entries']:,}",
            f"{r['lookup']['p50_ms']:.2f} ms",
            f"{r['lookup']['p95_ms']:.2f} ms",
            f"{r['lookup']['p99_ms']:.2f} ms",
            f"{r['lookup_without_embedding']['p99_ms']:.2f} ms",
            _pct(r["recall_at_1"]),
            f"{r['index_build_s']:.1f} s",
        )
    return table
