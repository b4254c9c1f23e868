"""SqliteMemoryStore beyond the port contract: determinism, atomicity, sharing the file, KV cache, performance."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import apsw
import pytest

from services import ids
from services.adapters.sqlite import SqliteMemoryStore, codec, schema, write
from services.domain import ChangeSet, Edge, EdgeKind, Invalidation, Vertex, VertexKind
from services.ports import CacheScope, VectorItem

DIM = 8
T0 = datetime(2024, 1, 1, tzinfo=UTC)


def unit(seed: int, dim: int = DIM) -> list[float]:
    rng = random.Random(seed)
    v = [rng.gauss(0, 1) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


def change_set(
    user: str, event: str, n: int = 5, invalidate: list[str] | None = None
) -> tuple[ChangeSet, list[VectorItem]]:
    """``n`` objects in a chain, a thesis about the first, an episode; vectors for all of them."""
    at = T0 + timedelta(days=len(event))
    names = [f"{event} entity {i}" for i in range(n)]
    objects = [Vertex(id=ids.object_id(user, m), user_id=user, kind=VertexKind.OBJECT, name=m) for m in names]
    text = f"{names[0]} said something in {event}"
    thesis = Vertex(
        id=ids.thesis_id(user, text), user_id=user, kind=VertexKind.THESIS, name=text, t_valid=at, t_created=at
    )
    episode = Vertex(id=ids.episode_id(user, event), user_id=user, kind=VertexKind.EPISODIC, name=text, t_valid=at)
    edges = [
        Edge(id=ids.edge_id(user, "relation", a.id, "next", b.id), user_id=user, kind=EdgeKind.RELATION,
             source=a.id, target=b.id, relation="next", t_valid=at)
        for a, b in itertools.pairwise(objects)
    ]  # fmt: skip
    edges.append(
        Edge(id=ids.edge_id(user, "thesis", objects[0].id, "thesis", thesis.id), user_id=user, kind=EdgeKind.THESIS,
             source=objects[0].id, target=thesis.id, relation="thesis")
    )  # fmt: skip
    vertices = [*objects, thesis, episode]
    vectors = [VectorItem(id=v.id, kind=v.kind.value, text=v.name, vector=unit(int(v.id[2:10], 16))) for v in vertices]
    vectors += [
        VectorItem(id=e.id, kind="triplet", text=f"{e.source} next", vector=unit(i)) for i, e in enumerate(edges)
    ]
    invalidations = [
        Invalidation(thesis_id=t, invalidated_by=thesis.id, t_invalid=at, t_expired=at) for t in invalidate or []
    ]
    cs = ChangeSet(
        id=ids.change_set_id(user, [event]), user_id=user, event_ids=[event], vertices=vertices, edges=edges,
        invalidations=invalidations,
    )  # fmt: skip
    return cs, vectors


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteMemoryStore]:
    s = await SqliteMemoryStore.open(tmp_path / "m.sqlite3", dim=DIM)
    yield s
    await s.close()


async def wait_for(check: Callable[[], Any], within: float = 20.0) -> None:
    """Poll an async condition until it holds or the deadline passes."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.02)


# -- determinism and atomicity ------------------------------------------------------------------------------------


async def test_replay_leaves_every_table_byte_identical(store: SqliteMemoryStore) -> None:
    first = change_set("alice", "m1")
    second = change_set("alice", "m22", invalidate=[first[0].vertices[5].id])
    await store.apply(*first)
    await store.apply(*second)
    await store.put("h1", "cached")
    before = await store.dump()
    assert all(before[table] for table in ("vertices", "edges", "applied_events", "items", "vectors", "fts_terms"))

    for cs in (first, second, second, first):
        assert (await store.apply(*cs)).skipped_events == cs[0].event_ids
    # a replay with the events forgotten (e.g. re-extracted) still writes nothing new
    again = first[0].model_copy(update={"event_ids": ["m1-retry"], "id": "c_retry"})
    result = await store.apply(again, first[1])
    assert (result.vertices_added, result.edges_added, result.theses_invalidated) == (0, 0, 0)
    after = await store.dump()
    after["applied_events"] = [row for row in after["applied_events"] if row[1] != "m1-retry"]
    assert after == before


async def test_same_change_sets_give_the_same_file_content(tmp_path: Path) -> None:
    dumps = []
    for name in ("a", "b"):
        async with await SqliteMemoryStore.open(tmp_path / f"{name}.sqlite3", dim=DIM) as s:
            await s.apply(*change_set("u", "m1"))
            await s.apply(*change_set("u", "m2"))
            dumps.append(await s.dump())
    assert dumps[0] == dumps[1]


