"""How much each extra installs: a fresh virtual environment per extra, measured on disk.

    .venv/bin/python benchmarks/install_sizes.py [--json benchmarks/results/install-sizes.json]

Builds the wheels of the checkout (sluice-queue, and sluice-lab from lab/),
installs each extra (and the lab, with the sluice-queue wheel it needs) with
its dependencies from the package index into a new venv, and reports the
size of what was added to site-packages beyond an empty venv (pip itself),
and the packages.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
EXTRAS = ["", "embedded", "testing", "service", "llm", "all"]
#: The lab's row: the sluice-lab wheel, beside the sluice-queue wheel it depends on.
LAB = "sluice-lab"


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


def measure(wheel: Path, extra: str, work: Path, baseline: int) -> dict[str, object]:
    env = work / f"venv-{extra or 'base'}"
    venv.create(env, with_pip=True)
    py = str(env / "bin" / "python")
    if extra == LAB:
        targets = [str(next(work.glob("sluice_lab-*.whl"))), str(wheel)]
    else:
        targets = [f"{wheel}[{extra}]" if extra else str(wheel)]
    t0 = time.monotonic()
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *targets], check=True)
    seconds = time.monotonic() - t0
    listed = subprocess.run(
        [py, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    )
    packages = sorted(d["name"] for d in json.loads(listed.stdout) if d["name"] not in ("pip", "setuptools"))
    return {
        "extra": extra or "(base)",
        "mib": round((tree_bytes(site_packages(env)) - baseline) / 2**20, 1),
        "packages": packages,
        "install_s": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-sizes-") as tmp:
        work = Path(tmp)
        for source in (REPO, REPO / "lab"):
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work), str(source)],
                check=True,
            )
        wheel = next(work.glob("sluice_queue-*.whl"))
        empty = work / "venv-empty"
        venv.create(empty, with_pip=True)
        baseline = tree_bytes(site_packages(empty))
        rows = [measure(wheel, extra, work, baseline) for extra in (*EXTRAS, LAB)]
    table = Table(title="What `pip install sluice-queue\\[extra]` adds to a fresh venv")
    for col in ("extra", "MiB", "packages", "install s"):
        table.add_column(col, justify="right" if col in ("MiB", "packages", "install s") else "left")
    for row in rows:
        table.add_row(str(row["extra"]), f"{row['mib']}", str(len(row["packages"])), f"{row['install_s']}")  # type: ignore[arg-type]
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
