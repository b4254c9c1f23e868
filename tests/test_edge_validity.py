"""Relation edges end with the theses that state them, through memorize, on both stores, for every retriever.

"Ada works at Siemens", then "Ada works at St. Mary's": the Siemens thesis is invalidated, and so is the relation
edge ``Ada -works at-> Siemens`` it stated; no retriever returns it as current, and ``as_of`` before the change
sees it (and not St. Mary's). The same when the Siemens message arrives late, after the St. Mary's one: it is
written invalidated, and St. Mary's stays current. The memory doubles (rule-based LLM, real embedder and stores)
are those of tests/test_forget_memory.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import apsw
import pytest

from schemas.events import ForgetScope
from services import ids
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Edge, EdgeKind, Triplet, Vertex, VertexKind
from services.memorize.builder import ChangeSetBuilder, KnownRef, Source
from services.memorize.extraction import Fact, ItemFacts
from services.retrieval.base import RetrievalRequest
from services.retrieval.registry import get_retriever
from services.validity import GAPS, Gap, held, holes, reopened, without_gaps_by
from streams.gateway.graph import neighbourhood
from tests import test_forget_memory
from tests.contract.conftest import remote_addresses
from tests.test_forget_memory import Memory, chat
from tests.test_retrievers import ALL

# the memories of tests/test_forget_memory.py, on SQLite and on the remote store (fixtures)
embedder = test_forget_memory.embedder
open_memory = test_forget_memory.open_memory

SIEMENS, ST_MARYS = chat(1, "I work at Siemens."), chat(2, "I work at St. Mary's.")
BETWEEN = SIEMENS.event_time + timedelta(seconds=30)  # after the first was said, before the second
SIEMENS_AGAIN = chat(3, "I work at Siemens.")  # back at Siemens: the same thesis, said again
GAP = ST_MARYS.event_time + timedelta(seconds=30)  # at St. Mary's, before Ada went back to Siemens


def relation(user: str, place: str) -> str:
    return ids.edge_id(
        user, EdgeKind.RELATION.value, ids.object_id(user, "Ada"), "works at", ids.object_id(user, place)
    )


async def edge(memory: Memory, place: str) -> Edge:
    edge_id = relation("ada", place)
    return (await memory.store.get_triplets("ada", [edge_id]))[edge_id].edge


async def retrieve(memory: Memory, name: str, as_of: datetime | None) -> list[Triplet]:
    [vector] = await memory.memorize.embedder.embed(["Where does Ada work?"])
    request = RetrievalRequest(
        user_id="ada",
        query="Where does Ada work?",
        query_vector=list(vector),
        seeds=[ids.object_id("ada", "Ada")],
        budget=20,
        as_of=as_of,
    )
    return await get_retriever(name, memory.store, memory.store).retrieve(request)


def places(triplets: list[Triplet]) -> set[str]:
    return {p for p in ("Siemens", "St. Mary's") if any(p in t.text for t in triplets)}


async def check_every_retriever(memory: Memory, expected: Sequence[tuple[datetime | None, set[str]]] = ()) -> None:
    """Each retriever sees what held at each time (default: St. Mary's now, Siemens between the two messages)."""
    for name in ALL:
        for as_of, seen in expected or [(None, {"St. Mary's"}), (BETWEEN, {"Siemens"})]:
            assert places(await retrieve(memory, name, as_of)) == seen, (name, as_of)


async def test_an_update_ends_the_relation_edge_of_the_old_state(open_memory: Any) -> None:
    memory = await open_memory("anna")
    await memory.said([SIEMENS, ST_MARYS])
    [current] = await memory.store.valid_theses("ada")
    old, new = await edge(memory, "Siemens"), await edge(memory, "St. Mary's")
    assert (old.t_invalid, old.invalidated_by) == (ST_MARYS.event_time, current.id)
    assert old.t_valid == SIEMENS.event_time and old.valid_at(BETWEEN) and not old.valid_at(None)
    assert new.t_invalid is None and new.invalidated_by is None
    await check_every_retriever(memory)


async def test_a_late_earlier_fact_is_written_ended_and_the_newer_state_stays(open_memory: Any) -> None:
    memory = await open_memory("late")
    await memory.said([ST_MARYS, SIEMENS])  # the Siemens message is about an earlier time and arrives last
    [current] = await memory.store.valid_theses("ada")
    assert "St. Mary's" in current.name
    old, new = await edge(memory, "Siemens"), await edge(memory, "St. Mary's")
    assert (old.t_invalid, old.invalidated_by) == (ST_MARYS.event_time, current.id)
    assert old.valid_at(BETWEEN) and not old.valid_at(None)
    assert new.t_invalid is None
    await check_every_retriever(memory)


def builder_with_update(co_staters: frozenset[str]) -> ChangeSet:
    """St. Mary's replaces a known Siemens thesis; ``co_staters``: other valid theses known to state its edge."""
    source = Source("m2", 0, "I work at St. Mary's.", ST_MARYS.event_time, ST_MARYS.ingest_time, {})
    builder = ChangeSetBuilder("ada", "c", ["m2"])
    [new_id] = builder.add(source, ItemFacts(facts=[fact("St. Mary's")]))
    props = {"subject": "Ada", "relation": "works at", "object": "Siemens"}
    known = Vertex(id="t_old", user_id="ada", kind=VertexKind.THESIS, name="Ada works at Siemens.", props=props)
    old = KnownRef.of(known.model_copy(update={"t_valid": SIEMENS.event_time}))
    builder.invalidate(KnownRef(old.id, old.t_valid, old.relation, co_staters), new_id, source)
    return builder.build(0)


def fact(place: str) -> Fact:
    return Fact(
        subject="Ada",
        text=f"Ada works at {place}.",
        relation="works at",
        object=place,
        kind="FACT",
        temporal="DYNAMIC",
    )


def test_the_edge_ends_only_when_no_other_valid_thesis_states_it() -> None:
    alone = builder_with_update(frozenset())
    [ended] = alone.edge_invalidations
    assert ended.edge_id == relation("ada", "Siemens") and ended.t_invalid == ST_MARYS.event_time
    assert ended.invalidated_by == alone.invalidations[0].invalidated_by
    assert builder_with_update(frozenset({"t_also_siemens"})).edge_invalidations == []


def test_known_ref_finds_the_other_valid_staters_of_its_edge() -> None:
    props = {"subject": "Ada", "relation": "works at", "object": "Siemens"}
    theses = [
        Vertex(id=f"t_{n}", user_id="ada", kind=VertexKind.THESIS, name=f"Ada works at Siemens {n}.", props=props)
        for n in range(3)
    ]
    theses[2] = theses[2].model_copy(update={"t_invalid": ST_MARYS.event_time})
    other = Vertex(id="t_x", user_id="ada", kind=VertexKind.THESIS, name="x", props={**props, "object": "Bosch"})
    ref = KnownRef.of(theses[0], [*theses, other])
    assert ref.relation == relation("ada", "Siemens") and ref.co_staters == {"t_1"}


async def test_the_neighbourhood_shows_what_held_then_and_marks_an_asked_for_ended_edge(open_memory: Any) -> None:
    memory = await open_memory("graph")
    await memory.said([SIEMENS, ST_MARYS])
    ada, siemens = ids.object_id("ada", "Ada"), relation("ada", "Siemens")
    now = await neighbourhood(memory.store, "ada", [ada], per_vertex=50)
    then = await neighbourhood(memory.store, "ada", [ada], per_vertex=50, as_of=BETWEEN)
    assert siemens not in {e.id for e in now.edges} and relation("ada", "St. Mary's") in {e.id for e in now.edges}
    assert siemens in {e.id for e in then.edges} and relation("ada", "St. Mary's") not in {e.id for e in then.edges}
    assert all(e.valid for e in now.edges) and all(n.valid for n in now.nodes)
    asked = await neighbourhood(memory.store, "ada", [siemens], per_vertex=50)
    assert {e.id: e.valid for e in asked.edges if e.focus} == {siemens: False}


async def test_an_older_file_gains_the_edge_columns_on_open(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    await (await SqliteMemoryStore.open(path, dim=4)).close()
    conn = apsw.Connection(str(path))
    for column in ("t_expired", "t_invalid", "invalidated_by"):  # the edges table as schema "1" first wrote it
        conn.execute(f"ALTER TABLE edges DROP COLUMN {column}")
    for vid in ("o_a", "o_b"):
        conn.execute(
            "INSERT INTO vertices (id, user_id, kind, name, props) VALUES (?, 'ada', 'object', ?, '{}')", (vid, vid)
        )
    conn.execute(
        "INSERT INTO edges (id, user_id, kind, source, target, relation, props, t_valid) "
        "VALUES ('r_1', 'ada', 'relation', 'o_a', 'o_b', 'knows', '{}', NULL)"
    )
    conn.close()
    for _ in range(2):  # idempotent: the second open finds the columns there
        store = await SqliteMemoryStore.open(path, dim=4)
        try:
            edge = (await store.get_triplets("ada", ["r_1"]))["r_1"].edge
        finally:
            await store.close()
        assert edge.relation == "knows" and edge.t_invalid is None and edge.valid_at(None)
    columns = {str(row[1]) for row in apsw.Connection(str(path)).execute("PRAGMA table_info(edges)")}
    assert {"t_expired", "t_invalid", "invalidated_by"} <= columns


async def test_a_state_stated_again_after_it_ended_did_not_hold_in_between(open_memory: Any) -> None:
    """Siemens, St. Mary's, Siemens again: the Siemens thesis and edge hold again, and ``as_of`` the St. Mary's
    time sees them ended (the gap), for every retriever, the QA filter's ``valid_at`` and the neighbourhood."""
    memory = await open_memory("again")
    await memory.said([SIEMENS, ST_MARYS, SIEMENS_AGAIN])
    [current] = await memory.store.valid_theses("ada")
    assert "Siemens" in current.name and current.t_invalid is None
    assert current.valid_at(BETWEEN) and not current.valid_at(GAP) and current.valid_at(SIEMENS_AGAIN.event_time)
    siemens, st_marys = await edge(memory, "Siemens"), await edge(memory, "St. Mary's")
    assert siemens.t_invalid is None and siemens.valid_at(None) and siemens.valid_at(BETWEEN)
    assert not siemens.valid_at(GAP) and siemens.valid_at(SIEMENS_AGAIN.event_time)
    assert st_marys.valid_at(GAP) and not st_marys.valid_at(None)
    await check_every_retriever(memory, [(None, {"Siemens"}), (BETWEEN, {"Siemens"}), (GAP, {"St. Mary's"})])
    ada = ids.object_id("ada", "Ada")
    then = {e.id for e in (await neighbourhood(memory.store, "ada", [ada], per_vertex=50, as_of=GAP)).edges}
    assert relation("ada", "Siemens") not in then and relation("ada", "St. Mary's") in then
    # a replay of the whole conversation changes nothing
    before = await memory.snapshot()
    await memory.said([SIEMENS, ST_MARYS, SIEMENS_AGAIN])
    assert await memory.snapshot() == before


async def test_forgetting_the_state_in_between_closes_the_gap(open_memory: Any) -> None:
    memory = await open_memory("closed")
    await memory.said([SIEMENS, ST_MARYS, SIEMENS_AGAIN])
    await memory.forget.forget(test_forget_memory.tombstone(ForgetScope.MESSAGE, ST_MARYS.event_id), "chat")
    [current] = await memory.store.valid_theses("ada")
    siemens = await edge(memory, "Siemens")
    assert "Siemens" in current.name and current.valid_at(GAP) and GAPS not in current.props
    assert siemens.valid_at(GAP) and siemens.valid_at(None) and GAPS not in siemens.props
    await check_every_retriever(memory, [(None, {"Siemens"}), (GAP, {"Siemens"})])


def test_an_edge_holds_exactly_while_one_of_its_staters_does() -> None:
    t = [SIEMENS.event_time + timedelta(minutes=n) for n in range(6)]
    assert holes([(t[0], t[1]), (t[3], None)]) == [Gap(t[1], t[3])]
    assert holes([(t[0], t[2]), (t[1], t[3]), (t[4], t[5])]) == [Gap(t[3], t[4])]
    assert holes([(t[0], None), (t[2], t[3])]) == []
    props = reopened({}, t[1], t[3], "t_b")
    assert held(t[0], None, props) == [(t[0], t[1]), (t[3], None)]
    assert without_gaps_by(props, {"t_b"}) == {} and without_gaps_by(props, {"t_c"}) is None


def old_file(path: Path) -> None:
    """A file as schema "1" first wrote it (edges without validity columns) with Ada's Siemens and St. Mary's
    theses: Siemens invalidated by St. Mary's, both relation edges valid as the old code left them."""
    conn = apsw.Connection(str(path))
    for column in ("t_expired", "t_invalid", "invalidated_by"):
        conn.execute(f"ALTER TABLE edges DROP COLUMN {column}")
    conn.execute("DELETE FROM meta WHERE key = 'edge_validity_derived'")  # older code did not record it
    said = {"Siemens": SIEMENS, "St. Mary's": ST_MARYS}
    for place, message in said.items():
        props = json.dumps({"subject": "Ada", "relation": "works at", "object": place, "event_id": message.event_id})
        ended = (ST_MARYS.event_time.isoformat(), ST_MARYS.ingest_time.isoformat(), "t_st_marys")
        conn.execute(
            "INSERT INTO vertices (id, user_id, kind, name, props, t_valid, t_invalid, t_expired, invalidated_by) "
            "VALUES (?, 'ada', 'thesis', ?, ?, ?, ?, ?, ?)",
            (
                f"t_{place}",
                f"Ada works at {place}.",
                props,
                message.event_time.isoformat(),
                *(ended if place == "Siemens" else (None, None, None)),
            ),
        )
        conn.execute(
            "INSERT INTO edges (id, user_id, kind, source, target, relation, props, t_valid) "
            "VALUES (?, 'ada', 'relation', ?, ?, 'works at', '{}', ?)",
            (
                relation("ada", place),
                ids.object_id("ada", "Ada"),
                ids.object_id("ada", place),
                message.event_time.isoformat(),
            ),
        )
    for name in ("Ada", "Siemens", "St. Mary's"):
        conn.execute(
            "INSERT INTO vertices (id, user_id, kind, name, props) VALUES (?, 'ada', 'object', ?, '{}')",
            (ids.object_id("ada", name), name),
        )
    conn.close()


async def test_an_older_file_derives_its_relation_edges_validity_from_their_staters_once(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    await (await SqliteMemoryStore.open(path, dim=4)).close()
    old_file(path)
    async with await SqliteMemoryStore.open(path, dim=4) as store:
        ended = await store.get_triplets("ada", [relation("ada", "Siemens"), relation("ada", "St. Mary's")])
    siemens, st_marys = ended[relation("ada", "Siemens")].edge, ended[relation("ada", "St. Mary's")].edge
    assert (siemens.t_invalid, siemens.t_expired, siemens.invalidated_by) == (
        ST_MARYS.event_time,
        ST_MARYS.ingest_time,
        "t_st_marys",
    )
    assert siemens.valid_at(BETWEEN) and not siemens.valid_at(None)
    assert st_marys.t_invalid is None and st_marys.valid_at(None)
    # recorded: a later open does not derive again (an edge set valid since, by whatever means, stays so)
    conn = apsw.Connection(str(path))
    conn.execute("UPDATE edges SET t_invalid = NULL, t_expired = NULL, invalidated_by = NULL")
    conn.close()
    async with await SqliteMemoryStore.open(path, dim=4) as store:
        again = (await store.get_triplets("ada", [relation("ada", "Siemens")]))[relation("ada", "Siemens")].edge
    assert again.t_invalid is None


def old_change_set(user: str) -> ChangeSet:
    """What older code wrote for Siemens then St. Mary's: the Siemens thesis invalidated, both edges valid."""
    ada, siemens, st_marys = (ids.object_id(user, name) for name in ("Ada", "Siemens", "St. Mary's"))
    objects = [
        Vertex(id=ids.object_id(user, name), user_id=user, kind=VertexKind.OBJECT, name=name)
        for name in ("Ada", "Siemens", "St. Mary's")
    ]
    theses, edges = [], []
    for place, message, target in (("Siemens", SIEMENS, siemens), ("St. Mary's", ST_MARYS, st_marys)):
        props = {"subject": "Ada", "relation": "works at", "object": place, "event_id": message.event_id}
        theses.append(
            Vertex(
                id=f"t_{place}",
                user_id=user,
                kind=VertexKind.THESIS,
                name=f"Ada works at {place}.",
                props=props,
                t_valid=message.event_time,
            )
        )
        edge_id = ids.edge_id(user, EdgeKind.RELATION.value, ada, "works at", target)
        edges.append(
            Edge(
                id=edge_id,
                user_id=user,
                kind=EdgeKind.RELATION,
                source=ada,
                target=target,
                relation="works at",
                t_valid=message.event_time,
            )
        )
    theses[0] = theses[0].model_copy(
        update={"t_invalid": ST_MARYS.event_time, "t_expired": ST_MARYS.ingest_time, "invalidated_by": "t_St. Mary's"}
    )
    return ChangeSet(id="c_old", user_id=user, event_ids=[], vertices=[*objects, *theses], edges=edges)


@pytest.mark.server
async def test_dgraph_derives_old_relation_edges_validity_from_their_staters_once(embedder: Any) -> None:
    from services.adapters.dgraph import DgraphGraphStore
    from services.adapters.dgraph.upgrade import EDGE_VALIDITY, derive_edge_validity
    from services.adapters.dgraph.write import Mutation, delete_node

    dgraph, _, _ = remote_addresses()
    user = "edge-validity-upgrade"
    store = await DgraphGraphStore.open(dgraph)
    try:
        await store.delete_user(user)
        await store.apply_graph(old_change_set(user))
        # as if the upgrade had never run on this cluster
        forgotten = Mutation(deletes=[delete_node("m")])
        query = "query q($id: string) { m as var(func: eq(upgrade.id, $id)) }"
        await store._request("test_upgrade_reset", query, {"$id": EDGE_VALIDITY}, [forgotten])
        assert await derive_edge_validity(store._query, store._request) >= 1
        found = await store.get_triplets(user, [relation(user, "Siemens"), relation(user, "St. Mary's")])
        siemens, st_marys = found[relation(user, "Siemens")].edge, found[relation(user, "St. Mary's")].edge
        assert (siemens.t_invalid, siemens.t_expired, siemens.invalidated_by) == (
            ST_MARYS.event_time,
            ST_MARYS.ingest_time,
            "t_St. Mary's",
        )
        assert st_marys.t_invalid is None
        # recorded: it does not run again, and opening a store does not either
        assert await derive_edge_validity(store._query, store._request) == 0
        await (await DgraphGraphStore.open(dgraph)).close()
    finally:
        await store.delete_user(user)
        await store.close()


async def test_forgetting_the_first_statement_leaves_the_state_from_its_restatement(open_memory: Any) -> None:
    memory = await open_memory("restated")
    await memory.said([SIEMENS, ST_MARYS, SIEMENS_AGAIN])
    await memory.forget.forget(test_forget_memory.tombstone(ForgetScope.MESSAGE, SIEMENS.event_id), "chat")
    siemens = await edge(memory, "Siemens")
    assert siemens.t_valid == SIEMENS_AGAIN.event_time and siemens.valid_at(None) and GAPS not in siemens.props
    assert not siemens.valid_at(BETWEEN) and not siemens.valid_at(GAP)
    await check_every_retriever(memory, [(None, {"Siemens"}), (GAP, {"St. Mary's"}), (BETWEEN, set())])
