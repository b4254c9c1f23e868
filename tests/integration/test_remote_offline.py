"""What the remote adapters send, checked without servers: user text only as DQL variables or typed N-Quad values,
sort keys, BM25 query text, and the schema rewrite that keeps Ollama's grammar converter from crashing."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from services import ids
from services.adapters.dgraph import queries, schema_text, upgrade
from services.adapters.dgraph.codec import rank_key
from services.adapters.dgraph.write import (
    Ended,
    announced_upsert,
    change_set_upsert,
    delete_user_upsert,
    events_upsert,
    kv_put_upsert,
)
from services.adapters.ollama.schema import ollama_schema, portable_pattern
from services.adapters.remote import RemoteMemoryStore
from services.adapters.weaviate.collections import tenant_name
from services.adapters.weaviate.store import bm25_text
from services.domain import (
    Announcement,
    ApplyResult,
    ChangeSet,
    Edge,
    EdgeKind,
    Invalidation,
    PropsUpdate,
    Vertex,
    VertexKind,
)
from services.settings import Settings

HOSTILE = '"}) { leak(func: has(vertex.id)) { uid } } # uid(a0) val(x) $u [1, 2]'


def hostile_change_set() -> ChangeSet:
    user = HOSTILE
    a = Vertex(
        id=ids.object_id(user, HOSTILE), user_id=user, kind=VertexKind.OBJECT, name=HOSTILE, props={"k": HOSTILE}
    )
    t = Vertex(id=ids.thesis_id(user, HOSTILE), user_id=user, kind=VertexKind.THESIS, name=HOSTILE)
    edge = Edge(id="r_" + HOSTILE, user_id=user, kind=EdgeKind.THESIS, source=a.id, target=t.id, relation=HOSTILE)
    now = datetime.now(UTC)
    inv = Invalidation(thesis_id=t.id, invalidated_by=HOSTILE, t_invalid=now, t_expired=now)
    return ChangeSet(id="c_1", user_id=user, event_ids=[HOSTILE], vertices=[a, t], edges=[edge], invalidations=[inv])


@pytest.mark.parametrize(
    "built",
    [
        queries.get_vertices(HOSTILE, [HOSTILE]),
        queries.find_objects(HOSTILE, [HOSTILE]),
        queries.neighbors(HOSTILE, [HOSTILE], [HOSTILE], 3),
        queries.get_triplets(HOSTILE, [HOSTILE]),
        queries.valid_theses(HOSTILE, [HOSTILE], 5),
        queries.valid_theses(HOSTILE, None, 5),
        queries.seen_events(HOSTILE, [HOSTILE]),
        queries.change_sets_of(HOSTILE, [HOSTILE]),
        queries.pending_announcements(HOSTILE, [HOSTILE]),
        queries.stats(HOSTILE),
        queries.ended(HOSTILE, [HOSTILE], [HOSTILE]),
        upgrade.theses_page(HOSTILE, 0),
        upgrade.valid_edges(HOSTILE, [HOSTILE]),
    ],
)
def test_reads_carry_user_text_only_as_variables(built: tuple[queries.Params, str]) -> None:
    params, query = built
    assert HOSTILE not in query
    assert HOSTILE in params.values.values()
    declared = dict(re.findall(r"(\$\w+): (string|int)", query))
    assert set(declared) == set(params.values)  # every variable is declared with its type, and only those
    assert set(re.findall(r"\$\w+", query)) <= set(declared)


def test_writes_carry_user_text_only_as_variables_and_typed_values() -> None:
    up = change_set_upsert(hostile_change_set())
    assert HOSTILE not in up.query
    announcement = Announcement.of(hostile_change_set(), ApplyResult())
    marked = events_upsert(HOSTILE, [HOSTILE], HOSTILE, announcement)
    # a restated relation edge and thesis the store has ended (hostile props), and the upgrade's derived edges
    when = datetime(2020, 1, 1, tzinfo=UTC)
    restated = hostile_change_set()
    relation = Edge(
        id="r_" + HOSTILE,
        user_id=HOSTILE,
        kind=EdgeKind.RELATION,
        source=restated.vertices[0].id,
        target=restated.vertices[0].id,
        relation=HOSTILE,
        t_valid=when,
    )
    restated.edges = [relation]
    restated.invalidations = []
    thesis = restated.vertices[1].model_copy(update={"t_valid": when})
    restated.vertices[1] = thesis
    ended = {k: Ended(when, {"k": HOSTILE}, HOSTILE) for k in (relation.id, thesis.id)}
    reopened = change_set_upsert(restated, ended)
    assert sum(bool(m.deletes) for m in reopened.mutations) == 2  # both reopened: their invalidation cleared
    derived = upgrade.derived_upsert(
        HOSTILE, [relation.model_copy(update={"t_invalid": when, "invalidated_by": HOSTILE})]
    )
    for upsert in (up, marked, announced_upsert(HOSTILE, [HOSTILE]), delete_user_upsert(HOSTILE), reopened, derived):
        assert HOSTILE not in upsert.query
        for mutation in upsert.mutations:
            assert HOSTILE not in mutation.cond
            for nquad in [*mutation.nquads, *mutation.deletes]:
                # subjects and links name our own query variables; user text is only ever a str_val
                assert re.fullmatch(r"uid\([a-z]+\d*\)", nquad.subject)
                assert nquad.object_id == "" or re.fullmatch(r"uid\([a-z]+\d*\)", nquad.object_id)
    values = [nq.object_value.str_val for m in up.mutations for nq in m.nquads]
    assert HOSTILE in values and '{"k":"' + HOSTILE.replace('"', '\\"') + '"}' in values
    query, variables, mutation = kv_put_upsert(HOSTILE, HOSTILE)
    assert HOSTILE not in query and variables == {"$k": HOSTILE}
    assert {nq.object_value.str_val for nq in mutation.nquads} >= {HOSTILE}


def test_a_change_set_is_one_request_with_one_condition_per_write() -> None:
    up = change_set_upsert(hostile_change_set())
    # two vertices, one edge, one invalidation: folded into the thesis if it is new, applied to it if it is stored
    assert len(up.mutations) == 4
    assert all("lt(len(seen), 1)" in m.cond for m in up.mutations)  # nothing at all when the event was applied
    assert up.folded == {ids.thesis_id(HOSTILE, HOSTILE)}


def test_rank_keys_sort_newest_first_with_missing_times_last() -> None:
    t1, t2 = datetime(2023, 1, 1, tzinfo=UTC), datetime(2024, 1, 1, tzinfo=UTC)
    keys = {
        "t2": rank_key(t2, None),
        "t2c": rank_key(t2, t1),
        "t1": rank_key(t1, t2),
        "none_c": rank_key(None, t2),
        "none": rank_key(None, None),
    }
    assert sorted(keys, key=keys.__getitem__, reverse=True) == ["t2c", "t2", "t1", "none_c", "none"]
    # naive times are UTC, other zones are converted
    assert rank_key(datetime(2024, 1, 1)) == rank_key(t2)


def test_schema_declares_the_types_and_indexes() -> None:
    text = schema_text()
    for line in (
        "vertex.id: string @index(exact) @upsert .",
        "vertex.name: string @index(term, fulltext) .",
        "vertex.t_valid: datetime @index(hour) .",
        "edge.source: uid @reverse .",
        "edge.target: uid @reverse .",
    ):
        assert line in text
    assert {"Object", "Thesis", "Episode", "Edge"} <= set(re.findall(r"^type (\w+) \{", text, re.MULTILINE))
    assert text == Path(__file__).parents[2].joinpath("schemas", "dgraph.dql").read_text()


def test_bm25_text_keeps_words_only() -> None:
    assert bm25_text("?!.,;") is None
    assert bm25_text('Where does "Alice" live: Berlin? berlin') == "where does alice live berlin"
    assert bm25_text(" ".join(f"w{n}" for n in range(100))) == " ".join(f"w{n}" for n in range(64))


def test_tenant_names_are_valid_for_any_user_id() -> None:
    for user in ("alice", HOSTILE, "ü" * 300, ""):
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tenant_name(user))
    assert tenant_name("alice") != tenant_name("Alice")


def test_ollama_schema_patterns() -> None:
    assert portable_pattern(r"^K\d+$") == "^K[0-9]+$"
    assert portable_pattern(r"^[\d-]+\.\w$") == r"^[0-9-]+\.[A-Za-z0-9_]$"
    assert portable_pattern(r"^\s+$") is None
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "refs": {"type": "array", "items": {"type": "string", "pattern": r"^K\d+$"}},
            "pattern": {"type": "string", "pattern": r"\bword"},  # a property called "pattern" stays
        },
        "$defs": {"X": {"anyOf": [{"type": "string", "pattern": r"\S+"}, {"type": "null"}]}},
    }
    out = ollama_schema(schema)
    assert out["properties"]["refs"]["items"]["pattern"] == "^K[0-9]+$"
    assert out["properties"]["pattern"] == {"type": "string"}
    assert out["$defs"]["X"]["anyOf"][0] == {"type": "string"}
    assert schema["properties"]["refs"]["items"]["pattern"] == r"^K\d+$"  # the task's own schema is untouched


async def test_remote_store_needs_its_addresses() -> None:
    settings = Settings(_env_file=None, store="remote", dgraph=None, weaviate_http=None, weaviate_grpc="h:1")
    with pytest.raises(ValueError, match="MEMSTREAM_DGRAPH, MEMSTREAM_WEAVIATE_HTTP"):
        await RemoteMemoryStore.from_settings(settings, dim=8)


def test_a_props_update_is_one_guarded_write_of_typed_text() -> None:
    """``ChangeSet.props_updates`` (a known thesis's marks changed): one conditional set of ``vertex.props``."""
    update = PropsUpdate(thesis_id=HOSTILE, props={"marks": HOSTILE})
    up = change_set_upsert(ChangeSet(id="c_2", user_id=HOSTILE, event_ids=[HOSTILE], props_updates=[update]))
    assert HOSTILE not in up.query
    [mutation] = up.mutations
    assert mutation.cond == "@if(gt(len(pu0), 0) AND lt(len(seen), 1))"
    [nquad] = mutation.nquads
    assert (nquad.subject, nquad.predicate) == ("uid(pu0)", "vertex.props")
    assert json.loads(nquad.object_value.str_val) == {"marks": HOSTILE}
    assert 'eq(vertex.kind, "thesis")' in up.query  # only a thesis's props, and only the user's (filter below)
    assert "eq(vertex.user, $u)" in up.query
