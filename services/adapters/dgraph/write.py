"""The write path as Dgraph upsert blocks: one request (one transaction) per change set, one per event marking.

A change set becomes one query block per id it touches and one conditional mutation per vertex, edge and
invalidation. The queries find the existing nodes (always within the user); each mutation runs only if its node
is missing (vertices, edges) or still valid (invalidations), and only if not every event was applied before.
``uid(aN)`` names the same node in every mutation of the request, existing or new, so an edge can point at a
vertex created by the same request. The named query blocks return what existed before, which gives the counts.

The writes are idempotent: a vertex, edge or invalidation that is already there is left alone (first write wins),
as in the embedded store.

Mutations are protobuf N-Quads whose values are typed string values, never JSON or RDF text: Dgraph reads a JSON
string such as "uid(x)" or "val(x)" as a variable reference, and one like "[1, 2]" as a vector, so user text in
a JSON mutation could point a write at another node. An N-Quad's ``str_val`` is only ever data.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydgraph.proto import api_pb2 as api

from services.domain import (
    Announcement,
    ApplyResult,
    ChangeSet,
    Edge,
    EdgeInvalidation,
    EdgeKind,
    Invalidation,
    Vertex,
    VertexKind,
)
from services.validity import reopened

from .codec import Values, dt_text, edge_values, props_text, vertex_values
from .queries import VALID_THESIS, Params

STAR = "_STAR_ALL"  # what Dgraph's RDF parser makes of ``*`` (x.Star)


@dataclass
class Mutation:
    nquads: list[api.NQuad] = field(default_factory=list)
    cond: str = ""
    deletes: list[api.NQuad] = field(default_factory=list)

    def proto(self) -> api.Mutation:
        return api.Mutation(**{"set": self.nquads, "del": self.deletes, "cond": self.cond})


def nquads(subject: str, values: Values, links: Mapping[str, str] | None = None) -> list[api.NQuad]:
    """``subject``'s predicates as N-Quads: values are data (str_val); ``links`` point at nodes (``uid(var)``)."""
    out = []
    for predicate, value in values.items():
        for one in [value] if isinstance(value, str) else value:
            out.append(api.NQuad(subject=subject, predicate=predicate, object_value=api.Value(str_val=one)))
    for predicate, target in (links or {}).items():
        out.append(api.NQuad(subject=subject, predicate=predicate, object_id=target))
    return out


def delete_node(var: str) -> api.NQuad:
    """Every predicate of the nodes in ``var`` (``S * *``)."""
    return api.NQuad(subject=f"uid({var})", predicate=STAR, object_value=api.Value(default_val=STAR))


def delete_predicates(var: str, names: Sequence[str], keep: Container[str] = ()) -> list[api.NQuad]:
    """``S P *`` for each of ``names`` not in ``keep`` (the values being written): a field set back to none."""
    star = api.Value(default_val=STAR)
    return [api.NQuad(subject=f"uid({var})", predicate=name, object_value=star) for name in names if name not in keep]


def applied_event(user_id: str, event_id: str, change_set_id: str, forgotten: bool = False) -> Values:
    """An applied-event node; ``forgotten``: the event's memory was erased (known, so it is never applied again)."""
    values: Values = {
        "dgraph.type": "AppliedEvent",
        "event.id": event_id,
        "event.user": user_id,
        "event.change_set": change_set_id,
    }
    if forgotten:
        values["event.forgotten"] = "true"
    return values


@dataclass
class Upsert:
    params: Params
    blocks: list[str] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)

    @property
    def query(self) -> str:
        return self.params.query("\n".join(self.blocks), fragments=False)


@dataclass
class ChangeSetUpsert(Upsert):
    event_ids: list[str] = field(default_factory=list)
    vertices: dict[str, Vertex] = field(default_factory=dict)
    edges: dict[str, Edge] = field(default_factory=dict)
    invalidations: dict[str, Invalidation] = field(default_factory=dict)
    # invalidations of theses written by this change set, folded into the thesis itself
    folded: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Ended:
    """A stored thesis or relation edge found ended before the write: ``t_invalid`` as stored, and its props."""

    t_invalid: datetime
    props: dict[str, str]
    invalidated_by: str | None = None


