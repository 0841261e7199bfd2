"""``sluice bench``: the lab's and the benchmarks' commands, one module each.

:data:`bench_app` is what sluice-lab's ``sluice.commands`` entry point names
(lab/pyproject.toml); importing this package registers every command on it.
"""

from sluice_lab.cli import (
    burst_cmd,
    cache_bench_cmd,
    goodput_cmd,
    lab_cmd,
    memory_cmd,
)
from sluice_lab.cli.bench_cmd import bench_app

__all__ = ["bench_app"]

# Importing a command module registers its command (`sluice bench lab`, `goodput`, ...).
_ = burst_cmd, cache_bench_cmd, goodput_cmd, lab_cmd, memory_cmd
