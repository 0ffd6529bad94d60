"""structlog setup: JSON lines when not on a terminal, readable colours on one. Bind service/worker/step once.

With CMEMI_LOG_DIR set (`cmemi up` sets it to RUN_DIR/logs for every process it starts), each process
writes its log, and anything else it prints to stderr (a traceback), to LOG_DIR/ROLE[-ID].log instead: the
terminal keeps the progress line and what the user must act on; `cmemi logs RUN_DIR` reads the files.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import structlog

LOG_DIR_ENV = "CMEMI_LOG_DIR"
# CMEMI_LOG_LEVEL's names (logging.getLevelNamesMapping() is Python 3.11's, and the package runs on 3.10)
_LEVELS = {name: getattr(logging, name) for name in ("CRITICAL", "FATAL", "ERROR", "WARNING", "WARN", "INFO", "DEBUG",
                                                     "NOTSET")}


def log_file_name(service: str, ident: Any = None) -> str:
    return f"{service}-{ident}.log" if ident else f"{service}.log"


def _stderr_to_log_file(service: str, ident: Any) -> None:
    """Point this process's stderr (fd 2: structlog, warnings, tracebacks) at its file in CMEMI_LOG_DIR, appended
    to across restarts. Unset or '-': stderr stays where it is."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir or log_dir == "-":
        return
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(log_dir) / log_file_name(service, ident), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)


def debug_enabled(log: Any) -> bool:
    """Does `log` write debug lines (CMEMI_LOG_LEVEL=DEBUG)? Asked once by a hot loop that logs its timings at debug
    level: the call and its arguments (`time.time()`s, a header's fields) cost ~2 us even when the line is dropped,
    every step (issue 45's small-step floor). A logger that cannot say (a test's fake) is taken to write them."""
    enabled = getattr(log, "is_enabled_for", None)
    return bool(enabled(logging.DEBUG)) if enabled is not None else True


def setup_logging(service: str, **bind: Any) -> structlog.stdlib.BoundLogger:
    _stderr_to_log_file(service, bind.get("worker_id", bind.get("shard")))
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
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **bind)
    log: structlog.stdlib.BoundLogger = structlog.get_logger()
    return log
