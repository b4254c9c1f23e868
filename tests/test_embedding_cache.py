"""The memorize embedder layer: a user's distinct texts embedded once, never served across users, bounded, and
concurrent callers' texts embedded in one call."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.embeddings import CachedEmbedder, embedding_user
from services.ports import Embedder


class CountingEmbedder(Embedder):
    dim = 2
    name = "counting"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        await asyncio.sleep(0)  # yields, as a model call in a thread does, so other callers can queue
        return [[float(len(t)), 1.0] for t in texts]


async def test_a_users_text_is_embedded_once_and_never_served_to_another_user() -> None:
    inner = CountingEmbedder()
    cached = CachedEmbedder(inner)
    with embedding_user("alice"):
        first = await cached.embed(["hello", "world"])
        again = await cached.embed(["world", "hello"])
    with embedding_user("bob"):
        await cached.embed(["hello"])
    assert again == [first[1], first[0]]
    assert inner.calls == [["hello", "world"], ["hello"]]  # bob's "hello" is a miss of his own


async def test_outside_a_user_scope_nothing_is_cached() -> None:
    inner = CountingEmbedder()
    cached = CachedEmbedder(inner)
    await cached.embed(["x"])
    await cached.embed(["x"])
    assert inner.calls == [["x"], ["x"]]


async def test_the_cache_is_bounded_and_forgets_a_user() -> None:
    inner = CountingEmbedder()
    cached = CachedEmbedder(inner, max_entries=2)
    with embedding_user("alice"):
        await cached.embed(["a", "b", "c"])
        await cached.embed(["a"])  # evicted: least recently used
    assert inner.calls[-1] == ["a"]
    cached.forget_user("alice")
    with embedding_user("alice"):
        await cached.embed(["c"])
    assert inner.calls[-1] == ["c"]


async def test_concurrent_callers_share_model_calls() -> None:
    inner = CountingEmbedder()
    cached = CachedEmbedder(inner)

    async def one(user: str) -> list[list[float]]:
        with embedding_user(user):
            return await cached.embed([f"text of {user}", "shared words"])

    results = await asyncio.gather(*(one(f"u{n}") for n in range(6)))
    assert len(inner.calls) <= 2  # the first caller's call, then everyone who queued during it
    assert sorted(t for call in inner.calls for t in call) == sorted(
        {*(f"text of u{n}" for n in range(6)), "shared words"}
    )
    assert results[3] == [[float(len("text of u3")), 1.0], [float(len("shared words")), 1.0]]
