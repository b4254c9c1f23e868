"""Forgetting in Dgraph: the reads a forget plans with, the one upsert request that applies it, and the cache's
sources. Values travel as DQL variables and typed N-Quad values, as everywhere in this adapter (see ``write``)."""

from __future__ import annotations

from collections.abc import Sequence

from services.domain import Erasure
from services.ports import CacheScope

from .codec import Values, edge_values, vertex_values
from .queries import Params
from .write import EDGE_INVALIDATION, Mutation, Upsert, applied_event, delete_node, delete_predicates, nquads

#: ``kv.events`` of an entry built from the user's memory at large (questions, contradiction checks)
NO_EVENTS = "-"
#: the predicates a kept vertex may lose when it is put back (a thesis made valid again)
_NULLABLE = ("vertex.t_invalid", "vertex.t_expired", "vertex.invalidated_by")


def episodes_query(user_id: str) -> tuple[Params, str]:
    """The user's episodes (props are JSON text, matched by the caller)."""
    p = Params(user_id)
    return p, p.query('q(func: eq(vertex.user, $u), orderasc: vertex.id) @filter(eq(vertex.kind, "episodic")) { ...V }')


def invalidated_by_query(user_id: str, thesis_ids: Sequence[str]) -> tuple[Params, str]:
    p = Params(user_id)
    body = (
        f"q(func: eq(vertex.invalidated_by, {p.many(thesis_ids)}), orderasc: vertex.id) "
        '@filter(eq(vertex.user, $u) AND eq(vertex.kind, "thesis")) { ...V }'
    )
    return p, p.query(body)


def outcome_query(user_id: str, forget_id: str) -> tuple[Params, str]:
    p = Params(user_id)
    body = f"q(func: eq(forget.id, {p.add(forget_id)}), first: 1) @filter(eq(forget.user, $u)) {{ forget.outcome }}"
    return p, p.query(body, False)


def erase_upsert(erasure: Erasure) -> Upsert:
    """One request, one transaction; nothing happens if the forget was applied before."""
    user = erasure.user_id
    up = Upsert(Params(user))
    p = up.params
    up.blocks.append(f"done as var(func: eq(forget.id, {p.add(erasure.forget_id)})) @filter(eq(forget.user, $u))")
    once = "@if(eq(len(done), 0))"
    if erasure.whole_user:
        up.blocks += [
            "vs as var(func: eq(vertex.user, $u))",
            "es as var(func: eq(edge.user, $u))",
            "pas as var(func: eq(announce.user, $u))",
            "evs as var(func: eq(event.user, $u))",
        ]
        forgotten = nquads("uid(evs)", {"event.change_set": erasure.forget_id, "event.forgotten": "true"})
        up.mutations.append(Mutation(forgotten, once, [delete_node(v) for v in ("vs", "es", "pas")]))
    else:
        if erasure.delete_vertices:
            up.blocks.append(
                f"dv as var(func: eq(vertex.id, {p.many(erasure.delete_vertices)})) @filter(eq(vertex.user, $u))"
            )
            up.mutations.append(Mutation(cond=once, deletes=[delete_node("dv")]))
        if erasure.delete_edges:
            up.blocks.append(f"de as var(func: eq(edge.id, {p.many(erasure.delete_edges)})) @filter(eq(edge.user, $u))")
            up.mutations.append(Mutation(cond=once, deletes=[delete_node("de")]))
        # one variable per vertex put or at an end of an edge put: ``uid(nK)`` names the same node in every
        # mutation of the request, existing or created by it (a fact written anew in its source's own words)
        node: dict[str, str] = {}
        for vid in [
            *(v.id for v in erasure.put_vertices),
            *(x for e in erasure.put_edges for x in (e.source, e.target)),
        ]:
            if vid not in node:
                node[vid] = f"n{len(node)}"
                up.blocks.append(f"{node[vid]} as var(func: eq(vertex.id, {p.add(vid)})) @filter(eq(vertex.user, $u))")
        for vertex in erasure.put_vertices:
            var = node[vertex.id]
            values = vertex_values(vertex)
            up.mutations.append(
                Mutation(nquads(f"uid({var})", values), once, delete_predicates(var, _NULLABLE, values))
            )
        for n, edge in enumerate(erasure.put_edges):
            var = f"pe{n}"
            up.blocks.append(f"{var} as var(func: eq(edge.id, {p.add(edge.id)})) @filter(eq(edge.user, $u))")
            ends = {"edge.source": f"uid({node[edge.source]})", "edge.target": f"uid({node[edge.target]})"}
            values = edge_values(edge)
            cleared = delete_predicates(var, EDGE_INVALIDATION, values)
            up.mutations.append(Mutation(nquads(f"uid({var})", values, ends), once, cleared))
        for n, event_id in enumerate(erasure.event_ids):
            var = f"ev{n}"
            up.blocks.append(f"{var} as var(func: eq(event.id, {p.add(event_id)})) @filter(eq(event.user, $u))")
            marker = applied_event(user, event_id, erasure.forget_id, forgotten=True)
            up.mutations.append(Mutation(nquads(f"uid({var})", marker), once))
    record: Values = {
        "dgraph.type": "ForgetRecord",
        "forget.id": erasure.forget_id,
        "forget.user": user,
        "forget.outcome": erasure.outcome,
    }
    up.mutations.append(Mutation(nquads("uid(done)", record), once))
    return up


def kv_sources(scope: CacheScope | None) -> Values:
    """The predicates that say whose text a cache entry was built from."""
    if scope is None:
        return {}
    return {"kv.user": scope.user_id, "kv.events": list(scope.event_ids) or [NO_EVENTS]}


def kv_forget_upsert(user_id: str, event_ids: Sequence[str] | None) -> Upsert:
    up = Upsert(Params(user_id))
    if event_ids is None:
        up.blocks.append("gone as var(func: eq(kv.user, $u))")
    else:
        events = up.params.many([*event_ids, NO_EVENTS])
        up.blocks.append(f"gone as var(func: eq(kv.user, $u)) @filter(eq(kv.events, {events}))")
    up.blocks.append("removed(func: uid(gone)) { count(uid) }")
    up.mutations.append(Mutation(deletes=[delete_node("gone")]))
    return up
