"""Log output of CLI processes: one handler for the standard logging records of the library
(``sluice.*``, ``redis``, ...) and the CLI's own structlog events.

The library only logs through ``logging``; the application decides where it
goes. Here that is stderr, either as readable lines (``console``, the
default) or one JSON object per line (``SLUICE_LOG_FORMAT=json``), which
carries the structured fields the engine attaches to each record (job id,
worker id, attempt, error...).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from sluice.settings import Settings

_HANDLER_NAME = "sluice-cli"


def configure(settings: Settings) -> None:
    """Route every log record of this process to stderr in the chosen format (idempotent)."""
    json = settings.log_format == "json"
    timestamper = structlog.processors.TimeStamper(fmt="iso" if json else "%H:%M:%S.%f", utc=json)
    pre_chain: list[Any] = [
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
            *pre_chain[:3],
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
