"""Undo an entity merge: an alias ("Mel") becomes its own object again, with the facts said with it.

Entity resolution (``services.memorize.entities``) attached the facts that said "Mel" to Melanie's object and kept
an alias record (``ChangeSetBuilder._alias``) and, on each such thesis, the name it was said with
(``subject_alias``/``object_alias``). Unmerging turns the record into a plain object (so later mentions of the
name stay apart: an exact name is never resolved again) and moves those theses to it: their subject or object,
their thesis edge, the relation edge they state (indexed anew), and the episodes' links where the canonical object
no longer has a fact of them. The canonical object keeps everything else, and goes only if nothing is left on it.
Applied in one store call (``ForgetStore.erase``, the store's one rewrite path), then the cached answers built
from the user's memory at large are dropped, as they may have read the merged object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from services import ids
from services.domain import ALIAS_OF, Edge, EdgeKind, Erasure, Vertex, VertexKind
from services.logging import get_logger
from services.memorize.builder import ALIAS_ENDS
from services.ports import Embedder, GraphStore, Stores, VectorItem, VectorStore

log = get_logger(__name__)


class NotAnAlias(LookupError):
    """The user has no merged alias of that name."""


@dataclass(frozen=True)
class Unmerged:
    alias: str
    alias_id: str
    canonical_id: str
    theses_moved: int
    canonical_removed: bool


def _edge(user_id: str, kind: EdgeKind, source: str, target: str, like: Edge | Vertex, relation: str = "") -> Edge:
    relation = relation or kind.value
    props = {"event_id": like.props.get("event_id", "")}
    fields = {} if isinstance(like, Vertex) else like.model_dump(include={"t_invalid", "t_expired", "invalidated_by"})
    return Edge(
        id=ids.edge_id(user_id, kind.value, source, relation, target),
        user_id=user_id,
        kind=kind,
        source=source,
        target=target,
        relation=relation,
        props=props,
        t_valid=like.t_valid,
        **fields,
    )


async def unmerge(stores: Stores, embedder: Embedder, user_id: str, alias: str) -> Unmerged:
    """Split the merged alias ``alias`` of ``user_id`` back into its own object; ``NotAnAlias`` if there is none."""
    graph = stores.graph
    key = ids.normalize_name(alias)
    record = (await graph.find_objects(user_id, [key])).get(key)
    if record is None or not record.alias_of:
        raise NotAnAlias(f"user {user_id!r} has no merged alias {alias!r}")
    canonical_id = record.alias_of
    around = await graph.neighbors(user_id, [canonical_id], [EdgeKind.THESIS, EdgeKind.RELATION])
    theses = {t.end.id: t.end for t in around if t.edge.kind is EdgeKind.THESIS and t.end.kind is VertexKind.THESIS}
    relations = {t.edge.id: t.edge for t in around if t.edge.kind is EdgeKind.RELATION}
    moved: dict[str, dict[str, str]] = {}  # thesis id -> its props with the alias as subject or object
    for tid, thesis in theses.items():
        ends = [end for end in ALIAS_ENDS if ids.normalize_name(thesis.props.get(f"{end}_alias", "")) == key]
        if ends:
            moved[tid] = {k: v for k, v in thesis.props.items() if k not in {f"{e}_alias" for e in ends}}
            moved[tid] |= {end: record.name for end in ends}
    kept = {tid for tid in theses if tid not in moved or canonical_id in _ends(user_id, moved[tid])}
    stays = {ids.stated_relation(user_id, theses[tid].props if tid not in moved else moved[tid]) for tid in kept}
    erasure = Erasure(
        forget_id="u_" + ids.digest(user_id, "unmerge", record.id, datetime.now(UTC).isoformat()), user_id=user_id
    )
    props = {k: v for k, v in record.props.items() if k != ALIAS_OF} | {"unmerged_from": canonical_id}
    erasure.put_vertices.append(record.model_copy(update={"props": props}))
    new_relations: dict[str, Edge] = {}
    for tid, new_props in moved.items():
        thesis = theses[tid]
        erasure.put_vertices.append(thesis.model_copy(update={"props": new_props}))
        if tid not in kept:
            erasure.delete_edges.append(ids.edge_id(user_id, EdgeKind.THESIS.value, canonical_id, "thesis", tid))
        erasure.put_edges.append(_edge(user_id, EdgeKind.THESIS, record.id, tid, thesis))
        old_relation = ids.stated_relation(user_id, thesis.props)
        if ids.stated_relation(user_id, new_props) is not None:
            like: Edge | Vertex = relations.get(old_relation or "", thesis)
            start, target = (ids.object_id(user_id, new_props[end]) for end in ALIAS_ENDS)
            relation = like.relation if isinstance(like, Edge) else new_props["relation"]
            edge = _edge(user_id, EdgeKind.RELATION, start, target, like, relation)
            new_relations[edge.id] = edge
        if old_relation in relations and old_relation not in stays:
            erasure.delete_edges.append(old_relation)
            erasure.delete_vectors.append(old_relation)
    erasure.put_edges += new_relations.values()
    episodes = sorted({t.end.id for t in await graph.neighbors(user_id, sorted(moved), [EdgeKind.EPISODIC])})
    linked = await graph.neighbors(user_id, episodes, [EdgeKind.EPISODIC]) if episodes else []
    for episode_id in episodes:  # the canonical object keeps the episodes it still has a fact of
        if not any(t.start.id in kept and t.end.id == episode_id for t in linked):
            erasure.delete_edges.append(
                ids.edge_id(user_id, EdgeKind.EPISODIC.value, canonical_id, "episodic", episode_id)
            )
    removed = bool(moved) and not kept
    if removed:  # nothing was said of it but with this alias: it goes, as if never merged
        erasure.delete_vertices.append(canonical_id)
        erasure.delete_vectors.append(canonical_id)
        rest = await graph.neighbors(user_id, [canonical_id])
        erasure.delete_edges += [t.edge.id for t in rest if t.edge.id not in new_relations]
    vectors = await _vectors(graph, stores.vectors, embedder, user_id, list(new_relations.values()))
    erasure.outcome = json.dumps({"unmerged": record.name, "from": canonical_id, "theses_moved": len(moved)})
    await stores.forget.erase(erasure, vectors)
    # answers built from the user's memory at large may have read the merged object
    await stores.cache.forget(user_id, [])
    log.info("entity_unmerged", user_id=user_id, alias=record.name, canonical=canonical_id, theses=len(moved))
    return Unmerged(record.name, record.id, canonical_id, len(moved), removed)


def _ends(user_id: str, props: dict[str, str]) -> set[str]:
    return {ids.object_id(user_id, props[end]) for end in ALIAS_ENDS if props.get(end)}


async def _vectors(
    graph: GraphStore, index: VectorStore, embedder: Embedder, user_id: str, edges: list[Edge]
) -> list[VectorItem]:
    """Index entries of the relation edges written anew (as memorize indexes them: "source relation target")."""
    indexed = await index.get_vectors(user_id, [e.id for e in edges])
    todo = [e for e in edges if e.id not in indexed]
    if not todo:
        return []
    names = {
        v.id: v.name
        for v in (
            await graph.get_vertices(user_id, sorted({e.source for e in todo} | {e.target for e in todo}))
        ).values()
    }
    texts = [f"{names.get(e.source, '')} {e.relation} {names.get(e.target, '')}" for e in todo]
    embedded = await embedder.embed(texts)
    return [
        VectorItem(id=e.id, kind="triplet", text=t, vector=list(v))
        for e, t, v in zip(todo, texts, embedded, strict=True)
    ]
