"""Structured logging for every TorchPass process: structlog, one event name per line in
``area.thing`` form, JSON when stderr is not a terminal and readable key=value when it is.
Call :func:`setup` once at process start; get loggers with :func:`get`."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def setup(level: str | None = None, *, json: bool | None = None, stream: Any = None) -> None:
    """Configure structlog and stdlib logging. ``json`` defaults to "stderr is not a tty";
    ``TORCHPASS_LOG_LEVEL`` and ``TORCHPASS_LOG_JSON`` (0/1) override both."""
    global _configured
    stream = stream or sys.stderr
    level = (os.environ.get("TORCHPASS_LOG_LEVEL") or level or "info").upper()
    env_json = os.environ.get("TORCHPASS_LOG_JSON")
    if env_json is not None:
        json = env_json not in ("0", "false", "no")
    if json is None:
        json = not stream.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get(**bind: Any) -> Any:
    """A bound structlog logger (``log.get(job=..., node=...)``); configures defaults lazily."""
    if not _configured:
        setup()
    return structlog.get_logger().bind(**bind)
