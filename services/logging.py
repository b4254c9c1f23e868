"""structlog configuration: JSON lines in production, readable console output on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def _stderr_logger(*_args: object) -> structlog.WriteLogger:
    # Look sys.stderr up at each use: test runners and CLIs swap it, and a captured stream may be closed later.
    # WriteLogger writes a line in one call (PrintLogger's print() writes the newline apart, so another thread's
    # line could land in between).
    return structlog.WriteLogger(sys.stderr)


class _StderrHandler(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is at each record (see ``_stderr_logger``)."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def configure_logging(level: str = "INFO", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
        renderer,
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping().get(level.upper(), 20)),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    # Libraries' stdlib records (Faust, aiokafka, uvicorn) go through the same renderer, with the bound context,
    # so a process writes one format: JSON lines, or the console format on a terminal.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.ExtraAdder(),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    if not root.handlers:  # a test runner's or an embedding application's own handlers stay in charge
        root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings become log records too, not bare lines on stderr


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
