"""``sluice bench``: benchmarks that print a table and write JSON."""

from __future__ import annotations

import typer

bench_app = typer.Typer(help="Benchmarks: figures on the terminal, details in JSON.", no_args_is_help=True)
