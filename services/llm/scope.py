"""Whose text the model is being shown: set around each memorize batch and each question, read by the cache.

The cache keys its entries by the user as well as the prompt (no answer built from one user's memory is ever
served to another) and records the events an extraction was built from, so forgetting a message removes the
cached extraction of it too. A context variable carries the scope, so the tasks and layers in between need not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from services.ports import CacheScope

_SCOPE: ContextVar[CacheScope | None] = ContextVar("memstream_llm_scope", default=None)


@contextmanager
def llm_scope(user_id: str, event_ids: Iterable[str] = ()) -> Iterator[CacheScope]:
    """Calls made inside are on behalf of ``user_id``, built from ``event_ids`` (none: from the user's memory)."""
    scope = CacheScope(user_id=user_id, event_ids=tuple(sorted(set(event_ids))))
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def current_scope() -> CacheScope | None:
    return _SCOPE.get()


_BACKGROUND: ContextVar[bool] = ContextVar("memstream_llm_background", default=False)


@contextmanager
def background_calls() -> Iterator[None]:
    """Calls made inside are background work (memorize): they never take the model's last free slot, which is kept
    for someone waiting on an answer (``LimitedLLM``)."""
    token = _BACKGROUND.set(True)
    try:
        yield
    finally:
        _BACKGROUND.reset(token)


def is_background() -> bool:
    return _BACKGROUND.get()
