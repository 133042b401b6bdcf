"""Structured logging for every TorchPass process: structlog, one event name per line in
``area.thing`` form, JSON when stderr is not a terminal and readable key=value when it is;
optionally also a file with the full log (JSON) while the console shows less (launchpad: warnings
on the console like torchrun, everything in its log file). Call :func:`setup` once at process
start; get loggers with :func:`get`."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

from torchpass_common.errors import ConfigError

_configured = False
_file: TextIO | None = None
# Set by launchpad for its workers: the file launchpad logs to in full. A worker's TorchPass library
# logs there too (info and above) and shows only warnings on the job's console, like launchpad.
ENV_FILE = "TORCHPASS_LOG_FILE"


class _Sinks:
    """The last processor when there is a log file: each event goes as JSON to the file when at
    or above ``file_level``, and rendered to the console when at or above ``console_level``."""

    def __init__(self, console: Any, console_level: int, renderer: Any, file: TextIO, file_level: int) -> None:
        self.console, self.console_level, self.renderer = console, console_level, renderer
        self.file, self.file_level = file, file_level
        self.json = structlog.processors.JSONRenderer()

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> Any:
        level = logging.getLevelName(str(event.get("level", "info")).upper())
        level = level if isinstance(level, int) else logging.INFO
        if level >= self.file_level:
            self.file.write(self.json(logger, method, dict(event)) + "\n")
            self.file.flush()
        if level >= self.console_level:
            print(self.renderer(logger, method, dict(event)), file=self.console, flush=True)
        raise structlog.DropEvent


def setup(level: str | None = None, *, json: bool | None = None, stream: Any = None,
          file: str | os.PathLike[str] | None = None) -> None:
    """Configure structlog and stdlib logging. ``json`` defaults to "stderr is not a tty";
    ``TORCHPASS_LOG_LEVEL`` and ``TORCHPASS_LOG_JSON`` (0/1) override both (for the console).
    With ``file``, every event at info or above (or below, when the console level is lower) is
    also appended to that file as JSON; the console (``stream``) shows ``level`` and above."""
    global _configured, _file
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
    if _file is not None:
        _file.close()
        _file = None
    console_level = logging.getLevelName(level)
    if not isinstance(console_level, int):
        raise ConfigError(f"log level {level!r} is not one of debug, info, warning, error, critical",
                          hint="check TORCHPASS_LOG_LEVEL")
    least = console_level
    if file is not None:
        _file = open(file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed on the next setup
        least = min(console_level, logging.INFO)
        renderer = _Sinks(stream, console_level, renderer, _file, least)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(least),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get(**bind: Any) -> Any:
    """A bound structlog logger (``log.get(job=..., node=...)``); configures defaults lazily."""
    if not _configured:
        setup()
    return structlog.get_logger().bind(**bind)
