"""The embedder layer memorize reads through: every distinct text of a user embedded once, and the texts that
concurrent callers ask for at the same time embedded in one model call.

- Cache: a bounded LRU keyed by the user *and* the text's SHA-256 (a user's cache entry is never served to another
  user; ``forget_user`` drops a user's entries). Texts are embedded on behalf of the user named by
  ``embedding_user``; outside such a scope nothing is cached, so no text is shared by accident.
- Coalescing: while one model call runs, the misses of other callers queue; the next call takes all of them. With
  memorize working on several users at once this makes one call per micro-batch instead of one per fact group.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

from services import metrics
from services.ports import Embedder

_USER: ContextVar[str | None] = ContextVar("memstream_embedding_user", default=None)


@contextmanager
def embedding_user(user_id: str) -> Iterator[None]:
    """Texts embedded inside are ``user_id``'s: cached under that user alone."""
    token = _USER.set(user_id)
    try:
        yield
    finally:
        _USER.reset(token)


class CachedEmbedder(Embedder):
    """Wraps an embedder with a per-user content-hash LRU and coalesces concurrent calls into one."""

    def __init__(self, inner: Embedder, max_entries: int = 50_000) -> None:
        self.inner = inner
        self.dim = inner.dim
        self.name = inner.name
        self.max_entries = max(0, max_entries)
        self._cache: OrderedDict[tuple[str, str], list[float]] = OrderedDict()
        self._queue: list[tuple[list[str], asyncio.Future[list[list[float]]]]] = []
        self._running: asyncio.Task[None] | None = None

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        user = _USER.get()
        if user is None or not self.max_entries:
            return await self._coalesced(list(texts))
        keys = [(user, hashlib.sha256(t.encode()).hexdigest()) for t in texts]
        found: dict[tuple[str, str], list[float]] = {}
        for key in keys:
            if key in self._cache:
                self._cache.move_to_end(key)
                found[key] = self._cache[key]
        missing = {k: t for k, t in zip(keys, texts, strict=True) if k not in found}
        metrics.EMBEDDING_CACHE.labels(result="hit").inc(len(keys) - sum(1 for k in keys if k in missing))
        metrics.EMBEDDING_CACHE.labels(result="miss").inc(len(missing))
        if missing:
            fresh = await self._coalesced(list(missing.values()))
            for key, vector in zip(missing, fresh, strict=True):
                found[key] = vector
                self._cache[key] = vector
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return [found[k] for k in keys]

    def forget_user(self, user_id: str) -> None:
        """Drops ``user_id``'s entries (the user, or a text of theirs, was forgotten)."""
        for key in [k for k in self._cache if k[0] == user_id]:
            del self._cache[key]

    async def _coalesced(self, texts: list[str]) -> list[list[float]]:
        future: asyncio.Future[list[list[float]]] = asyncio.get_running_loop().create_future()
        self._queue.append((texts, future))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drain(), name="embedder-batch")
        return await future

    async def _drain(self) -> None:
        """One model call for everything queued, again while callers queued more during it."""
        while self._queue:
            taken, self._queue = self._queue, []
            distinct = list(dict.fromkeys(t for texts, _ in taken for t in texts))
            metrics.EMBEDDING_BATCH_TEXTS.observe(len(distinct))
            try:
                vectors = dict(zip(distinct, await self.inner.embed(distinct), strict=True))
            except Exception as exc:  # every caller of this call hears of it
                for _, future in taken:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for texts, future in taken:
                if not future.done():
                    future.set_result([vectors[t] for t in texts])
