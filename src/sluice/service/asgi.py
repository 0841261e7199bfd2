"""The ASGI entry point for process managers: ``uvicorn --factory sluice.service.asgi:app``.

Reads ``SLUICE_*`` from the environment (:class:`ServiceSettings`); ``sluice
serve`` sets them and runs this, one or more processes.
"""

from __future__ import annotations

from fastapi import FastAPI

from sluice import logs, tracing
from sluice.service.app import create_app
from sluice.service.config import ServiceSettings
from sluice.settings import Settings


def app() -> FastAPI:
    # Each API process logs as the CLI does (SLUICE_LOG_FORMAT=json: one JSON object a line);
    # a process uvicorn spawns starts with no handler of ours.
    settings = Settings.from_env()
    logs.configure(settings)
    tracing.configure(settings)  # SLUICE_TRACING / OTEL_*: each API process exports its own spans
    return create_app(ServiceSettings(), freeze=True)  # type: ignore[call-arg] # the URLs come from the environment
