"""structlog setup: JSON lines when not on a terminal, readable colours on one. Bind service/worker/step once."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog


def setup_logging(service: str, **bind: Any) -> structlog.stdlib.BoundLogger:
    level = os.environ.get("CMEMI_LOG_LEVEL", "INFO").upper()
    renderer: Any = (structlog.dev.ConsoleRenderer(colors=True) if sys.stderr.isatty()
                     else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping().get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **bind)
    return structlog.get_logger()
