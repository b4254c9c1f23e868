"""The Dgraph graph store on a real Dgraph: schema, idempotent upserts under concurrency, user scoping, DQL variables.

The MemoryStore contract (tests/contract) covers the behaviour every store shares; these tests cover what is
particular to Dgraph.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from prometheus_client import REGISTRY

from services import ids
from services.adapters.remote import RemoteMemoryStore
from services.domain import ChangeSet, Edge, EdgeKind, Vertex, VertexKind

pytestmark = [pytest.mark.server]

WHEN = datetime(2024, 5, 1, tzinfo=UTC)


def obj(user: str, name: str) -> Vertex:
    return Vertex(id=ids.object_id(user, name), user_id=user, kind=VertexKind.OBJECT, name=name, t_created=WHEN)


def thesis(user: str, text: str) -> Vertex:
    return Vertex(id=ids.thesis_id(user, text), user_id=user, kind=VertexKind.THESIS, name=text, t_valid=WHEN)


def relation(user: str, source: Vertex, name: str, target: Vertex) -> Edge:
    eid = ids.edge_id(user, "relation", source.id, name, target.id)
    return Edge(id=eid, user_id=user, kind=EdgeKind.RELATION, source=source.id, target=target.id, relation=name)


def change_set(user: str, events: list[str], vertices: list[Vertex], edges: list[Edge]) -> ChangeSet:
    return ChangeSet(id=ids.change_set_id(user, events), user_id=user, event_ids=events, vertices=vertices, edges=edges)


OWNER = {"vertex.id": "vertex.user", "edge.id": "edge.user", "event.id": "event.user"}


async def nodes_with_id(store: RemoteMemoryStore, predicate: str, value: str, user: str | None = None) -> int:
    """How many Dgraph nodes carry this id (of this user): more than one would be a replay bug."""
    scope = "" if user is None else f" @filter(eq({OWNER[predicate]}, $u))"
    query = f"query q($v: string, $u: string) {{ q(func: eq({predicate}, $v)){scope} {{ count(uid) }} }}"
    variables = {"$v": value, "$u": user or ""}
    response = await store.graph.client.txn(read_only=True).query(query, variables=variables)
    return int(json.loads(response.json)["q"][0]["count"])


def neighbor_requests() -> float:
    return REGISTRY.get_sample_value("memstream_dgraph_request_seconds_count", {"op": "neighbors"}) or 0.0


async def test_schema_has_the_indexes_and_reverse_edges(remote_store: RemoteMemoryStore) -> None:
    query = "schema(pred: [vertex.id, vertex.user, vertex.name, vertex.t_valid, edge.source, kv.key]) {}"
    response = await remote_store.graph.client.txn(read_only=True).query(query)
    schema = {p["predicate"]: p for p in json.loads(response.json)["schema"]}
    assert schema["vertex.id"]["tokenizer"] == ["exact"] and schema["vertex.id"]["upsert"]
    assert schema["vertex.user"]["tokenizer"] == ["exact"]
    assert set(schema["vertex.name"]["tokenizer"]) == {"term", "fulltext"}
    assert schema["vertex.t_valid"]["type"] == "datetime" and schema["vertex.t_valid"]["tokenizer"] == ["hour"]
    assert schema["edge.source"]["type"] == "uid" and schema["edge.source"]["reverse"]
    assert schema["kv.key"]["tokenizer"] == ["hash"] and schema["kv.key"]["upsert"]


async def test_concurrent_replays_write_each_node_once(remote_store: RemoteMemoryStore, user: str) -> None:
    a, b, c = obj(user, "Anna"), obj(user, "Oslo"), thesis(user, "Anna lives in Oslo")
    edges = [relation(user, a, "lives in", b), relation(user, b, "home of", a)]
    cs = change_set(user, ["m1"], [a, b, c], edges)
    # five workers race on the same change set: the @upsert ids make all but one transaction conflict and retry
    results = await asyncio.gather(*(remote_store.apply(cs, []) for _ in range(5)))
    assert sum(r.vertices_added for r in results) == 3
    assert sum(r.edges_added for r in results) == 2
    for vertex in (a, b, c):
        assert await nodes_with_id(remote_store, "vertex.id", vertex.id) == 1
    for edge in edges:
        assert await nodes_with_id(remote_store, "edge.id", edge.id) == 1
    assert await nodes_with_id(remote_store, "event.id", "m1", user) == 1
    stats = await remote_store.stats(user)
    assert (stats.vertices["object"], stats.vertices["thesis"], stats.edges["relation"], stats.events) == (2, 1, 2, 1)


async def test_an_edge_may_arrive_before_its_vertex(remote_store: RemoteMemoryStore, user: str) -> None:
    anna, oslo = obj(user, "Anna"), obj(user, "Oslo")
    lives = relation(user, anna, "lives in", oslo)
    first = await remote_store.apply(change_set(user, ["m1"], [anna], [lives]), [])
    assert (first.vertices_added, first.edges_added) == (1, 1)
    # Oslo is not written yet: no triplet without both ends, and no vertex to count or read
    assert await remote_store.neighbors(user, [anna.id]) == []
    assert await remote_store.get_vertices(user, [oslo.id]) == {}
    assert (await remote_store.stats(user)).vertices["object"] == 1

    second = await remote_store.apply(change_set(user, ["m2"], [oslo], []), [])
    assert second.vertices_added == 1
    [triplet] = await remote_store.neighbors(user, [oslo.id])
    assert (triplet.start.id, triplet.end, triplet.edge.id) == (anna.id, oslo, lives.id)
    assert await nodes_with_id(remote_store, "vertex.id", oslo.id) == 1  # the bare node was filled, not doubled


@pytest.mark.parametrize(
    "text",
    [
        '") OR has(vertex.id) OR eq(vertex.user, "',
        "}) { leak(func: has(vertex.id)) { uid vertex.name } } #",
        "$u",
        "uid(a0)",
        '\\" \n <0x1> * * .',
    ],
)
async def test_user_text_is_data_never_dql(remote_store: RemoteMemoryStore, user: str, text: str) -> None:
    other = f"{user}-other"
    await remote_store.apply(change_set(other, ["m1"], [obj(other, "Secret")], []), [])
    hostile_user = f"{user}{text}"
    vertex = obj(hostile_user, text)
    await remote_store.apply(change_set(hostile_user, [text], [vertex], []), [])

    assert await remote_store.get_vertices(hostile_user, [vertex.id]) == {vertex.id: vertex}
    found = await remote_store.find_objects(hostile_user, [ids.normalize_name(text), "secret"])
    assert [v.id for v in found.values()] == [vertex.id]
    assert await remote_store.seen_events(hostile_user, [text, "m1"]) == {text}
    stats = await remote_store.stats(hostile_user)
    assert (stats.vertices["object"], stats.events) == (1, 1)
    assert await remote_store.get_vertices(text, [vertex.id]) == {}  # the text alone is not the user
    await remote_store.delete_user(hostile_user)
    assert (await remote_store.stats(other)).vertices["object"] == 1  # deleting one user touched no other


async def test_a_frontier_hop_is_one_round_trip(remote_store: RemoteMemoryStore, user: str) -> None:
    people = [obj(user, name) for name in ("Anna", "Ben", "Cleo", "Dan")]
    edges = [relation(user, people[i], "knows", people[i + 1]) for i in range(3)]
    await remote_store.apply(change_set(user, ["m1"], people, edges), [])

    before = neighbor_requests()
    triplets = await remote_store.neighbors(user, [p.id for p in people])
    assert neighbor_requests() == before + 1
    assert {t.edge.id for t in triplets} == {e.id for e in edges}
    # every vertex of the frontier came back with its edges in both directions: Ben has one in, one out
    assert sum(t.start.id == people[1].id or t.end.id == people[1].id for t in triplets) == 2


async def test_the_llm_cache_lives_in_dgraph(remote_store: RemoteMemoryStore, user: str) -> None:
    key = f"llm:{user}"
    assert await remote_store.get(key) is None
    await remote_store.put(key, '{"text": "first"}')
    await remote_store.put(key, '{"text": "second"}')
    assert await remote_store.get(key) == '{"text": "second"}'
    assert await nodes_with_id(remote_store, "kv.key", key) == 1
