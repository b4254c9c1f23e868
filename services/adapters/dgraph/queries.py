"""DQL for the graph reads. Every query is scoped to one user, and every value in it is a DQL variable.

Query text is built only from constants and variable names this module generates (``$v0``, ``$v1``...); the values
(user ids, vertex ids, names, edge kinds) travel separately in the request's variable map, so nothing a user types
can change a query's shape. DQL has no list-typed variables, so a list becomes ``[$v0, $v1, ...]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .codec import EDGE_FIELDS, VERTEX_FIELDS

FRAGMENTS = f"fragment V {{ {' '.join(VERTEX_FIELDS)} }}\nfragment E {{ {' '.join(EDGE_FIELDS)} }}"
# a written vertex of this user (a bare vertex, created by an edge that arrived first, has no kind yet)
OWN_VERTEX = "eq(vertex.user, $u) AND has(vertex.kind)"
VALID_THESIS = 'eq(vertex.user, $u) AND eq(vertex.kind, "thesis") AND NOT has(vertex.t_invalid)'
NEWEST_FIRST = "orderdesc: vertex.rank, orderasc: vertex.id"


@dataclass
class Params:
    """Variables of one DQL request; ``$u`` is always the user."""

    user_id: str
    values: dict[str, str] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.values["$u"] = self.user_id
        self.types["$u"] = "string"

    def add(self, value: str | int, prefix: str = "v") -> str:
        name = f"${prefix}{len(self.values)}"
        self.values[name] = str(value)
        self.types[name] = "int" if isinstance(value, int) else "string"
        return name

    def many(self, values: Iterable[str], prefix: str = "v") -> str:
        return "[" + ", ".join(self.add(value, prefix) for value in values) + "]"

    def declaration(self) -> str:
        return ", ".join(f"{name}: {kind}" for name, kind in self.types.items())

    def query(self, body: str, fragments: bool = True) -> str:
        return f"query q({self.declaration()}) {{\n{body}\n}}" + ("\n" + FRAGMENTS if fragments else "")


def get_vertices(user_id: str, ids: Iterable[str]) -> tuple[Params, str]:
    p = Params(user_id)
    return p, p.query(f"q(func: eq(vertex.id, {p.many(ids)})) @filter({OWN_VERTEX}) {{ ...V }}")


def find_objects(user_id: str, normalized_names: Iterable[str]) -> tuple[Params, str]:
    p = Params(user_id)
    body = (
        f"q(func: eq(vertex.norm_name, {p.many(normalized_names)}), orderasc: vertex.id) "
        f'@filter({OWN_VERTEX} AND eq(vertex.kind, "object")) {{ ...V vertex.norm_name }}'
    )
    return p, p.query(body)


def neighbors(
    user_id: str, vertex_ids: Iterable[str], edge_kinds: Iterable[str] | None, limit_per_vertex: int | None
) -> tuple[Params, str]:
    """The frontier with its outgoing and incoming edges and their far ends, all in one query.

    Each direction is ordered and cut to the limit on the server; the caller merges the two per vertex and cuts
    again, which gives the ``limit_per_vertex`` newest edges of both directions together.
    """
    p = Params(user_id)
    edge_filter = "eq(edge.user, $u)"
    if edge_kinds is not None:
        edge_filter += f" AND eq(edge.kind, {p.many(edge_kinds, 'k')})"
    order = "orderdesc: edge.rank, orderasc: edge.id"
    if limit_per_vertex is not None:
        order += f", first: {p.add(limit_per_vertex, 'n')}"
    body = f"""q(func: eq(vertex.id, {p.many(vertex_ids)})) @filter({OWN_VERTEX}) {{
  ...V
  out: ~edge.source ({order}) @filter({edge_filter}) {{ ...E edge.target @filter({OWN_VERTEX}) {{ ...V }} }}
  in: ~edge.target ({order}) @filter({edge_filter}) {{ ...E edge.source @filter({OWN_VERTEX}) {{ ...V }} }}
}}"""
    return p, p.query(body)


def get_triplets(user_id: str, edge_ids: Iterable[str]) -> tuple[Params, str]:
    p = Params(user_id)
    body = f"""q(func: eq(edge.id, {p.many(edge_ids)})) @filter(eq(edge.user, $u)) {{
  ...E
  edge.source @filter({OWN_VERTEX}) {{ ...V }}
  edge.target @filter({OWN_VERTEX}) {{ ...V }}
}}"""
    return p, p.query(body)


def valid_theses(user_id: str, about: Iterable[str] | None, limit: int) -> tuple[Params, str]:
    p = Params(user_id)
    first = p.add(limit, "n")
    if about is None:
        body = f"q(func: eq(vertex.user, $u), {NEWEST_FIRST}, first: {first}) @filter({VALID_THESIS}) {{ ...V }}"
        return p, p.query(body)
    # theses linked to the objects by an edge in either direction
    body = f"""var(func: eq(vertex.id, {p.many(about)})) @filter(eq(vertex.user, $u)) {{
  ~edge.source @filter(eq(edge.user, $u)) {{ linked_out as edge.target }}
  ~edge.target @filter(eq(edge.user, $u)) {{ linked_in as edge.source }}
}}
q(func: uid(linked_out, linked_in), {NEWEST_FIRST}, first: {first}) @filter({VALID_THESIS}) {{ ...V }}"""
    return p, p.query(body)


def seen_events(user_id: str, event_ids: Iterable[str]) -> tuple[Params, str]:
    p = Params(user_id)
    return p, p.query(f"q(func: eq(event.id, {p.many(event_ids)})) @filter(eq(event.user, $u)) {{ event.id }}", False)


def change_sets_of(user_id: str, event_ids: Iterable[str]) -> tuple[Params, str]:
    """The change set that applied each of these events."""
    p = Params(user_id)
    body = f"q(func: eq(event.id, {p.many(event_ids)})) @filter(eq(event.user, $u)) {{ event.change_set }}"
    return p, p.query(body, False)


def pending_announcements(user_id: str, change_set_ids: Iterable[str]) -> tuple[Params, str]:
    p = Params(user_id)
    body = f"q(func: eq(announce.id, {p.many(change_set_ids)})) @filter(eq(announce.user, $u)) {{ announce.body }}"
    return p, p.query(body, False)


def stats(user_id: str) -> tuple[Params, str]:
    p = Params(user_id)
    body = """vertices(func: eq(vertex.user, $u)) @filter(has(vertex.kind)) @groupby(vertex.kind) { count(uid) }
