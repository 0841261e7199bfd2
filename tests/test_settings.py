"""Settings: the environment is read in one place, checked, and documented from one table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sluice import ConfigurationError, Queue, Worker
from sluice.settings import (
    DEFAULT_HOME,
    DEFAULT_LEASE,
    DEFAULT_PREFIX,
    ENV_LOG_FORMAT,
    ENV_LOG_LEVEL,
    ENVIRONMENT,
    Settings,
)
from tests.harness.proc_harness import REPO


def test_defaults_with_an_empty_environment() -> None:
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.redis_url, s.home, s.log_level, s.log_format, s.debug) == (
        None,
        Path(DEFAULT_HOME),
        "info",
        "console",
        False,
    )


def test_values_are_read_and_normalised() -> None:
    s = Settings.from_env(
        {
            "SLUICE_REDIS_URL": "redis://h:1/2",
            "SLUICE_HOME": "/srv/sluice",
            "SLUICE_LOG_LEVEL": " WARNING ",
            "SLUICE_LOG_FORMAT": "JSON",
            "SLUICE_DEBUG": "yes",
        }
    )
    assert (s.redis_url, s.home, s.log_level, s.log_format, s.debug) == (
        "redis://h:1/2",
        Path("/srv/sluice"),
        "warning",
        "json",
        True,
    )


@pytest.mark.parametrize(
    ("name", "value"), [(ENV_LOG_LEVEL, "loud"), (ENV_LOG_FORMAT, "xml"), ("SLUICE_DEBUG", "maybe")]
)
def test_a_bad_value_names_its_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigurationError, match=f"{name}={value!r}"):
        Settings.from_env({name: value})


async def test_the_library_defaults_are_the_settings_defaults(queue: Queue) -> None:
    w = Worker()
    assert (w.prefix, w.lease, Queue.__init__.__kwdefaults__["prefix"]) == (  # type: ignore[index]
        DEFAULT_PREFIX,
        DEFAULT_LEASE,
        DEFAULT_PREFIX,
    )


def test_only_the_entry_points_and_the_lab_read_the_environment() -> None:
    # The engine, the store, the LLM layer and the testing helpers take explicit arguments;
    # settings.py reads the environment for the CLI (and later the service); the lab's
    # driver hands its worker processes their settings through variables named in settings.py.
    allowed = {"settings.py", "cli", "lab", "service"}
    offenders = []
    for path in (REPO / "src" / "sluice").rglob("*.py"):
        rel = path.relative_to(REPO / "src" / "sluice")
        if rel.parts[0] in allowed:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                line = lines[node.lineno - 1]
                # PATH is how a program finds a binary (redis-server), not a setting of ours.
                if '"PATH"' not in line:
                    offenders.append(f"{rel}:{node.lineno}: {line.strip()}")
    assert offenders == []


def test_every_variable_is_documented() -> None:
    text = (REPO / "docs" / "using.md").read_text()
    for var in ENVIRONMENT:
        assert re.search(rf"`{var.name}`", text), f"{var.name} is missing from docs/using.md"
