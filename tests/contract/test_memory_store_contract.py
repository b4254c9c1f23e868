"""Store ports contract: every adapter must pass this suite (see ``conftest.memory_store``).

The scenario: a user says "Alice lives in Paris" (2023), later "Alice lives in Berlin" (2024), which invalidates
the first thesis. Vectors are hand-made unit vectors, so expected neighbours are known without an embedder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from services import ids
from services.domain import (
    ChangeSet,
    Edge,
    EdgeInvalidation,
    EdgeKind,
    Invalidation,
    PropsUpdate,
    Vertex,
    VertexKind,
)
from services.ports import AnnouncementLog, Stores, VectorItem

DIM = 8
T2023 = datetime(2023, 3, 1, tzinfo=UTC)
T2024 = datetime(2024, 6, 1, tzinfo=UTC)
TEXTS = {
    "t_paris": "Alice lives in Paris",
    "t_berlin": "Alice lives in Berlin",
    "e1": "Alice: I moved to Paris and I love it",
    "e2": "Alice: I left Paris, now I live in Berlin",
}


def unit(*axes: int) -> list[float]:
    v = [0.0] * DIM
    for axis in axes:
        v[axis] = 1.0
    norm = math.sqrt(len(axes))
    return [x / norm for x in v]


@dataclass
class World:
    """One user's memory, built from the same names and texts for every user (only the ids differ)."""

    user: str
    id: dict[str, str] = field(default_factory=dict)
    vertices: dict[str, Vertex] = field(default_factory=dict)
    edges: dict[str, Edge] = field(default_factory=dict)
    vectors: dict[str, VectorItem] = field(default_factory=dict)

    def obj(self, key: str, name: str, axis: int) -> None:
        vid = ids.object_id(self.user, name)
        self.id[key] = vid
        self.vertices[key] = Vertex(id=vid, user_id=self.user, kind=VertexKind.OBJECT, name=name, props={"k": key})
        self.vectors[key] = VectorItem(id=vid, kind="object", text=name, vector=unit(axis))

    def thesis(self, key: str, when: datetime, *axes: int) -> None:
        vid = ids.thesis_id(self.user, TEXTS[key])
        self.id[key] = vid
        self.vertices[key] = Vertex(
            id=vid, user_id=self.user, kind=VertexKind.THESIS, name=TEXTS[key], t_valid=when, t_created=when
        )
        self.vectors[key] = VectorItem(id=vid, kind="thesis", text=TEXTS[key], vector=unit(*axes))

    def episode(self, key: str, event: str, when: datetime, axis: int) -> None:
        vid = ids.episode_id(self.user, event)
        self.id[key] = vid
        self.vertices[key] = Vertex(id=vid, user_id=self.user, kind=VertexKind.EPISODIC, name=TEXTS[key], t_valid=when)
        self.vectors[key] = VectorItem(id=vid, kind="episodic", text=TEXTS[key], vector=unit(axis))

    def edge(self, key: str, kind: EdgeKind, source: str, relation: str, target: str, *axes: int) -> None:
        eid = ids.edge_id(self.user, kind.value, self.id[source], relation, self.id[target])
        self.id[key] = eid
        self.edges[key] = Edge(
            id=eid, user_id=self.user, kind=kind, source=self.id[source], target=self.id[target], relation=relation
        )
        if axes:
            text = f"{self.vertices[source].name} {relation} {self.vertices[target].name}"
            self.vectors[key] = VectorItem(id=eid, kind="triplet", text=text, vector=unit(*axes))

    def change_set(self, events: list[str], keys: list[str], invalidations: Sequence[Invalidation] = ()) -> ChangeSet:
        return ChangeSet(
            id=ids.change_set_id(self.user, events),
            user_id=self.user,
            event_ids=events,
            vertices=[self.vertices[k] for k in keys if k in self.vertices],
            edges=[self.edges[k] for k in keys if k in self.edges],
            invalidations=list(invalidations),
        )

    def items(self, keys: list[str]) -> list[VectorItem]:
        return [self.vectors[k] for k in keys if k in self.vectors]