async def test_failed_apply_writes_nothing(store: SqliteMemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    def failing_blob(vector: list[float], dim: int) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("disk on fire")
        return codec.vector_blob(vector, dim)

    monkeypatch.setattr(write, "vector_blob", failing_blob)
    with pytest.raises(RuntimeError, match="disk on fire"):
        await store.apply(*change_set("alice", "m1"))
    assert all(not rows for rows in (await store.dump()).values())
    monkeypatch.undo()
    assert (await store.apply(*change_set("alice", "m1"))).vertices_added == 7


async def test_wrong_vector_size_is_refused(store: SqliteMemoryStore) -> None:
    cs, vectors = change_set("alice", "m1")
    vectors[0] = vectors[0].model_copy(update={"vector": [1.0] * (DIM + 1)})
    with pytest.raises(ValueError, match="dimensions"):
        await store.apply(cs, vectors)
    with pytest.raises(ValueError, match="dimensions"):
        await store.search("alice", [], [1.0] * 3)
    assert (await store.stats("alice")).events == 0


async def test_concurrent_applies_are_serialised(store: SqliteMemoryStore) -> None:
    sets = [change_set(f"u{i % 3}", f"m{i}") for i in range(12)]
    results = await asyncio.gather(*(store.apply(*cs) for cs in sets))
    assert all(r.vertices_added == 7 for r in results)
    assert [(await store.stats(f"u{i}")).events for i in range(3)] == [4, 4, 4]


# -- the file, shared ---------------------------------------------------------------------------------------------


async def test_reopen_keeps_everything_and_checks_dim(tmp_path: Path) -> None:
    path = tmp_path / "m.sqlite3"
    async with await SqliteMemoryStore.open(path, dim=DIM) as s:
        await s.apply(*change_set("alice", "m1"))
        await s.put("k", "v")
        before = await s.dump()
    async with await SqliteMemoryStore.open(path, dim=DIM) as s:
        assert await s.dump() == before
        assert await s.get("k") == "v"
    with pytest.raises(ValueError, match="dim"):
        SqliteMemoryStore(path, dim=DIM * 2)


_WRITER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from test_sqlite_store import change_set
from services.adapters.sqlite import SqliteMemoryStore

async def main():
    async with await SqliteMemoryStore.open({path!r}, dim={dim}) as s:
        for i in range(20):
            await s.apply(*change_set("writer", f"w{{i}}"))

asyncio.run(main())
"""


async def test_another_process_writes_while_we_read_and_write(tmp_path: Path, store: SqliteMemoryStore) -> None:
    script = textwrap.dedent(_WRITER).format(tests=str(Path(__file__).parent), path=str(store.path), dim=DIM)
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    for i in range(20):  # our writes contend for the same write lock
        await store.apply(*change_set("local", f"l{i}"))
        await store.stats("writer")  # and reads never wait for the other process

    async def writer_done() -> bool:
        return (await store.stats("writer")).events == 20

    await wait_for(writer_done)
    assert await child.wait() == 0
    assert (await store.stats("local")).events == 20
    assert (await store.stats("writer")).vertices["object"] == 100


# -- KV cache and codecs -------------------------------------------------------------------------------------------


async def test_kv_cache(store: SqliteMemoryStore) -> None:
    assert await store.get("missing") is None
    await store.put("h", "one")
    await store.put("h", "two")
    assert await store.get("h") == "two"
    assert (await store.dump())["kv"] == [("h", "two")]
    assert "kv" not in await store.dump("alice")


async def test_cache_writes_leave_the_memory_file_alone(tmp_path: Path) -> None:
    """The cache has its own file: a question's cache write does not change the memory file, so readers of the
    memory keep their page cache and memory map (``schema.cache_path``)."""
    path = tmp_path / "memory.sqlite3"
    async with await SqliteMemoryStore.open(path, DIM) as s:
        await s.apply(*change_set("alice", "m1"))
        watcher = schema.connect(path)
        before = watcher.execute("PRAGMA main.data_version").fetchone()
        await s.put("question-key", "an answer about Quuxenberg", CacheScope(user_id="alice"))
        assert watcher.execute("PRAGMA main.data_version").fetchone() == before
        assert watcher.execute("SELECT value FROM cache.kv").fetchall() == [("an answer about Quuxenberg",)]
        await s.apply(*change_set("alice", "m2"))  # a memory write is still seen
        assert watcher.execute("PRAGMA main.data_version").fetchone() != before
        watcher.close()
    assert b"Quuxenberg" not in path.read_bytes()
    assert b"Quuxenberg" in schema.cache_path(path).read_bytes()


async def test_a_file_with_the_cache_inside_moves_it_out(tmp_path: Path) -> None:
    """A memory file from before the cache had its own keeps its entries and their sources (so a forget still
    reaches them), moved to the cache file; its own cache tables are gone."""
    path = tmp_path / "memory.sqlite3"
    async with await SqliteMemoryStore.open(path, DIM) as s:
        await s.apply(*change_set("alice", "m1"))
    old = apsw.Connection(str(path))  # the layout before: kv and kv_sources in the memory file
    old.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    old.execute("CREATE TABLE kv_sources (key TEXT NOT NULL, user_id TEXT NOT NULL, event_id TEXT NOT NULL, "
                "PRIMARY KEY (key, user_id, event_id))")  # fmt: skip
    old.execute("INSERT INTO kv VALUES ('k1', 'old answer'), ('k2', 'other answer')")
    old.execute("INSERT INTO kv_sources VALUES ('k1', 'alice', 'm1'), ('k2', 'bob', '')")
    old.close()
    async with await SqliteMemoryStore.open(path, DIM) as s:
        assert await s.get("k1") == "old answer"
        assert (await s.dump("alice"))["kv_sources"] == [("k1", "alice", "m1")]
        assert await s.forget("alice", ["m1"]) == 1
        assert await s.get("k1") is None and await s.get("k2") == "other answer"
    plain = apsw.Connection(str(path))
    assert plain.execute("SELECT name FROM sqlite_master WHERE name LIKE 'kv%'").fetchall() == []
    plain.close()


def test_fts_query_quotes_every_token() -> None:
    assert (
        codec.fts_query('Where is "Alice" AND NEAR(bob)?') == '"where" OR "is" OR "alice" OR "and" OR "near" OR "bob"'
    )
    assert codec.fts_query("  ?! ") is None
    long_query = codec.fts_query(" ".join(f"w{i}" for i in range(500)))
    assert long_query is not None and long_query.count(" OR ") == codec.MAX_QUERY_TOKENS - 1


def test_fts_match_scopes_user_and_kinds() -> None:
    match = codec.fts_match("team-a", ["thesis", 'odd"kind'], "hello")
    assert match == (
        f'user_key : "{codec.user_key("team-a")}" AND kind : ("thesis" OR "odd""kind") AND text : ("hello")'
    )
    assert codec.user_key("team-a") != codec.user_key("team.a")  # the tokenizer would split both into "team a"


async def test_lexical_isolation_between_similar_user_ids(store: SqliteMemoryStore) -> None:
    for user in ("team-a", "team.a", "team a"):
        await store.apply(*change_set(user, "m1"))
    for user in ("team-a", "team.a", "team a"):
        hits = await store.search(user, [], None, "m1 entity said something", k=50)
        own = {row[3] for row in (await store.dump(user))["items"]}
        assert len(hits) == 7 and {h.id for h in hits} <= own  # 5 objects, the thesis, the episode


def test_datetimes_are_fixed_width_utc_text() -> None:
    plus2 = timezone(timedelta(hours=2))
    assert codec.dt_to_text(datetime(2024, 1, 1, 2, 0, tzinfo=plus2)) == "2024-01-01T00:00:00.000000+00:00"
    assert codec.dt_to_text(datetime(2024, 1, 1)) == "2024-01-01T00:00:00.000000+00:00"  # naive: taken as UTC
    assert codec.text_to_dt("2024-01-01T00:00:00.000000+00:00") == datetime(2024, 1, 1, tzinfo=UTC)


async def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    s = SqliteMemoryStore(tmp_path / "m.sqlite3", dim=DIM)
    await s.close()
    await s.close()
    with pytest.raises(RuntimeError, match="closed"):
        await s.stats("alice")


def test_graph_reads_look_up_by_index_not_by_walking_the_users_rows(tmp_path: Path) -> None:
    """The plans of ``neighbors``, ``find_objects`` and ``get_vectors``: a list of ids or names drives index
    lookups. Without the CROSS JOIN / INDEXED BY the planner read every edge or object of the user (880 ms for 60
    ids at 100k triplets, benchmarks/qa_scale.py); the plan says which, whatever the data size."""
    from services.adapters.sqlite import read, search

    async def plans() -> list[str]:
        async with SqliteMemoryStore(tmp_path / "m.sqlite3", dim=4) as store:
            conn = store._conn()
            seen: list[tuple[str, Any]] = []

            def trace(_cursor: Any, sql: str, bindings: Any) -> bool:
                seen.append((sql, bindings))
                return True

            conn.exec_trace = trace
            read.neighbors(conn, "u", ["a", "b"], [EdgeKind.RELATION], 5)
            read.find_objects(conn, "u", ["ana", "ben"])
            search.get_vectors(conn, "u", ["a", "b"])
            conn.exec_trace = None
            return [
                " / ".join(str(row[3]) for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", bindings))
                for sql, bindings in seen
            ]

    neighbors_plan, objects_plan, vectors_plan = asyncio.run(plans())
    assert "edges_by_source (user_id=? AND source=?)" in neighbors_plan
    assert "edges_by_target (user_id=? AND target=?)" in neighbors_plan
    assert "vertices_by_name (user_id=? AND kind=? AND norm_name=?)" in objects_plan
    # each id's vector is a point read in the copy, not a load of its vec0 chunk of 256
    assert "(user_id=? AND id=?)" in vectors_plan and "SEARCH iv USING INTEGER PRIMARY KEY" in vectors_plan
