"""Whose text the model is being shown: set around each memorize batch and each question, read by the cache.

The cache keys its entries by the user as well as the prompt (no answer built from one user's memory is ever
served to another) and records the events an extraction was built from, so forgetting a message removes the
cached extraction of it too. A context variable carries the scope, so the tasks and layers in between need not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
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
_AHEAD: ContextVar[bool] = ContextVar("memstream_llm_ahead", default=False)


@contextmanager
def _flagged(flag: ContextVar[bool]) -> Iterator[None]:
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def background_calls() -> AbstractContextManager[None]:
    """Calls made inside are background work (memorize): they never take the model's last free slot, which is kept
    for someone waiting on an answer (``LimitedLLM``)."""
    return _flagged(_BACKGROUND)


def is_background() -> bool:
    return _BACKGROUND.get()


def sent_ahead() -> AbstractContextManager[None]:
    """Calls made inside were sent before their result is needed (memorize sends every group's extraction at
    once): a waiting background call whose result is needed now goes first (``LimitedLLM``)."""
    return _flagged(_AHEAD)


def is_ahead() -> bool:
    return _AHEAD.get()


class Hold:
    """A concurrency slot kept across the calls of one block (``held_slot``): taken at the first call, given back
    when the block ends (``LimitedLLM``)."""

    def __init__(self) -> None:
        self.owner: object | None = None  # the layer whose slot is held
        self.release: Callable[[], None] | None = None


_HOLD: ContextVar[Hold | None] = ContextVar("memstream_llm_hold", default=None)


@contextmanager
def held_slot() -> Iterator[Hold]:
    """Calls made inside, one after another, share one concurrency slot: a call and the calls that continue it (an
    extraction stopped at a repeat, then asked for the rest with the same prompt) run back to back in the engine
    slot that holds their prompt, instead of giving it to a waiting call and reading the prompt again elsewhere."""
    hold = Hold()
    token = _HOLD.set(hold)
    try:
        yield hold
    finally:
        _HOLD.reset(token)
        if hold.release is not None:
            hold.release()


def current_hold() -> Hold | None:
    return _HOLD.get()
