"""Log configuration for CLI processes (the library itself never configures logging)."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure() -> None:
    name = os.environ.get("SLUICE_LOG_LEVEL", "info").upper()
    level = logging.getLevelNamesMapping().get(name, logging.INFO)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S.%f", utc=False),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
    )