def _first_by_id(items: Sequence[Any], key: str = "id") -> dict[str, Any]:
    """First occurrence per id wins, as with INSERT OR IGNORE in the embedded store."""
    out: dict[str, Any] = {}
    for item in items:
        out.setdefault(getattr(item, key), item)
    return out


def _invalidated(inv: Invalidation) -> Values:
    return {
        "vertex.t_invalid": dt_text(inv.t_invalid) or "",
        "vertex.t_expired": dt_text(inv.t_expired) or "",
        "vertex.invalidated_by": inv.invalidated_by,
    }


def _edge_invalidated(inv: EdgeInvalidation) -> Values:
    return {
        "edge.t_invalid": dt_text(inv.t_invalid) or "",
        "edge.t_expired": dt_text(inv.t_expired) or "",
        "edge.invalidated_by": inv.invalidated_by,
    }


#: what a relation edge loses when a valid thesis states it again (see ``change_set_upsert``)
EDGE_INVALIDATION = ("edge.t_invalid", "edge.t_expired", "edge.invalidated_by")


def _reopen(up: ChangeSetUpsert, n: str, var: str, prefix: str, was: Ended, restated: datetime) -> None:
    """Reopen the node in ``var`` if it is still ended as it was read (``was``): cleared invalidation, the time
    in between kept as a gap (``services.validity``), as the embedded store's ``_reopen``."""
    if was.t_invalid > restated:
        return  # stated again about an earlier time than it ended: it stays as it is
    p = up.params
    as_read = p.add(dt_text(was.t_invalid) or "")
    up.blocks.append(f"ro{n} as var(func: uid({var})) @filter(eq({prefix}.t_invalid, {as_read}))")
    props: Values = {f"{prefix}.props": props_text(reopened(was.props, was.t_invalid, restated, was.invalidated_by))}
    cleared = delete_predicates(f"ro{n}", [f"{prefix}.{k}" for k in ("t_invalid", "t_expired", "invalidated_by")])
    guard = f" AND lt(len(seen), {len(up.event_ids)})" if up.event_ids else ""
    up.mutations.append(Mutation(nquads(f"uid(ro{n})", props), f"@if(gt(len(ro{n}), 0){guard})", cleared))


