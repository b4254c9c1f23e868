"""The embedded store's reads that must not grow with a user's memory: the query shapes (one index lookup per
listed id or name, never a scan of the user's rows) and the sign-bit dense search of a big user (the same hits as
vec0's exact scan where every vector is a candidate; new and forgotten texts followed)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services import ids
from services.adapters.sqlite import SqliteMemoryStore
from services.adapters.sqlite.signs import MIN_CANDIDATES, sign_bits
from services.domain import ChangeSet, Erasure, Vertex, VertexKind
from services.ports import VectorItem

DIM = 16
USER = "u1"
OTHER = "u2"


def seed_of(text: str) -> int:
    """A text's vector seed, the same in every process (``hash`` of a str is salted per process: the ranking
    test then met a near tie on some runs and not others)."""
    return zlib.crc32(text.encode()) % 10_000


def vec(seed: int) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(DIM)
    return (v / np.linalg.norm(v)).tolist()


async def add(store: SqliteMemoryStore, user: str, start: int, n: int, kind: str = "thesis") -> list[str]:
    vertices = [
        Vertex(id=f"{user}-{kind}-{i}", user_id=user, kind=VertexKind(kind), name=f"text {i}")
        for i in range(start, start + n)
    ]
    items = [VectorItem(id=v.id, kind=kind, text=v.name, vector=vec(seed_of(v.id))) for v in vertices]
    event = f"{user}-{kind}-{start}"
    await store.apply(
        ChangeSet(id=ids.change_set_id(user, [event]), user_id=user, event_ids=[event], vertices=vertices), items
    )
    return [v.id for v in vertices]


def test_sign_bits_are_the_signs() -> None:
    vectors = np.array([[1.0, -1.0] * 40, [-1.0] * 80], dtype=np.float32)
    bits = sign_bits(vectors)
    assert bits.shape == (2, 2)  # 80 dimensions: two 64-bit words
    assert int(bits[0, 0]) == int("01" * 32, 2)  # dimension i is bit i: even dimensions positive
    assert not bits[1].any()


async def test_big_user_search_matches_exact_scan(tmp_path: Path) -> None:
    """Under ``MIN_CANDIDATES`` texts every one is a candidate, so the sign path must give the exact hits."""
    path = tmp_path / "m.sqlite3"
    async with (
        SqliteMemoryStore(path, DIM, sign_min_items=10) as signs,
        SqliteMemoryStore(path, DIM, sign_min_items=None) as exact,
    ):
        await add(signs, USER, 0, 60)
        await add(signs, USER, 0, 20, kind="object")
        await add(signs, OTHER, 0, 40)
        for seed in range(5):
            for kinds in (["thesis"], ["object"], []):
                want = await exact.search(USER, kinds, vec(1000 + seed), None, k=15)
                got = await signs.search(USER, kinds, vec(1000 + seed), None, k=15)
                assert [h.id for h in got] == [h.id for h in want]
                assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-5)
                assert all(h.id.startswith(USER) for h in got)  # never another user's
        assert MIN_CANDIDATES > 60 + 20


async def test_big_user_ties_are_ordered_by_id_as_in_the_exact_scan(tmp_path: Path) -> None:
    """The re-ranking reads the ids of its nearest candidates only; candidates tied at the cut are all read, so
    ties still go by id (texts with one vector: every distance equal)."""
    path = tmp_path / "m.sqlite3"
    async with (
        SqliteMemoryStore(path, DIM, sign_min_items=10) as signs,
        SqliteMemoryStore(path, DIM, sign_min_items=None) as exact,
    ):
        same = vec(3)
        vertices = [Vertex(id=f"t-{i:02d}", user_id=USER, kind=VertexKind.THESIS, name=f"text {i}") for i in range(40)]
        # indexed in reverse id order, so the item numbers do not already give the id order
        items = [VectorItem(id=v.id, kind="thesis", text=v.name, vector=same) for v in reversed(vertices)]
        change = ChangeSet(id=ids.change_set_id(USER, ["e"]), user_id=USER, event_ids=["e"], vertices=vertices)
        await signs.apply(change, items)
        for k in (1, 7, 15):
            want = await exact.search(USER, ["thesis"], same, None, k=k)
            got = await signs.search(USER, ["thesis"], same, None, k=k)
            assert [h.id for h in got] == [h.id for h in want] == [f"t-{i:02d}" for i in range(k)]


async def test_sign_index_follows_writes_and_forgets(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite3"
    async with SqliteMemoryStore(path, DIM, sign_min_items=10) as store:
        first = await add(store, USER, 0, 30)
        target = vec(seed_of(first[3]))
        assert (await store.search(USER, ["thesis"], target, None, k=1))[0].id == first[3]
        later = await add(store, USER, 30, 5)  # indexed after the user's sign bits were loaded
        newest = vec(seed_of(later[2]))
        assert (await store.search(USER, ["thesis"], newest, None, k=1))[0].id == later[2]
        erasure = Erasure(
            user_id=USER, forget_id="f1", outcome="{}", delete_vertices=[first[3]], delete_vectors=[first[3]]
        )
        await store.erase(erasure)
        hits = await store.search(USER, ["thesis"], target, None, k=40)
        assert first[3] not in {h.id for h in hits} and len(hits) == 34


async def test_forgetting_one_users_text_reloads_only_that_users_sign_bits(tmp_path: Path) -> None:
    """A forget reloads the forgetting user's copy (its texts may be gone) and no other big user's (a reload is
    seconds for a user of 1M triplets); the other user's search still sees what it indexes afterwards."""
    path = tmp_path / "m.sqlite3"
    async with SqliteMemoryStore(path, DIM, sign_min_items=10) as store:
        mine = await add(store, USER, 0, 30)
        theirs = await add(store, OTHER, 0, 30)
        for user, ids_ in ((USER, mine), (OTHER, theirs)):
            await store.search(user, ["thesis"], vec(seed_of(ids_[0])), None, k=1)
        index = store._signs
        assert index is not None
        loaded = {user: index._users[user] for user in (USER, OTHER)}
        await store.erase(
            Erasure(
                user_id=OTHER, forget_id="f1", outcome="{}", delete_vertices=[theirs[0]], delete_vectors=[theirs[0]]
            )
        )
        later = await add(store, USER, 30, 3)  # may take an item number the forget freed
        for user, ids_ in ((USER, later), (OTHER, theirs[1:])):
            top = await store.search(user, ["thesis"], vec(seed_of(ids_[0])), None, k=1)
            assert top[0].id == ids_[0]
        assert index._users[USER] is loaded[USER]  # appended to, not read again
        assert index._users[OTHER] is not loaded[OTHER]
        hits = await store.search(OTHER, ["thesis"], vec(seed_of(theirs[0])), None, k=40)
        assert theirs[0] not in {h.id for h in hits} and len(hits) == 29