FIRST = ["alice", "bob", "paris", "t_paris", "e1", "lives_paris", "knows_bob", "a_tp", "p_tp", "tp_e1"]
SECOND = ["berlin", "t_berlin", "e2", "lives_berlin", "a_tb", "b_tb", "tb_e2"]


def world(user: str) -> World:
    w = World(user)
    w.obj("alice", "Alice", 0)
    w.obj("bob", "Bob", 1)
    w.obj("paris", "Paris", 2)
    w.obj("berlin", "Berlin", 3)
    w.thesis("t_paris", T2023, 0, 2)
    w.thesis("t_berlin", T2024, 0, 3)
    w.episode("e1", "m1", T2023, 5)
    w.episode("e2", "m2", T2024, 6)
    w.edge("lives_paris", EdgeKind.RELATION, "alice", "lives in", "paris", 0, 2, 4)
    w.edge("lives_berlin", EdgeKind.RELATION, "alice", "lives in", "berlin", 0, 3, 4)
    w.edge("knows_bob", EdgeKind.RELATION, "alice", "knows", "bob", 0, 1, 4)
    w.edge("a_tp", EdgeKind.THESIS, "alice", "thesis", "t_paris")
    w.edge("p_tp", EdgeKind.THESIS, "paris", "thesis", "t_paris")
    w.edge("a_tb", EdgeKind.THESIS, "alice", "thesis", "t_berlin")
    w.edge("b_tb", EdgeKind.THESIS, "berlin", "thesis", "t_berlin")
    w.edge("tp_e1", EdgeKind.EPISODIC, "t_paris", "episode", "e1")
    w.edge("tb_e2", EdgeKind.EPISODIC, "t_berlin", "episode", "e2")
    return w


def invalidation(w: World) -> Invalidation:
    return Invalidation(thesis_id=w.id["t_paris"], invalidated_by=w.id["t_berlin"], t_invalid=T2024, t_expired=T2024)


async def load(store: Stores, w: World, second: bool = True) -> None:
    await store.writer.apply(w.change_set(["m1"], FIRST), w.items(FIRST))
    if second:
        await store.writer.apply(w.change_set(["m2"], SECOND, [invalidation(w)]), w.items(SECOND))


@pytest.fixture
def alice() -> World:
    return world("alice")


@pytest.fixture
def bob() -> World:
    return world("bob")


# -- apply ---------------------------------------------------------------------------------------------------------


async def test_apply_counts_what_was_written(memory_store: Stores, alice: World) -> None:
    first = await memory_store.writer.apply(alice.change_set(["m1"], FIRST), alice.items(FIRST))
    assert (first.vertices_added, first.theses_added, first.edges_added) == (5, 1, 5)
    assert first.theses_invalidated == 0 and first.skipped_events == []

    second = await memory_store.writer.apply(
        alice.change_set(["m2"], SECOND, [invalidation(alice)]), alice.items(SECOND)
    )
    assert (second.vertices_added, second.theses_added, second.edges_added, second.theses_invalidated) == (3, 1, 4, 1)
    assert await memory_store.graph.seen_events("alice", ["m1", "m2", "m3"]) == {"m1", "m2"}


