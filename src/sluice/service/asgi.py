"""The ASGI entry point for process managers: ``uvicorn --factory sluice.service.asgi:app``.

Reads ``SLUICE_*`` from the environment (:class:`ServiceSettings`); ``sluice
serve`` sets them and runs this, one or more processes.
"""

from __future__ import annotations

from fastapi import FastAPI

from sluice.service.app import create_app
from sluice.service.config import ServiceSettings


def app() -> FastAPI:
    return create_app(ServiceSettings())  # type: ignore[call-arg] # the URLs come from the environment