def test_rows_decode_to_the_validated_models() -> None:
    """A row read back is the vertex or edge written, field types included (enums are enums)."""
    from datetime import UTC, datetime

    from services.adapters.sqlite.codec import edge_row, row_edge, row_vertex, vertex_row
    from services.domain import Edge, EdgeKind, EpisodeLabel, TemporalLabel

    when = datetime(2023, 5, 1, 12, 30, tzinfo=UTC)
    vertices = [
        Vertex(id="v1", user_id=USER, kind=VertexKind.OBJECT, name="Mel"),
        Vertex(
            id="t1",
            user_id=USER,
            kind=VertexKind.THESIS,
            name="Mel ran a race",
            props={"holder": "Mel", "when_text": "May"},
            t_created=when,
            t_valid=when,
            t_expired=when,
            t_invalid=when,
            invalidated_by="t2",
            episode_label=EpisodeLabel.OPINION,
            temporal_label=TemporalLabel.DYNAMIC,
        ),
    ]
    for v in vertices:
        row = vertex_row(v)
        back = row_vertex(row)
        assert back == v == Vertex(**back.model_dump())
        assert back.model_dump(exclude_unset=True) == Vertex.model_validate(back.model_dump()).model_dump(
            exclude_unset=True
        )
        assert type(back.kind) is VertexKind
        assert back.episode_label is v.episode_label and back.temporal_label is v.temporal_label
    edge = Edge(id="e1", user_id=USER, kind=EdgeKind.RELATION, source="v1", target="v2", relation="ran", t_valid=when)
    back_edge = row_edge(edge_row(edge))
    assert back_edge == edge and type(back_edge.kind) is EdgeKind


async def test_the_copies_follow_new_texts_by_item_number(tmp_path: Path) -> None:
    """After another connection's commit a big user's copies read only the rows past the last one they hold: a
    range of the rowid, not the user's whole index (which held every search of a big user up behind a scan)."""
    path = tmp_path / "m.sqlite3"
    async with SqliteMemoryStore(path, DIM, readers=1, sign_min_items=10, term_min_items=10) as store:
        await add(store, USER, 0, 30)
        await store.search(USER, ["thesis"], vec(1), "text", k=3)
        seen: list[tuple[str, Any]] = []

        def trace(_cursor: Any, sql: str, bindings: Any) -> bool:
            seen.append((sql, bindings))
            return True

        await add(store, USER, 30, 3)
        for conn in store._connections:  # the writer's and the one reader's
            conn.exec_trace = trace
        hits = await store.search(USER, ["thesis"], vec(seed_of(f"{USER}-thesis-31")), "text 31", k=1)
        for conn in store._connections:
            conn.exec_trace = None
        assert hits[0].id == f"{USER}-thesis-31"
        appends = [(sql, b) for sql, b in seen if "item_no > ?" in sql]
        assert len(appends) == 2  # the sign bits and the terms
        for sql, bindings in appends:
            plan = " / ".join(str(row[3]) for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", bindings))
            assert "INTEGER PRIMARY KEY (rowid>?)" in plan, plan


async def test_a_text_on_a_freed_item_number_is_followed(tmp_path: Path) -> None:
    """Another user's last text is forgotten and a new text of the big user takes its item number, which is not
    past the last row the copies saw: they look past the user's own last row instead, and find it."""
    path = tmp_path / "m.sqlite3"
    async with SqliteMemoryStore(path, DIM, readers=1, sign_min_items=10, term_min_items=10) as store:
        await add(store, USER, 0, 30)
        await store.search(USER, ["thesis"], vec(1), "text", k=3)  # the copies are read
        theirs = await add(store, OTHER, 0, 3)
        await store.search(USER, ["thesis"], vec(1), "text", k=3)  # and have looked past the other user's rows
        last = theirs[-1]
        await store.erase(
            Erasure(user_id=OTHER, forget_id="f", outcome="{}", delete_vertices=[last], delete_vectors=[last])
        )
        (new,) = await add(store, USER, 30, 1)
        numbers = dict(store._conn().execute("SELECT id, item_no FROM items").fetchall())
        assert numbers[new] == max(numbers.values()) and numbers[new] <= 33  # the freed number, given again
        top = await store.search(USER, ["thesis"], vec(seed_of(new)), "text 30", k=1)
        assert top[0].id == new
        lexical = await store.search(USER, ["thesis"], None, "30", k=1)
        assert lexical[0].id == new
