"""Log output of Sluice's processes (the CLI, its workers, the API's processes): one handler
for the standard logging records of the library (``sluice.*``, ``redis``, ...) and the
CLI's own structlog events.

The library only logs through ``logging``; the application decides where it
goes. Here that is stderr, either as readable lines (``console``, the
default) or one JSON object per line (``SLUICE_LOG_FORMAT=json``), which
carries the structured fields the engine attaches to each record (job id,
worker id, attempt, error...); a line written while a handler runs also
carries its job's id, name, attempt and correlation id, and one written
while the API serves a request carries the request's id.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from sluice.engine.context import add_job_fields
from sluice.settings import Settings

_HANDLER_NAME = "sluice-cli"


def _job_fields(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """The job whose handler is running (as ``JobLogFilter`` adds it to stdlib records)."""
    return add_job_fields(event)


def configure(settings: Settings) -> None:
    """Route every log record of this process to stderr in the chosen format (idempotent)."""
    json = settings.log_format == "json"
    timestamper = structlog.processors.TimeStamper(fmt="iso" if json else "%H:%M:%S.%f", utc=json)
    pre_chain: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _job_fields,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        timestamper,
    ]
    if json:
        pre_chain.append(structlog.stdlib.ExtraAdder())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(settings.logging_level)
    # Libraries that narrate their start at INFO (alembic lists its plugins and each migration;
    # the service logs what a migration changed itself).
    for chatty in ("alembic",):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, settings.logging_level))
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *pre_chain[:5],
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
