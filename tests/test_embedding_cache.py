"""The memorize embedder layer: a user's distinct texts embedded once, never served across users, bounded, and
concurrent callers' texts embedded in one call."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from schemas.events import ChatMessage, Forget, ForgetScope
from services.embeddings import CachedEmbedder, embedding_user
from services.ports import Embedder
from services.settings import Settings


class CountingEmbedder(Embedder):
    dim = 2
    name = "counting"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        await asyncio.sleep(0)  # yields, as a model call in a thread does, so other callers can queue
        return [[float(len(t)), 1.0] for t in texts]


class Recording(Embedder):
    """A real embedder, its calls recorded."""

    def __init__(self, inner: Embedder) -> None:
        self.inner, self.dim, self.name = inner, inner.dim, inner.name
        self.calls: list[list[str]] = []

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        return await self.inner.embed(texts)


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


async def test_a_forget_drops_the_users_cached_vectors_and_no_one_elses(tmp_path: Path) -> None:
    from services.container import build_services

    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, data_dir=tmp_path, llm="scripted", scripted_llm="services.llm.scripted:rule_based_llm"
    )
    services = await build_services(settings)
    inner = Recording(services.memorize.embedder.inner)
    services.memorize.embedder.inner = inner  # count what reaches the model; the cache under test is the real one
    try:
        when = datetime(2023, 5, 1, tzinfo=UTC)
        messages = [
            ChatMessage(
                event_id=f"{user}-1",
                user_id=user,
                conversation_id="c",
                speaker=user.title(),
                text="I moved to Bergen last week.",
                event_time=when,
                ingest_time=when,
            )
            for user in ("ada", "bob")
        ]
        await services.memorize.memorize(messages)
        calls = len(inner.calls)
        with embedding_user("ada"):
            await services.memorize.embedder.embed(["Ada: I moved to Bergen last week."])
        with embedding_user("bob"):
            await services.memorize.embedder.embed(["Bob: I moved to Bergen last week."])
        assert len(inner.calls) == calls  # both episodes' texts were cached by memorize: no model call
        forget = Forget(event_id="f1", user_id="ada", scope=ForgetScope.USER, target=None, event_time=when)
        await services.forget.forget(forget, "memstream.chat")
        calls = len(inner.calls)
        with embedding_user("bob"):
            await services.memorize.embedder.embed(["Bob: I moved to Bergen last week."])
        assert len(inner.calls) == calls  # bob's entry stays
        with embedding_user("ada"):
            await services.memorize.embedder.embed(["Ada: I moved to Bergen last week."])
        assert inner.calls[-1] == ["Ada: I moved to Bergen last week."]  # ada's is gone: embedded again
    finally:
        await services.close()