async def test_replay_is_skipped_and_changes_nothing(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    before = await memory_store.graph.stats("alice")
    vertices_before = await memory_store.graph.get_vertices("alice", list(alice.id.values()))

    replay = await memory_store.writer.apply(alice.change_set(["m1"], FIRST), alice.items(FIRST))
    assert replay.skipped_events == ["m1"]
    assert (replay.vertices_added, replay.edges_added, replay.theses_invalidated) == (0, 0, 0)
    assert await memory_store.graph.stats("alice") == before
    assert await memory_store.graph.get_vertices("alice", list(alice.id.values())) == vertices_before


async def test_partly_seen_change_set_writes_only_what_is_new(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice, second=False)
    # a re-batched change set: m1 was applied before, m2 is new; m1's content is already there
    result = await memory_store.writer.apply(
        alice.change_set(["m1", "m2"], FIRST + SECOND, [invalidation(alice)]), alice.items(FIRST + SECOND)
    )
    assert result.skipped_events == ["m1"]
    assert (result.vertices_added, result.edges_added, result.theses_invalidated) == (3, 4, 1)
    assert (await memory_store.graph.stats("alice")).events == 2


async def test_first_invalidation_wins(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    later = Invalidation(
        thesis_id=alice.id["t_paris"], invalidated_by="t_other", t_invalid=datetime(2025, 1, 1, tzinfo=UTC),
        t_expired=datetime(2025, 1, 1, tzinfo=UTC),
    )  # fmt: skip
    result = await memory_store.writer.apply(alice.change_set(["m3"], [], [later]), [])
    assert result.theses_invalidated == 0
    paris = (await memory_store.graph.get_vertices("alice", [alice.id["t_paris"]]))[alice.id["t_paris"]]
    assert paris.invalidated_by == alice.id["t_berlin"] and paris.t_invalid == T2024


async def test_a_known_thesis_props_are_rewritten_within_its_user(
    memory_store: Stores, alice: World, bob: World
) -> None:
    """``ChangeSet.props_updates`` (a thesis's marks changed): its props whole; another user's thesis untouched."""
    await load(memory_store, alice)
    await load(memory_store, bob)
    marked = {"marks": '[{"id":"t_x","mark":"conflicts_with","text":"x"}]', "subject": "Alice"}
    updates = [PropsUpdate(thesis_id=alice.id["t_paris"], props=marked)]
    await memory_store.writer.apply(alice.change_set(["m3"], []).model_copy(update={"props_updates": updates}), [])
    # bob's change set naming alice's thesis id changes nothing of hers (the ids differ per user anyway)
    theirs = [PropsUpdate(thesis_id=alice.id["t_paris"], props={"subject": "Bob"})]
    await memory_store.writer.apply(bob.change_set(["m3"], []).model_copy(update={"props_updates": theirs}), [])
    assert (await memory_store.graph.get_vertices("alice", [alice.id["t_paris"]]))[alice.id["t_paris"]].props == marked
    assert (await memory_store.graph.get_vertices("bob", [bob.id["t_paris"]]))[bob.id["t_paris"]].props == {}


def ended(w: World, key: str, by: str, when: datetime) -> EdgeInvalidation:
    return EdgeInvalidation(edge_id=w.id[key], invalidated_by=w.id[by], t_invalid=when, t_expired=when)


async def edge_of(store: Stores, w: World, key: str) -> Edge:
    return (await store.graph.get_triplets(w.user, [w.id[key]]))[w.id[key]].edge


async def test_a_relation_edge_is_ended_once_and_read_back_ended(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    first = ended(alice, "lives_paris", "t_berlin", T2024)
    thesis_edge = EdgeInvalidation(edge_id=alice.id["a_tp"], invalidated_by="t_x", t_invalid=T2024, t_expired=T2024)
    cs = alice.change_set(["m3"], []).model_copy(update={"edge_invalidations": [first, thesis_edge]})
    await memory_store.writer.apply(cs, [])
    later = ended(alice, "lives_paris", "t_paris", datetime(2025, 1, 1, tzinfo=UTC))
    await memory_store.writer.apply(alice.change_set(["m4"], []).model_copy(update={"edge_invalidations": [later]}), [])

    paris = await edge_of(memory_store, alice, "lives_paris")
    assert (paris.t_invalid, paris.t_expired, paris.invalidated_by) == (T2024, T2024, alice.id["t_berlin"])
    assert not paris.valid_at(None) and paris.valid_at(T2023) and not paris.valid_at(T2024)
    assert (await edge_of(memory_store, alice, "lives_berlin")).t_invalid is None
    assert (await edge_of(memory_store, alice, "a_tp")).t_invalid is None  # only relation edges end
    around = {
        t.edge.id: t.edge for t in await memory_store.graph.neighbors("alice", [alice.id["alice"]], [EdgeKind.RELATION])
    }
    assert around[alice.id["lives_paris"]] == paris and around[alice.id["lives_berlin"]].t_invalid is None


async def test_a_relation_edge_stated_again_later_holds_again(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    end = alice.change_set(["m3"], []).model_copy(
        update={"edge_invalidations": [ended(alice, "lives_paris", "t_berlin", T2024)]}
    )
    await memory_store.writer.apply(end, [])
    edge = alice.edges["lives_paris"]
    earlier = alice.change_set(["m4"], []).model_copy(update={"edges": [edge.model_copy(update={"t_valid": T2023})]})
    await memory_store.writer.apply(earlier, [])  # about a time before it ended (a late event, a replay): still ended
    assert (await edge_of(memory_store, alice, "lives_paris")).t_invalid == T2024
    again = datetime(2025, 1, 1, tzinfo=UTC)
    later = alice.change_set(["m5"], []).model_copy(update={"edges": [edge.model_copy(update={"t_valid": again})]})
    await memory_store.writer.apply(later, [])
    paris = await edge_of(memory_store, alice, "lives_paris")
    assert paris.t_invalid is None and paris.invalidated_by is None and paris.t_expired is None


async def test_change_set_for_another_user_is_refused(memory_store: Stores, alice: World, bob: World) -> None:
    mixed = alice.change_set(["m1"], FIRST).model_copy(update={"vertices": [bob.vertices["paris"]]})
    with pytest.raises(ValueError):
        await memory_store.writer.apply(mixed, [])
    assert (await memory_store.graph.stats("alice")).events == 0


# -- announcements (AnnouncementLog: every backend keeps its change sets' memory updates until announced) --------


def announcements(stores: Stores) -> AnnouncementLog:
    return stores.announcements


async def test_a_written_change_set_is_pending_until_announced(memory_store: Stores, alice: World) -> None:
    log = announcements(memory_store)
    change_set = alice.change_set(["m1"], FIRST).model_copy(update={"llm_calls": 2, "event_time": T2023})
    result = await memory_store.writer.apply(change_set, alice.items(FIRST))
    written = result.announcement
    assert written is not None
    assert (written.change_set_id, written.user_id, written.event_ids) == (change_set.id, "alice", ["m1"])
    assert (written.vertices_added, written.theses_added, written.edges_added, written.llm_calls) == (5, 1, 5, 2)
    assert written.event_time == T2023

    assert await log.pending_announcements("alice", ["m1", "m9"]) == [written]
    assert await log.pending_announcements("alice", ["m9"]) == []

    # a replay writes nothing and announces nothing new; the pending announcement stays as it was written
    replay = await memory_store.writer.apply(change_set, alice.items(FIRST))
    assert replay.announcement is None
    assert await log.pending_announcements("alice", ["m1"]) == [written]

    await log.mark_announced("alice", [change_set.id, "c_unknown"])
    assert await log.pending_announcements("alice", ["m1"]) == []
    assert (await memory_store.writer.apply(change_set, alice.items(FIRST))).announcement is None
    assert await log.pending_announcements("alice", ["m1"]) == []


async def test_pending_announcements_come_oldest_first_and_per_change_set(memory_store: Stores, alice: World) -> None:
    log = announcements(memory_store)
    await load(memory_store, alice)
    pending = await log.pending_announcements("alice", ["m2", "m1"])
    assert [a.event_ids for a in pending] == [["m1"], ["m2"]]
    await log.mark_announced("alice", [pending[0].change_set_id])
    assert [a.event_ids for a in await log.pending_announcements("alice", ["m1", "m2"])] == [["m2"]]


async def test_announcements_are_per_user(memory_store: Stores, alice: World, bob: World) -> None:
    log = announcements(memory_store)
    await load(memory_store, alice, second=False)
    await load(memory_store, bob, second=False)
    assert [a.user_id for a in await log.pending_announcements("bob", ["m1"])] == ["bob"]
    await log.mark_announced("bob", [alice.change_set(["m1"], FIRST).id])  # not his
    assert [a.user_id for a in await log.pending_announcements("alice", ["m1"])] == ["alice"]
    assert [a.user_id for a in await log.pending_announcements("bob", ["m1"])] == ["bob"]


# -- graph reads ------------------------------------------------------------------------------------------------------


async def test_get_vertices_round_trips(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice, second=False)
    wanted = [alice.id[k] for k in ("alice", "t_paris", "e1")] + ["o_missing"]
    got = await memory_store.graph.get_vertices("alice", wanted)
    assert got == {alice.id[k]: alice.vertices[k] for k in ("alice", "t_paris", "e1")}


async def test_find_objects_by_normalized_name(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice, second=False)
    found = await memory_store.graph.find_objects("alice", [ids.normalize_name("The  ALICE"), "paris", "nobody"])
    assert {key: v.id for key, v in found.items()} == {"alice": alice.id["alice"], "paris": alice.id["paris"]}


async def test_neighbors_both_directions_keep_edge_direction(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    triplets = await memory_store.graph.neighbors("alice", [alice.id["paris"]])
    by_edge = {t.edge.id: t for t in triplets}
    assert set(by_edge) == {alice.id["lives_paris"], alice.id["p_tp"]}
    incoming = by_edge[alice.id["lives_paris"]]  # paris is the target: start stays alice
    assert (incoming.start.id, incoming.end.id) == (alice.id["alice"], alice.id["paris"])
    assert incoming.text == "Alice lives in Paris"
    outgoing = by_edge[alice.id["p_tp"]]
    assert (outgoing.start.id, outgoing.end.id) == (alice.id["paris"], alice.id["t_paris"])


async def test_get_triplets_by_edge_id_is_scoped_to_the_user(memory_store: Stores, alice: World, bob: World) -> None:
    await load(memory_store, alice)
    await load(memory_store, bob)
    wanted = [alice.id["lives_paris"], alice.id["p_tp"], "missing"]
    found = await memory_store.graph.get_triplets("alice", wanted)
    assert set(found) == {alice.id["lives_paris"], alice.id["p_tp"]}
    assert found[alice.id["lives_paris"]].text == "Alice lives in Paris"
    assert await memory_store.graph.get_triplets("bob", [alice.id["lives_paris"]]) == {}
    assert await memory_store.graph.get_triplets("alice", []) == {}


async def test_neighbors_of_a_frontier_in_one_call(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    triplets = await memory_store.graph.neighbors("alice", [alice.id["paris"], alice.id["alice"], alice.id["t_paris"]])
    edge_ids = [t.edge.id for t in triplets]
    assert len(edge_ids) == len(set(edge_ids)), "an edge between two frontier vertices comes back once"
    expected = ["lives_paris", "p_tp", "lives_berlin", "knows_bob", "a_tp", "a_tb", "tp_e1"]
    assert set(edge_ids) == {alice.id[k] for k in expected}


async def test_neighbors_edge_kind_filter_and_limit(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    relations = await memory_store.graph.neighbors("alice", [alice.id["alice"]], edge_kinds=[EdgeKind.RELATION])
    assert {t.edge.id for t in relations} == {alice.id[k] for k in ("lives_paris", "lives_berlin", "knows_bob")}
    assert all(t.edge.kind is EdgeKind.RELATION for t in relations)

    episodic = await memory_store.graph.neighbors("alice", [alice.id["t_paris"]], edge_kinds=[EdgeKind.EPISODIC])
    assert [(t.start.id, t.end.id) for t in episodic] == [(alice.id["t_paris"], alice.id["e1"])]

    limited = await memory_store.graph.neighbors("alice", [alice.id["alice"], alice.id["paris"]], limit_per_vertex=1)
    assert len(limited) == 2
    assert await memory_store.graph.neighbors("alice", []) == []


async def test_neighbors_far_kind_filter(memory_store: Stores, alice: World) -> None:
    """Only edges whose other end is of the kinds asked, whichever way they point; the limit counts those only."""
    await load(memory_store, alice)
    graph = memory_store.graph
    to_objects = await graph.neighbors("alice", [alice.id["alice"]], far_kinds=[VertexKind.OBJECT])
    assert {t.edge.id for t in to_objects} == {alice.id[k] for k in ("lives_paris", "lives_berlin", "knows_bob")}
    to_theses = await graph.neighbors("alice", [alice.id["paris"]], far_kinds=[VertexKind.THESIS])
    assert [t.edge.id for t in to_theses] == [alice.id["p_tp"]]  # not lives_paris, whose other end is alice
    into_episode = await graph.neighbors("alice", [alice.id["e1"]], [EdgeKind.EPISODIC], far_kinds=[VertexKind.THESIS])
    assert [(t.start.id, t.end.id) for t in into_episode] == [(alice.id["t_paris"], alice.id["e1"])]
    one = await graph.neighbors("alice", [alice.id["alice"]], limit_per_vertex=1, far_kinds=[VertexKind.THESIS])
    assert len(one) == 1 and one[0].end.kind is VertexKind.THESIS
    assert await graph.neighbors("alice", [alice.id["alice"]], far_kinds=[]) == []


async def test_valid_theses_after_invalidation(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice, second=False)
    assert [v.id for v in await memory_store.graph.valid_theses("alice")] == [alice.id["t_paris"]]

    await load(memory_store, alice)
    assert [v.id for v in await memory_store.graph.valid_theses("alice")] == [alice.id["t_berlin"]]
    assert [v.id for v in await memory_store.graph.valid_theses("alice", about=[alice.id["alice"]])] == [
        alice.id["t_berlin"]
    ]
    assert await memory_store.graph.valid_theses("alice", about=[alice.id["paris"]]) == []
    assert await memory_store.graph.valid_theses("alice", about=[]) == []

    old = (await memory_store.graph.get_vertices("alice", [alice.id["t_paris"]]))[alice.id["t_paris"]]
    assert (old.t_invalid, old.t_expired, old.invalidated_by) == (T2024, T2024, alice.id["t_berlin"])
    assert old.valid_at(datetime(2023, 12, 31, tzinfo=UTC)) and not old.valid_at(None)


async def test_stats(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    stats = await memory_store.graph.stats("alice")
    assert stats.user_id == "alice"
    assert {k: n for k, n in stats.vertices.items() if n} == {"object": 4, "thesis": 2, "episodic": 2}
    assert {k: n for k, n in stats.edges.items() if n} == {"relation": 3, "thesis": 4, "episodic": 2}
    assert (stats.theses_valid, stats.theses_invalidated, stats.events) == (1, 1, 2)


# -- search -----------------------------------------------------------------------------------------------------------


async def test_dense_search_scores_cosine_and_filters_kinds(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    objects = await memory_store.vectors.search("alice", ["object"], unit(2), k=2)
    assert objects[0].id == alice.id["paris"] and objects[0].score == pytest.approx(1.0, abs=1e-5)
    assert objects[1].score == pytest.approx(0.0, abs=1e-5)

    theses = await memory_store.vectors.search("alice", ["thesis"], unit(0, 2), k=10)
    assert [h.id for h in theses] == [alice.id["t_paris"], alice.id["t_berlin"]]
    assert [h.score for h in theses] == pytest.approx([1.0, 0.5], abs=1e-5)

    mixed = await memory_store.vectors.search("alice", ["thesis", "triplet"], unit(0, 2, 4), k=3)
    assert mixed[0].id == alice.id["lives_paris"]
    assert {h.id for h in mixed} <= {
        alice.id[k] for k in ("lives_paris", "lives_berlin", "knows_bob", "t_paris", "t_berlin")
    }


async def test_dense_search_restrict_to(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    allowed = [alice.id["berlin"], alice.id["t_berlin"], "o_not_there"]
    hits = await memory_store.vectors.search("alice", [], unit(2), k=10, restrict_to=allowed)
    assert {h.id for h in hits} == {alice.id["berlin"], alice.id["t_berlin"]}
    assert await memory_store.vectors.search("alice", [], unit(2), k=10, restrict_to=[]) == []


async def test_lexical_search_bm25(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    hits = await memory_store.vectors.search("alice", ["thesis"], None, "Where does Alice live: Berlin?", k=5)
    assert [h.id for h in hits] == [alice.id["t_berlin"], alice.id["t_paris"]]
    assert hits[0].score > hits[1].score > 0

    episodes = await memory_store.vectors.search("alice", ["episodic"], None, "moved", k=5)
    assert [h.id for h in episodes] == [alice.id["e1"]]

    restricted = await memory_store.vectors.search("alice", [], None, "Paris", k=10, restrict_to=[alice.id["e2"]])
    assert [h.id for h in restricted] == [alice.id["e2"]]


@pytest.mark.parametrize(
    "text",
    [
        '"Paris',
        "Paris AND OR NOT",
        "NEAR(Paris Berlin, 2)",
        "text:Paris",
        "Pa*",
        "(((",
        "-Paris ^Berlin",
        "'; DROP TABLE x; --",
    ],
)
async def test_lexical_query_syntax_in_user_text_is_harmless(memory_store: Stores, alice: World, text: str) -> None:
    await load(memory_store, alice)
    hits = await memory_store.vectors.search("alice", [], None, text, k=10)
    assert all(h.id in alice.id.values() for h in hits)
    assert await memory_store.vectors.search("alice", [], None, "?!.,;", k=10) == []


async def test_hybrid_search_fuses_both_rankings(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    # dense ranks Paris 1st and Berlin 2nd; lexical finds only Berlin: 1/61 + 1/62 beats 1/61
    hits = await memory_store.vectors.search("alice", ["thesis"], unit(0, 2), "Berlin", k=10)
    assert [h.id for h in hits] == [alice.id["t_berlin"], alice.id["t_paris"]]
    assert [h.score for h in hits] == pytest.approx([1 / 61 + 1 / 62, 1 / 61])
    # first in both lists
    top = await memory_store.vectors.search("alice", ["thesis"], unit(0, 3), "Berlin", k=1)
    assert top[0].id == alice.id["t_berlin"] and top[0].score == pytest.approx(2 / 61)

    restricted = await memory_store.vectors.search(
        "alice", [], unit(0, 3), "Berlin", k=10, restrict_to=[alice.id["t_paris"]]
    )
    assert [h.id for h in restricted] == [alice.id["t_paris"]]


async def test_get_vectors(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    got = await memory_store.vectors.get_vectors("alice", [alice.id["t_paris"], alice.id["lives_paris"], "missing"])
    assert set(got) == {alice.id["t_paris"], alice.id["lives_paris"]}
    assert got[alice.id["t_paris"]] == pytest.approx(unit(0, 2), abs=1e-6)


# -- isolation --------------------------------------------------------------------------------------------------------


async def test_users_never_see_each_other(memory_store: Stores, alice: World, bob: World) -> None:
    await load(memory_store, alice)
    await load(memory_store, bob, second=False)  # same names, texts and event ids; bob never moved to Berlin
    bob_ids = list(bob.id.values())
    assert not set(bob_ids) & set(alice.id.values())

    assert await memory_store.graph.get_vertices("alice", bob_ids) == {}
    assert await memory_store.vectors.get_vectors("alice", bob_ids) == {}
    assert await memory_store.graph.neighbors("alice", bob_ids) == []
    assert await memory_store.graph.valid_theses("alice", about=bob_ids) == []
    found = await memory_store.graph.find_objects("alice", ["alice", "paris", "berlin"])
    assert {v.id for v in found.values()} == {alice.id["alice"], alice.id["paris"], alice.id["berlin"]}
    assert await memory_store.graph.seen_events("bob", ["m1", "m2"]) == {"m1"}

    for user, own in (("alice", alice), ("bob", bob)):
        mine = set(own.id.values())
        for hits in (
            await memory_store.vectors.search(user, [], unit(2), k=50),
            await memory_store.vectors.search(user, [], None, "Alice Paris Berlin", k=50),
            await memory_store.vectors.search(user, [], unit(2), "Alice Paris", k=50),
            await memory_store.vectors.search(user, [], unit(2), k=50, restrict_to=bob_ids + list(alice.id.values())),
        ):
            assert hits and {h.id for h in hits} <= mine
        triplets = await memory_store.graph.neighbors(user, [own.id["alice"], own.id["t_paris"]])
        assert triplets and all(v.user_id == user for t in triplets for v in (t.start, t.end))
        assert all(t.edge.user_id == user for t in triplets)
        assert all(v.user_id == user for v in await memory_store.graph.valid_theses(user))

    assert [v.id for v in await memory_store.graph.valid_theses("bob")] == [bob.id["t_paris"]]
    alice_stats, bob_stats = await memory_store.graph.stats("alice"), await memory_store.graph.stats("bob")
    assert (alice_stats.theses_invalidated, alice_stats.events, alice_stats.vertices["object"]) == (1, 2, 4)
    assert (bob_stats.theses_invalidated, bob_stats.events, bob_stats.vertices["object"]) == (0, 1, 3)
    assert (await memory_store.graph.stats("carol")).events == 0


async def test_search_many_is_one_search_each(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    queries = [unit(2), unit(0, 2), unit(0, 2, 4)]
    many = await memory_store.vectors.search_many("alice", ["thesis", "object"], queries, k=3)
    one_each = [await memory_store.vectors.search("alice", ["thesis", "object"], q, k=3) for q in queries]
    assert [[h.id for h in hits] for hits in many] == [[h.id for h in hits] for hits in one_each]
    assert [[h.score for h in hits] for hits in many] == [
        pytest.approx([h.score for h in hits], abs=1e-5) for hits in one_each
    ]
    assert many[0][0].id == alice.id["paris"]
    # scoped to the user like every read: bob's memory holds none of alice's vertices
    assert await memory_store.vectors.search_many("bob", ["thesis", "object"], queries, k=3) == [[], [], []]
    assert await memory_store.vectors.search_many("alice", ["thesis"], [], k=3) == []


async def test_valid_theses_each_is_one_read_each(memory_store: Stores, alice: World) -> None:
    await load(memory_store, alice)
    objects = [alice.id["paris"], alice.id["berlin"], alice.id["bob"], "o_not_there"]
    each = await memory_store.graph.valid_theses_each("alice", objects, limit=10)
    assert set(each) == set(objects)
    for o in objects:
        assert [v.id for v in each[o]] == [v.id for v in await memory_store.graph.valid_theses("alice", [o], 10)]
    assert [v.id for v in each[alice.id["berlin"]]] == [alice.id["t_berlin"]]
    assert each[alice.id["paris"]] == []  # its thesis was invalidated by Berlin's
    assert each["o_not_there"] == []
    assert await memory_store.graph.valid_theses_each("bob", objects, limit=10) == {o: [] for o in objects}