def change_set_upsert(change_set: ChangeSet, ended: Mapping[str, Ended] | None = None) -> ChangeSetUpsert:
    """``ended``: the change set's theses and relation edges the store has ended (``queries.ended``), by id."""
    ended = ended or {}
    user = change_set.user_id
    up = ChangeSetUpsert(
        Params(user),
        event_ids=list(dict.fromkeys(change_set.event_ids)),
        vertices=_first_by_id(change_set.vertices),
        edges=_first_by_id(change_set.edges),
        invalidations=_first_by_id(change_set.invalidations, "thesis_id"),
    )
    p = up.params
    guard = ""
    if up.event_ids:
        # nothing is written when every event was applied before (a replay)
        up.blocks.append(f"seen as var(func: eq(event.id, {p.many(up.event_ids, 'ev')})) @filter(eq(event.user, $u))")
        up.blocks.append("seen_before(func: uid(seen)) { event.id }")
        guard = f" AND lt(len(seen), {len(up.event_ids)})"

    # one variable per vertex id: the vertices written and the far ends of the edges
    node: dict[str, str] = {}
    for vid in [*up.vertices, *(end for e in up.edges.values() for end in (e.source, e.target))]:
        if vid not in node:
            node[vid] = f"a{len(node)}"
            up.blocks.append(f"{node[vid]} as var(func: eq(vertex.id, {p.add(vid)})) @filter(eq(vertex.user, $u))")

    written = []
    restated = {v.id for v in change_set.restated_theses()}
    for n, (vid, vertex) in enumerate(up.vertices.items()):
        # a vertex counts as there once it has a kind: a bare one (an edge's end, written first) is filled in
        up.blocks.append(f"w{n} as var(func: uid({node[vid]})) @filter(has(vertex.kind))")
        written.append(f"w{n}")
        values = vertex_values(vertex)
        inv = up.invalidations.get(vid)
        if inv is not None and vertex.kind is VertexKind.THESIS and vertex.t_invalid is None:
            values.update(_invalidated(inv))
            up.folded.add(vid)
        up.mutations.append(Mutation(nquads(f"uid({node[vid]})", values), f"@if(eq(len(w{n}), 0){guard})"))
        if vid in restated and vid in ended and vertex.t_valid is not None:
            _reopen(up, f"v{n}", f"w{n}", "vertex", ended[vid], vertex.t_valid)
    if written:
        up.blocks.append(f"vertices_before(func: uid({', '.join(written)})) {{ vertex.id }}")

    for vid, var in node.items():
        if vid not in up.vertices:  # an end this change set does not write: make it a bare vertex if missing
            bare: Values = {"dgraph.type": "Vertex", "vertex.id": vid, "vertex.user": user}
            up.mutations.append(Mutation(nquads(f"uid({var})", bare), f"@if(eq(len({var}), 0){guard})"))

    edges_found = []
    for n, (eid, edge) in enumerate(up.edges.items()):
        up.blocks.append(f"e{n} as var(func: eq(edge.id, {p.add(eid)})) @filter(eq(edge.user, $u))")
        edges_found.append(f"e{n}")
        ends = {"edge.source": f"uid({node[edge.source]})", "edge.target": f"uid({node[edge.target]})"}
        up.mutations.append(Mutation(nquads(f"uid(e{n})", edge_values(edge), ends), f"@if(eq(len(e{n}), 0){guard})"))
        if edge.kind is EdgeKind.RELATION and edge.t_invalid is None and edge.t_valid is not None and eid in ended:
            _reopen(up, f"e{n}", f"e{n}", "edge", ended[eid], edge.t_valid)
    if edges_found:
        up.blocks.append(f"edges_before(func: uid({', '.join(edges_found)})) {{ edge.id }}")

    valid = []
    for n, (tid, inv) in enumerate(up.invalidations.items()):
        up.blocks.append(f"t{n} as var(func: eq(vertex.id, {p.add(tid)})) @filter({VALID_THESIS})")
        valid.append(f"t{n}")
        up.mutations.append(Mutation(nquads(f"uid(t{n})", _invalidated(inv)), f"@if(gt(len(t{n}), 0){guard})"))
    if valid:
        up.blocks.append(f"valid_before(func: uid({', '.join(valid)})) {{ vertex.id }}")

    for n, update in enumerate(_first_by_id(change_set.props_updates, "thesis_id").values()):
        # a known thesis's marks changed: its props whole, as memorize computed them (the embedded _PUT_PROPS)
        up.blocks.append(
            f"pu{n} as var(func: eq(vertex.id, {p.add(update.thesis_id)})) "
            '@filter(eq(vertex.user, $u) AND eq(vertex.kind, "thesis"))'
        )
        props: Values = {"vertex.props": props_text(update.props)}
        up.mutations.append(Mutation(nquads(f"uid(pu{n})", props), f"@if(gt(len(pu{n}), 0){guard})"))

    for n, ending in enumerate(_first_by_id(change_set.edge_invalidations, "edge_id").values()):
        # first one wins, as for theses: only a relation edge still valid is ended
        up.blocks.append(
            f"x{n} as var(func: eq(edge.id, {p.add(ending.edge_id)})) "
            '@filter(eq(edge.user, $u) AND eq(edge.kind, "relation") AND NOT has(edge.t_invalid))'
        )
        up.mutations.append(Mutation(nquads(f"uid(x{n})", _edge_invalidated(ending)), f"@if(gt(len(x{n}), 0){guard})"))
    return up


