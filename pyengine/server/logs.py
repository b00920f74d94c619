"""Structured logs with structlog: console lines for people, JSON lines for machines.

Everything (structlog's loggers and the engine's stdlib loggers) goes through the stdlib
``logging`` tree into a ``QueueHandler``; one ``QueueListener`` thread formats and writes.
So a slow terminal or pipe never blocks the event loop or an engine thread.
"""

from __future__ import annotations

import logging
import queue
import sys
from logging.handlers import QueueHandler, QueueListener
from typing import Any

import structlog

from pyengine.server.args import LogFormat

LOGGER_NAME = "pyengine.server"


class _RecordQueueHandler(QueueHandler):
    """Enqueues the record as it is: the listener's ProcessorFormatter needs structlog's
    event dict, which the default ``prepare`` would flatten to a string."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


def get_logger(**context: Any) -> Any:
    """The server's structlog logger, bound to ``context``."""
    return structlog.get_logger(LOGGER_NAME).bind(**context)


def configure_logging(log_format: LogFormat = "console", level: str = "info") -> QueueListener:
    """Sets up structlog and the root logger for this process; returns the started
    listener (stop it on exit to flush). Call once, from the CLI."""
    shared: list[Any] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    final: list[Any] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if log_format == "json":
        final += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        final.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    formatter = structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=final)
    sink = logging.StreamHandler(sys.stderr)
    sink.setFormatter(formatter)
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = QueueListener(records, sink, respect_handler_level=False)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_RecordQueueHandler(records))
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    listener.start()
    return listener
