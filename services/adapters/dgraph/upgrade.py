"""One-time data upgrades, run when a store opens (after the schema alter) and recorded so they never run again.

``edge-validity-1``: relation edges written before they carried validity (all valid) take it from the theses that
state them (``Edge.stated_by``), as memorize gives it now. Only a user with an invalidated thesis can have such an
edge; each edge is written only if it is still valid (so a concurrent open, or a memorize in between, is safe),
and the upgrade is recorded once done. A crash part way leaves it unrecorded: the next open runs it again, which
changes nothing already derived.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from services import ids
from services.domain import Edge, Vertex
from services.logging import get_logger

from .codec import Values, dt_text, props_text, read_edge, read_vertex
from .queries import Params
from .write import Mutation, Upsert, nquads

log = get_logger(__name__)

EDGE_VALIDITY = "edge-validity-1"
PAGE = 1000

Query = Callable[[str, str, Mapping[str, str]], Awaitable[dict[str, Any]]]
Request = Callable[[str, str, Mapping[str, str], Sequence[Mutation]], Awaitable[dict[str, Any]]]

_DONE = "query q($id: string) { q(func: eq(upgrade.id, $id)) { upgrade.id } }"
_USERS = (
    'query q($n: int, $o: int) { q(func: eq(vertex.kind, "thesis"), orderasc: vertex.id, first: $n, offset: $o) '
    "@filter(has(vertex.t_invalid)) { vertex.user } }"
)
_THESIS_FIELDS = "vertex.id vertex.user vertex.kind vertex.props vertex.t_valid vertex.t_invalid vertex.t_expired"


def theses_page(user_id: str, offset: int) -> tuple[Params, str]:
    p = Params(user_id)
    body = (
        f"q(func: eq(vertex.user, $u), orderasc: vertex.id, first: {p.add(PAGE, 'n')}, offset: {p.add(offset, 'o')}) "
        f'@filter(eq(vertex.kind, "thesis")) {{ {_THESIS_FIELDS} vertex.invalidated_by }}'
    )
    return p, p.query(body, fragments=False)


def valid_edges(user_id: str, edge_ids: Iterable[str]) -> tuple[Params, str]:
    p = Params(user_id)
    body = (
        f"q(func: eq(edge.id, {p.many(edge_ids)})) "
        '@filter(eq(edge.user, $u) AND eq(edge.kind, "relation") AND NOT has(edge.t_invalid)) '
        "{ edge.id edge.user edge.kind edge.relation edge.props edge.t_valid }"
    )
    return p, p.query(body, fragments=False)


def derived_upsert(user_id: str, edges: Sequence[Edge]) -> Upsert:
    """Each edge's derived validity, written only while the stored edge is still valid."""
    up = Upsert(Params(user_id))
    for n, edge in enumerate(edges):
        up.blocks.append(
            f"d{n} as var(func: eq(edge.id, {up.params.add(edge.id)})) "
            "@filter(eq(edge.user, $u) AND NOT has(edge.t_invalid))"
        )
        values: Values = {"edge.props": props_text(edge.props)}
        for name, value in (("t_invalid", dt_text(edge.t_invalid)), ("t_expired", dt_text(edge.t_expired))):
            if value is not None:
                values[f"edge.{name}"] = value
        if edge.invalidated_by is not None:
            values["edge.invalidated_by"] = edge.invalidated_by
        up.mutations.append(Mutation(nquads(f"uid(d{n})", values), f"@if(gt(len(d{n}), 0))"))
    return up


def _done_upsert(name: str) -> tuple[str, dict[str, str], Mutation]:
    query = "query q($id: string) { m as var(func: eq(upgrade.id, $id)) }"
    values: Values = {"dgraph.type": "Upgrade", "upgrade.id": name}
    return query, {"$id": name}, Mutation(nquads("uid(m)", values), "@if(eq(len(m), 0))")


async def _pages(query: Query, op: str, make: Callable[[int], tuple[str, Mapping[str, str]]]) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = []
    while True:
        text, variables = make(len(nodes))
        page = (await query(op, text, variables)).get("q", [])
        nodes.extend(page)
        if len(page) < PAGE:
            return nodes


async def derive_edge_validity(query: Query, request: Request) -> int:
    """Run ``edge-validity-1`` unless it was; returns how many edges it changed."""
    if (await query("upgrade_done", _DONE, {"$id": EDGE_VALIDITY})).get("q"):
        return 0
    rows = await _pages(query, "upgrade_users", lambda o: (_USERS, {"$n": str(PAGE), "$o": str(o)}))
    changed = 0
    for user in sorted({str(row["vertex.user"]) for row in rows}):

        def page(offset: int, user: str = user) -> tuple[str, Mapping[str, str]]:
            params, text = theses_page(user, offset)
            return text, params.values

        staters: dict[str, list[Vertex]] = {}
        for node in await _pages(query, "upgrade_theses", page):
            thesis = read_vertex(node)
            edge_id = ids.stated_relation(user, thesis.props)
            if edge_id is not None:
                staters.setdefault(edge_id, []).append(thesis)
        wanted = sorted(staters)
        for start in range(0, len(wanted), PAGE):
            params, text = valid_edges(user, wanted[start : start + PAGE])
            nodes = (await query("upgrade_edges", text, params.values)).get("q", [])
            edges = [read_edge(node, "", "") for node in nodes]
            mended = [m for e in edges if (m := e.stated_by(staters[e.id])) != e]
            if mended:
                up = derived_upsert(user, mended)
                await request("upgrade_derive", up.query, up.params.values, up.mutations)
                changed += len(mended)
    text, variables, mutation = _done_upsert(EDGE_VALIDITY)
    await request("upgrade_record", text, variables, [mutation])
    log.info("dgraph_upgraded", upgrade=EDGE_VALIDITY, edges=changed)
    return changed