def _ids(result: Mapping[str, Any], block: str, predicate: str) -> set[str]:
    return {node[predicate] for node in result.get(block, [])}


def change_set_result(up: ChangeSetUpsert, result: Mapping[str, Any]) -> ApplyResult:
    """Counts from what the request's queries saw before its mutations ran (all in one transaction)."""
    seen = _ids(result, "seen_before", "event.id")
    if up.event_ids and seen >= set(up.event_ids):
        return ApplyResult(skipped_events=up.event_ids)
    vertices_before = _ids(result, "vertices_before", "vertex.id")
    new = [v for vid, v in up.vertices.items() if vid not in vertices_before]
    valid_before = _ids(result, "valid_before", "vertex.id")
    folded_new = {v.id for v in new if v.id in up.folded}
    return ApplyResult(
        vertices_added=len(new),
        theses_added=sum(v.kind is VertexKind.THESIS for v in new),
        edges_added=len(set(up.edges) - _ids(result, "edges_before", "edge.id")),
        theses_invalidated=len(valid_before | folded_new),
        skipped_events=[e for e in up.event_ids if e in seen],
    )


def events_upsert(
    user_id: str, event_ids: Sequence[str], change_set_id: str, announcement: Announcement | None = None
) -> Upsert:
    """Mark events as applied (each once) and, in the same transaction, record the change set's pending
    announcement."""
    up = Upsert(Params(user_id))
    if announcement is not None:
        cs = up.params.add(change_set_id)
        up.blocks.append(f"pa as var(func: eq(announce.id, {cs})) @filter(eq(announce.user, $u))")
        pending: Values = {
            "dgraph.type": "Announcement",
            "announce.id": change_set_id,
            "announce.user": user_id,
            "announce.body": announcement.model_dump_json(),
        }
        up.mutations.append(Mutation(nquads("uid(pa)", pending)))
    for n, event_id in enumerate(dict.fromkeys(event_ids)):
        var = f"m{n}"
        up.blocks.append(f"{var} as var(func: eq(event.id, {up.params.add(event_id)})) @filter(eq(event.user, $u))")
        values = applied_event(user_id, event_id, change_set_id)
        up.mutations.append(Mutation(nquads(f"uid({var})", values), f"@if(eq(len({var}), 0))"))
    return up


def announced_upsert(user_id: str, change_set_ids: Sequence[str]) -> Upsert:
    """Forget the pending announcements of these change sets (they were published)."""
    up = Upsert(Params(user_id))
    ids = up.params.many(change_set_ids)
    up.blocks.append(f"done as var(func: eq(announce.id, {ids})) @filter(eq(announce.user, $u))")
    up.mutations.append(Mutation(deletes=[delete_node("done")]))
    return up


def kv_put_upsert(key: str, value: str) -> tuple[str, dict[str, str], Mutation]:
    query = "query q($k: string) { entry as var(func: eq(kv.key, $k)) }"
    values: Values = {"dgraph.type": "CacheEntry", "kv.key": key, "kv.value": value}
    return query, {"$k": key}, Mutation(nquads("uid(entry)", values))


def delete_user_upsert(user_id: str) -> Upsert:
    """Every node of one user (vertices, edges, applied and forgotten events, pending announcements, applied
    forgets), every predicate (``S * *``). For tests and tools: a user's forget in use is a ``Forget`` tombstone."""
    up = Upsert(Params(user_id))
    up.blocks = [
        "vs as var(func: eq(vertex.user, $u))",
        "es as var(func: eq(edge.user, $u))",
        "evs as var(func: eq(event.user, $u))",
        "pas as var(func: eq(announce.user, $u))",
        "fs as var(func: eq(forget.user, $u))",
    ]
    deletes = [delete_node(var) for var in ("vs", "es", "evs", "pas", "fs")]
    up.mutations.append(Mutation(deletes=deletes))
    return up