edges(func: eq(edge.user, $u)) @groupby(edge.kind) { count(uid) }
valid(func: eq(vertex.user, $u)) @filter(eq(vertex.kind, "thesis") AND NOT has(vertex.t_invalid)) { count(uid) }
invalid(func: eq(vertex.user, $u)) @filter(eq(vertex.kind, "thesis") AND has(vertex.t_invalid)) { count(uid) }
events(func: eq(event.user, $u)) @filter(NOT has(event.forgotten)) { count(uid) }"""
    return p, p.query(body, False)


def kv_get(key: str) -> tuple[dict[str, str], str]:
    return {"$k": key}, "query q($k: string) { q(func: eq(kv.key, $k), first: 1) { kv.value } }"


def ended(user_id: str, vertex_ids: Iterable[str], edge_ids: Iterable[str]) -> tuple[Params, str]:
    """Of these theses and relation edges, those ended (``t_invalid`` set), with their end and props: a change set
    that states one again reopens it (``write.change_set_upsert``)."""
    p = Params(user_id)
    vertices, edges = list(vertex_ids), list(edge_ids)
    body = []
    if vertices:
        body.append(
            f"v(func: eq(vertex.id, {p.many(vertices)})) "
            '@filter(eq(vertex.user, $u) AND eq(vertex.kind, "thesis") AND has(vertex.t_invalid)) '
            "{ vertex.id vertex.t_invalid vertex.props vertex.invalidated_by }"
        )
    if edges:
        body.append(
            f"e(func: eq(edge.id, {p.many(edges)})) "
            '@filter(eq(edge.user, $u) AND eq(edge.kind, "relation") AND has(edge.t_invalid)) '
            "{ edge.id edge.t_invalid edge.props edge.invalidated_by }"
        )
    return p, p.query("\n".join(body), fragments=False)
