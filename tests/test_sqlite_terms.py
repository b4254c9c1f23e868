"""A big user's lexical search from its in-memory index: FTS5's BM25 ranking where FTS5's statistics are the user's
own (one user in the file), the user's own statistics where others share the file, new and forgotten texts
followed."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from services import ids
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Erasure, Vertex, VertexKind
from services.ports import VectorHit, VectorItem

DIM = 8
USER = "alice"
OTHER = "bob"
VOCABULARY = (
    "caroline melanie hiking painting running runs ran support group sunrise lake camping museum pottery children "
    "dog adoption counseling transgender conference mentor school library guitar violin festival snake_case Zürich "
    "café birthday 2023 may july garden beach"
)
WORDS = VOCABULARY.split()
QUERIES = (
    "When did Caroline go to the support group?",
    "running runs RUN",  # three words, one stem: three phrases, as FTS5 counts them
    "Zurich cafe",  # diacritics removed on both sides
    "pottery museum with the children",
    "nothing matches here",
    "melanie",
    "snake_case",  # one word, two tokens: a phrase
)


def texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(WORDS))]  # a few words in most texts, most in few
    return [" ".join(rng.choices(WORDS, weights, k=rng.randint(2, 14))) for _ in range(n)]


async def add(
    store: SqliteMemoryStore, user: str, written: list[str], kind: str = "thesis", start: int = 0
) -> list[str]:
    vertices = [
        Vertex(id=f"{user}-{kind}-{i}", user_id=user, kind=VertexKind(kind), name=text)
        for i, text in enumerate(written, start=start)
    ]
    unit = [1.0] + [0.0] * (DIM - 1)
    items = [VectorItem(id=v.id, kind=kind, text=v.name, vector=unit) for v in vertices]
    event = f"{user}-{kind}-{start}"
    await store.apply(
        ChangeSet(id=ids.change_set_id(user, [event]), user_id=user, event_ids=[event], vertices=vertices), items
    )
    return [v.id for v in vertices]


async def lexical(store: SqliteMemoryStore, user: str, kinds: list[str], query: str, k: int) -> list[VectorHit]:
    return await store.search(user, kinds, None, query, k=k)


def same(memory: list[VectorHit], fts: list[VectorHit]) -> None:
    assert [h.id for h in memory] == [h.id for h in fts]
    assert np.allclose([h.score for h in memory], [h.score for h in fts], rtol=1e-9, atol=1e-12)


async def test_one_users_ranking_is_fts5s(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite3"
    async with (
        SqliteMemoryStore(path, DIM, term_min_items=10) as memory,
        SqliteMemoryStore(path, DIM, term_min_items=None) as fts,
    ):
        await add(memory, USER, texts(1, 300))
        await add(memory, USER, texts(2, 80), kind="object")
        assert await lexical(memory, USER, [], "caroline", 5)  # loaded before the next write: followed, not reread
        await add(memory, USER, texts(3, 40), start=300)
        for query in QUERIES:
            for kinds in (["thesis"], ["object"], [], ["thesis", "object"]):
                for k in (1, 7, 60, 1000):
                    same(await lexical(memory, USER, kinds, query, k), await lexical(fts, USER, kinds, query, k))
        assert memory._terms is not None and memory._terms._users[USER].copy is not None  # the memory path ran


async def test_a_big_users_ranking_is_its_own(tmp_path: Path) -> None:
    """Another user's texts change FTS5's table-wide statistics, never the big user's in-memory ranking."""
    alone, shared = tmp_path / "alone.sqlite3", tmp_path / "shared.sqlite3"
    async with (
        SqliteMemoryStore(alone, DIM, term_min_items=10) as only,
        SqliteMemoryStore(shared, DIM, term_min_items=10) as both,
    ):
        mine = texts(4, 200)
        await add(only, USER, mine)
        await add(both, USER, mine)
        await add(both, OTHER, ["caroline caroline support"] * 300)  # skews the table's statistics
        for query in QUERIES:
            same(await lexical(both, USER, [], query, 20), await lexical(only, USER, [], query, 20))
        assert not {h.id for h in await lexical(both, OTHER, [], "melanie caroline", 50)} & set(
            f"{USER}-thesis-{i}" for i in range(200)
        )


async def test_forgotten_texts_leave_the_ranking(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite3"
    async with (
        SqliteMemoryStore(path, DIM, term_min_items=10) as memory,
        SqliteMemoryStore(path, DIM, term_min_items=None) as fts,
    ):
        written = await add(memory, USER, texts(5, 60))
        top = await lexical(memory, USER, [], "melanie", 3)
        assert top
        gone = top[0].id
        await memory.erase(
            Erasure(user_id=USER, forget_id="f1", outcome="{}", delete_vertices=[gone], delete_vectors=[gone])
        )
        after = await lexical(memory, USER, [], "melanie", 100)
        assert gone not in {h.id for h in after} and len(written) == 60
        same(after, await lexical(fts, USER, [], "melanie", 100))


@pytest.mark.parametrize("word", ["", "   ", "_", "?!"])
async def test_a_query_without_words_finds_nothing(tmp_path: Path, word: str) -> None:
    async with SqliteMemoryStore(tmp_path / "m.sqlite3", DIM, term_min_items=1) as memory:
        await add(memory, USER, texts(6, 5))
        assert await lexical(memory, USER, [], word, 5) == []
