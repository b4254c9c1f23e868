"""Log context: the ids bound with ``structlog.contextvars`` so every log line of a unit of work carries them.

``log_context`` restores the whole previous context on exit, also removing keys bound inside the block (the
trace id of a query is only known once its first stage is emitted), so nothing leaks into the next message an
agent task handles.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog


@contextmanager
def log_context(**values: Any) -> Iterator[None]:
    """Bind ``values`` (``None`` values are skipped) for the block; restore the previous context afterwards."""
    before = structlog.contextvars.get_contextvars()
    structlog.contextvars.bind_contextvars(**{k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**before)


def bind(**values: Any) -> None:
    """Add ``values`` to the current context (inside a ``log_context`` block, which will remove them)."""
    structlog.contextvars.bind_contextvars(**{k: v for k, v in values.items() if v is not None})
